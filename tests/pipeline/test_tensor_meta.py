"""The metadata header: a fixed dtype code table, round trips, named errors."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.pipeline.tensor_meta import (DTYPE_CODES, HEADER_LEN, TensorMeta,
                                                  decode_meta, encode_meta)

# The wire format between ranks: a code never changes (new dtypes get new codes at the end).
PINNED = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int64: 5,
    torch.int32: 6, torch.bool: 7, torch.uint8: 8, torch.int8: 9, torch.int16: 10,
    torch.complex64: 11, torch.complex128: 12, torch.float8_e4m3fn: 13, torch.float8_e5m2: 14,
}


def test_codes_are_pinned_unique_and_never_zero() -> None:
    assert dict(DTYPE_CODES) == PINNED
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES) and 0 not in DTYPE_CODES.values()


@pytest.mark.parametrize("dtype", list(PINNED))
@pytest.mark.parametrize("shape", [(), (3,), (1, 16, 32), tuple(range(1, HEADER_LEN - 1))])
def test_every_supported_dtype_round_trips(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    meta = TensorMeta(shape, dtype)
    header = encode_meta(meta)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    assert decode_meta(header) == meta
    assert TensorMeta.of(torch.zeros(shape, dtype=dtype)) == meta


def test_unknown_dtype_and_bad_headers_are_named_errors() -> None:
    with pytest.raises(ValueError,
                       match=r"activation dtype torch.quint8 has no code in DTYPE_CODES"):
        encode_meta(TensorMeta((2,), torch.quint8))
    with pytest.raises(ValueError, match=r"has 9 dims; a stage boundary carries at most 8"):
        encode_meta(TensorMeta((1,) * 9, torch.float32))
    with pytest.raises(ValueError, match=r"dtype code 0, which is not in DTYPE_CODES .*0 means "
                                         r"the header was never filled"):
        decode_meta(torch.zeros(HEADER_LEN, dtype=torch.int64))
    bad = encode_meta(TensorMeta((4, 8), torch.float32))
    bad[0] = 99
    with pytest.raises(ValueError, match="dtype code 99"):
        decode_meta(bad)
    bad[0], bad[1] = 1, 9
    with pytest.raises(ValueError, match="ndim 9, outside 0..8"):
        decode_meta(bad)
    with pytest.raises(ValueError, match=r"must be \[10\] int64"):
        decode_meta(torch.zeros(HEADER_LEN, dtype=torch.int32))
