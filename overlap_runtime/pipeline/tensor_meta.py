"""``TensorMeta`` (shape, dtype and gradient flag of one tensor crossing a stage boundary),
``BoundaryMeta`` (what one boundary carries per microbatch: one tensor, or a tuple of them) and
the fixed integer header that carries them in the one-time metadata exchange.

Header: ``HEADER_LEN`` int64 values ``[dtype code, ndim, dim 0, ..., dim MAX_NDIM-1,
requires_grad, tuple length]`` (unused dims 0). The dtype code comes from :data:`DTYPE_CODES`, a
fixed table: codes are part of the wire format between ranks, so they never depend on the order
of a list or on the torch version, and code 0 is never a dtype (an all-zero header, a receive
that read nothing, is an error, not float32). A new dtype gets a new code at the end; an existing
code never changes. ``tuple length`` is 0 for a bare tensor and ``n >= 1`` for each element of
an ``n``-tuple, so the receiver learns from the first header how many follow (see
:func:`encode_boundary`).

Gradient rule (torch.distributed.pipelining 2.13's, whose metadata inference runs the stage
forward with grad enabled and keeps each output's ``requires_grad``): a boundary tensor carries
a gradient back iff ``requires_grad`` is set in its meta; the receiving stage makes it a leaf
requiring grad, the backward returns its gradient (zeros where autograd gives none) and sends
it. A tensor without the flag (an integer tensor, a float the sender detached) crosses forward
only: no gradient message, ``None`` in the stage's input-gradient tuple. ``requires_grad`` left
out (None) means "floating point or complex", so ``TensorMeta(shape, torch.float32)`` is the
one-activation boundary the runtime always had.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Union

import torch

MAX_NDIM = 8
"""Most dims a boundary tensor may have."""

HEADER_LEN = MAX_NDIM + 4
"""Header length in int64 values: dtype code, ndim, ``MAX_NDIM`` dims, requires_grad, tuple
length."""

_RG, _TL = MAX_NDIM + 2, MAX_NDIM + 3  # header positions of requires_grad and tuple length

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


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and gradient flag of one tensor crossing a stage boundary.

    ``shape``: without padding; ``dtype``: one of :data:`DTYPE_CODES` to travel in a header;
    ``requires_grad``: the tensor carries a gradient back (module doc); None (the default)
    becomes ``dtype.is_floating_point or dtype.is_complex``. True on an integer dtype raises.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool | None = None

    def __post_init__(self) -> None:
        if self.requires_grad is None:
            object.__setattr__(self, "requires_grad", _differentiable(self.dtype))
        elif self.requires_grad and not _differentiable(self.dtype):
            raise ValueError(f"TensorMeta({list(self.shape)}, {self.dtype}, requires_grad=True): "
                             "only floating point and complex tensors can carry a gradient")

    @staticmethod
    def of(t: torch.Tensor, requires_grad: bool | None = None) -> "TensorMeta":
        """The meta of ``t`` (``requires_grad`` None: the dtype rule, not ``t``'s flag)."""
        return TensorMeta(tuple(t.shape), t.dtype, requires_grad)

    def matches(self, t: torch.Tensor) -> bool:
        """``t`` has this shape and dtype (the gradient flag is not compared)."""
        return t.dtype == self.dtype and tuple(t.shape) == self.shape

    def __str__(self) -> str:
        s = f"{list(self.shape)} {str(self.dtype).replace('torch.', '')}"
        return s + " (no grad)" if not self.requires_grad and _differentiable(self.dtype) else s


BoundaryMeta = Union[TensorMeta, tuple[TensorMeta, ...]]
"""What one stage boundary carries per microbatch: a bare tensor (``TensorMeta``), or a tuple
(``tuple[TensorMeta, ...]``, one or more) that the next stage receives as positional inputs."""


def boundary_metas(meta: BoundaryMeta) -> tuple[TensorMeta, ...]:
    """The tensors of a boundary, in order (one for a bare tensor)."""
    return meta if isinstance(meta, tuple) else (meta,)


def describe_boundary(meta: BoundaryMeta) -> str:
    """``[4, 8] float32`` for a bare tensor; ``([4, 8] float32, [4] int64)`` for a tuple."""
    if isinstance(meta, tuple):
        return "(" + ", ".join(map(str, meta)) + ("," if len(meta) == 1 else "") + ")"
    return str(meta)


def as_boundary_value(value: object, where: str) -> "torch.Tensor | tuple[torch.Tensor, ...]":
    """A stage output as it crosses a boundary: a tensor as is, a tuple or list as a tuple of
    tensors. Raises ``TypeError`` naming ``where`` and the element for anything else (torch's
    rule too: a boundary carries tensors; pass other values as keyword inputs), and
    ``ValueError`` for an empty tuple."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        if not value:
            raise ValueError(f"{where}: the module returned an empty {type(value).__name__}; a "
                             "stage boundary carries at least one tensor")
        for i, v in enumerate(value):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{where}: output {i} is {type(v).__name__}, not a tensor; a stage "
                                "boundary carries a tensor or a tuple of tensors (pass other "
                                "values as keyword inputs of the first stage)")
        return tuple(value)
    raise TypeError(f"{where}: the module returned {type(value).__name__}; a stage returns a "
                    "tensor or a tuple of tensors")


def boundary_meta_of(value: "torch.Tensor | tuple[torch.Tensor, ...]") -> BoundaryMeta:
    """The meta of a stage output (from :func:`as_boundary_value`); each tensor's
    ``requires_grad`` is its own flag (the forward ran with grad enabled)."""
    if isinstance(value, tuple):
        return tuple(TensorMeta.of(t, t.requires_grad) for t in value)
    return TensorMeta.of(value, value.requires_grad)


def encode_meta(meta: TensorMeta, tuple_len: int = 0) -> torch.Tensor:
    """``[HEADER_LEN]`` int64 CPU header of ``meta`` (``tuple_len``: 0 for a bare tensor, else
    the length of the tuple it belongs to).

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
    h[_RG] = int(bool(meta.requires_grad))
    h[_TL] = tuple_len
    return h


def decode_meta(header: torch.Tensor) -> TensorMeta:
    """Inverse of :func:`encode_meta` (``header``: ``[HEADER_LEN]`` int64, on the CPU).

    Raises ``ValueError`` naming the value for an unknown dtype code (0 included: an empty
    header), an ndim outside ``0..MAX_NDIM`` or a requires_grad flag other than 0/1.
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
    if values[_RG] not in (0, 1):
        raise ValueError(f"metadata header {values} has requires_grad {values[_RG]}, not 0 or 1")
    return TensorMeta(tuple(values[2:2 + ndim]), dtype, bool(values[_RG]))


def encode_boundary(meta: BoundaryMeta) -> torch.Tensor:
    """``[n, HEADER_LEN]`` int64 CPU headers of a boundary: one row (tuple length 0) for a bare
    tensor, ``n`` rows (tuple length ``n``) for an ``n``-tuple. The exchange sends row 0 first
    (a fixed size the receiver can post), then the other rows in one message if ``n > 1``."""
    if isinstance(meta, tuple):
        if not meta:
            raise ValueError("a stage boundary carries at least one tensor, got an empty tuple")
        return torch.stack([encode_meta(m, len(meta)) for m in meta])
    return encode_meta(meta).unsqueeze(0)


def boundary_length(first_header: torch.Tensor) -> int:
    """How many headers the boundary whose first header is ``first_header`` has (1 for a bare
    tensor). Raises ``ValueError`` for a negative tuple length."""
    n = int(first_header[_TL])
    if n < 0:
        raise ValueError(f"metadata header {first_header.tolist()} has tuple length {n} < 0")
    return max(n, 1)


def decode_boundary(headers: torch.Tensor) -> BoundaryMeta:
    """Inverse of :func:`encode_boundary` (``headers``: ``[n, HEADER_LEN]`` int64 on the CPU).
    Raises ``ValueError`` when the rows disagree on the tuple length or it differs from ``n``."""
    if headers.dim() != 2 or headers.shape[0] < 1:
        raise ValueError(f"boundary headers must be [n >= 1, {HEADER_LEN}], got "
                         f"{list(headers.shape)}")
    lens = [int(v) for v in headers[:, _TL].tolist()]
    n = headers.shape[0]
    if lens == [0] * n and n == 1:
        return decode_meta(headers[0])
    if any(x != n for x in lens):
        raise ValueError(f"boundary headers give tuple lengths {lens} for {n} headers")
    return tuple(decode_meta(h) for h in headers)
