"""``TensorMeta`` (shape and dtype of an activation crossing a stage boundary) and the fixed
integer header that carries it in the one-time metadata exchange.

Header: ``HEADER_LEN`` int64 values ``[dtype code, ndim, dim 0, ..., dim ndim-1, 0...]``. The
dtype code comes from :data:`DTYPE_CODES`, a fixed table: codes are part of the wire format
between ranks, so they never depend on the order of a list or on the torch version, and code 0
is never a dtype (an all-zero header, a receive that read nothing, is an error, not float32).
A new dtype gets a new code at the end; an existing code never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["TensorMeta", "DTYPE_CODES", "HEADER_LEN", "encode_meta", "decode_meta"]

HEADER_LEN = 10
"""Header length in int64 values: dtype code, ndim, up to 8 dims."""

MAX_NDIM = HEADER_LEN - 2

DTYPE_CODES: Mapping[torch.dtype, int] = MappingProxyType({
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.bool: 7,
    torch.uint8: 8,
    torch.int8: 9,
    torch.int16: 10,
    torch.complex64: 11,
    torch.complex128: 12,
    torch.float8_e4m3fn: 13,
    torch.float8_e5m2: 14,
})
"""dtype -> wire code (fixed; see the module doc)."""

_DTYPE_OF_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of an activation crossing a stage boundary (``shape`` without padding;
    ``dtype`` one of :data:`DTYPE_CODES` to travel in a header)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(t.shape), t.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')}"


def encode_meta(meta: TensorMeta) -> torch.Tensor:
    """``[HEADER_LEN]`` int64 CPU header of ``meta``.

    Raises ``ValueError`` for more than ``MAX_NDIM`` dims, a negative dim, or a dtype without a
    code in :data:`DTYPE_CODES`.
    """
    ndim = len(meta.shape)
    if ndim > MAX_NDIM:
        raise ValueError(f"activation {meta} has {ndim} dims; a stage boundary carries at most "
                         f"{MAX_NDIM} (HEADER_LEN={HEADER_LEN})")
    if any(d < 0 for d in meta.shape):
        raise ValueError(f"activation shape {list(meta.shape)} has a negative dim")
    code = DTYPE_CODES.get(meta.dtype)
    if code is None:
        raise ValueError(f"activation dtype {meta.dtype} has no code in DTYPE_CODES, so it "
                         f"cannot cross a stage boundary; supported: "
                         f"{[str(d).replace('torch.', '') for d in DTYPE_CODES]}")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = code
    h[1] = ndim
    if ndim:
        h[2:2 + ndim] = torch.tensor(meta.shape, dtype=torch.int64)
    return h


def decode_meta(header: torch.Tensor) -> TensorMeta:
    """Inverse of :func:`encode_meta` (``header``: ``[HEADER_LEN]`` int64, on the CPU).

    Raises ``ValueError`` naming the value for an unknown dtype code (0 included: an empty
    header) or an ndim outside ``0..MAX_NDIM``.
    """
    if header.shape != (HEADER_LEN,) or header.dtype != torch.int64:
        raise ValueError(f"metadata header must be [{HEADER_LEN}] int64, got "
                         f"{list(header.shape)} {header.dtype}")
    values = [int(v) for v in header.tolist()]
    dtype = _DTYPE_OF_CODE.get(values[0])
    if dtype is None:
        raise ValueError(f"metadata header {values} has dtype code {values[0]}, which is not in "
                         f"DTYPE_CODES (known codes 1..{max(_DTYPE_OF_CODE)}; 0 means the header "
                         f"was never filled)")
    ndim = values[1]
    if not 0 <= ndim <= MAX_NDIM:
        raise ValueError(f"metadata header {values} has ndim {ndim}, outside 0..{MAX_NDIM}")
    return TensorMeta(tuple(values[2:2 + ndim]), dtype)
