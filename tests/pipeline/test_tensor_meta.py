"""The metadata header: a fixed dtype code table, round trips, named errors."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.pipeline.tensor_meta import (DTYPE_CODES, HEADER_LEN, MAX_NDIM, TensorMeta,
                                                  as_boundary_value, boundary_length,
                                                  boundary_meta_of, decode_boundary, decode_meta,
                                                  describe_boundary, encode_boundary, encode_meta)

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
@pytest.mark.parametrize("shape", [(), (3,), (1, 16, 32), tuple(range(1, MAX_NDIM + 1))])
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
    with pytest.raises(ValueError, match=rf"must be \[{HEADER_LEN}\] int64"):
        decode_meta(torch.zeros(HEADER_LEN, dtype=torch.int32))


def test_gradient_flag_defaults_to_the_dtype_rule_and_round_trips() -> None:
    assert TensorMeta((2,), torch.float32).requires_grad is True
    assert TensorMeta((2,), torch.int64).requires_grad is False
    assert TensorMeta((2,), torch.float32) == TensorMeta((2,), torch.float32, True)
    aux = TensorMeta((2, 3), torch.float32, requires_grad=False)
    assert str(aux) == "[2, 3] float32 (no grad)" and decode_meta(encode_meta(aux)) == aux
    assert aux.matches(torch.zeros(2, 3)) and not aux.matches(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"requires_grad=True\): only floating point"):
        TensorMeta((2,), torch.int64, requires_grad=True)
    bad = encode_meta(aux)
    bad[MAX_NDIM + 2] = 7
    with pytest.raises(ValueError, match="requires_grad 7, not 0 or 1"):
        decode_meta(bad)


def test_tuple_boundary_headers_round_trip_and_a_bare_tensor_stays_one_header() -> None:
    h = torch.zeros(2, 4, requires_grad=True) * 2
    value = as_boundary_value((h, torch.ones(2, 4), torch.arange(2)), "stage 0")
    meta = boundary_meta_of(value)
    assert meta == (TensorMeta((2, 4), torch.float32), TensorMeta((2, 4), torch.float32, False),
                    TensorMeta((2,), torch.int64))
    assert describe_boundary(meta) == "([2, 4] float32, [2, 4] float32 (no grad), [2] int64)"
    headers = encode_boundary(meta)
    assert headers.shape == (3, HEADER_LEN) and boundary_length(headers[0]) == 3
    assert decode_boundary(headers) == meta
    one = (TensorMeta((5,), torch.float32),)  # a 1-tuple is not a bare tensor
    assert decode_boundary(encode_boundary(one)) == one and boundary_length(encode_boundary(one)[0]) == 1
    bare = TensorMeta((5,), torch.bfloat16)
    assert encode_boundary(bare).shape == (1, HEADER_LEN) and decode_boundary(encode_boundary(bare)) == bare
    with pytest.raises(ValueError, match=r"tuple lengths \[3, 3\] for 2 headers"):
        decode_boundary(headers[:2])


def test_non_tensor_outputs_are_named_errors() -> None:
    with pytest.raises(TypeError, match=r"stage 1 microbatch 0: output 1 is int, not a tensor"):
        as_boundary_value((torch.zeros(1), 3), "stage 1 microbatch 0")
    with pytest.raises(TypeError, match=r"stage 1: the module returned dict"):
        as_boundary_value({"h": torch.zeros(1)}, "stage 1")
    with pytest.raises(ValueError, match="empty tuple"):
        as_boundary_value((), "stage 1")
