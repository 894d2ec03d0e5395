"""Backend contract and dispatch for ``chunk_gated_delta_rule``.

A backend is an object with a ``name``, a ``check(...)`` that raises when it cannot run the given
inputs, and a ``forward(...)`` that returns ``(o, final_state)``. Dispatch is explicit: the
caller names the backend; there is no ``auto`` and never a silent fallback to another backend.

Order of checks in :func:`chunk_gated_delta_rule`:

1. the backend name (``ValueError`` naming it and the supported set);
2. :func:`validate_inputs`, the layout rules every backend shares (``ValueError`` /
   ``TypeError`` naming the value and the rule);
3. ``options`` (:class:`~overlap_runtime.ops.gdn.options.GDNKernelOptions`): every option set
   applies to the chosen backend (``ValueError`` naming it), then ``backend.with_options``;
4. ``backend.check(...)``, the backend's own capabilities (device, dtypes, head dims, chunk
   size); ``NotImplementedError`` for what the backend does not do.

Packed variable-length sequences: ``cu_seqlens`` (``[N + 1]`` int32/int64 offsets from 0 to T,
non-decreasing, B == 1) splits the one batch row into N sequences; the state restarts at each
boundary, ``initial_state`` and the final state are ``[N, HV, K, V]``. Empty sequences are
allowed (their final state is their initial state).

:class:`TritonBackend` runs the kernels of ``overlap_runtime.ops.gdn.triton``: ``check`` for
device (cuda, npu, or cpu under ``TRITON_INTERPRET=1``), dtypes, head dims and chunk size;
``forward`` imports the kernels lazily. Nothing here imports triton.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Mapping

import torch

from .function import DEFAULT_BLOCK_CHUNKS, chunk_gated_delta_rule_eager
from .options import GDNKernelOptions

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)
_OFFSET_DTYPES = (torch.int32, torch.int64)


class GDNBackend(ABC):
    """One implementation of the chunked gated delta rule."""

    name: str

    @abstractmethod
    def check(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        initial_state: torch.Tensor | None,
        chunk_size: int,
        cu_seqlens: torch.Tensor | None = None,
    ) -> None:
        """Raise (NotImplementedError / ValueError) if this backend cannot run these inputs.

        Called after :func:`validate_inputs`, so shapes are already consistent.
        """

    @abstractmethod
    def with_options(self, options: GDNKernelOptions) -> "GDNBackend":
        """This backend configured by ``options`` (already checked to apply to it)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float,
        initial_state: torch.Tensor | None,
        use_qk_l2norm: bool,
        chunk_size: int,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(o [B, T, HV, V], final_state [B, HV, K, V] fp32)``, differentiable.

        With ``cu_seqlens`` (B == 1, N packed sequences) ``initial_state`` and the final state
        are ``[N, HV, K, V]`` and the state restarts at each sequence start.
        """


class EagerBackend(GDNBackend):
    """PyTorch ops only: any device and float dtype, any chunk size.

    Computes in fp32 (float64 for float64 inputs); the backward recomputes ``block_chunks``
    chunks at a time (see function.py).
    """

    name = "eager"

    def __init__(self, block_chunks: int = DEFAULT_BLOCK_CHUNKS) -> None:
        if block_chunks < 1:
            raise ValueError(f"block_chunks={block_chunks} must be >= 1")
        self.block_chunks = block_chunks

    def check(self, q, k, v, g, beta, *, initial_state, chunk_size,  # noqa: D102
              cu_seqlens=None) -> None:
        return None  # the shared validation covers everything eager needs

    def with_options(self, options: GDNKernelOptions) -> "EagerBackend":  # noqa: D102
        options.check_backend(self.name)
        if options.block_chunks is None:
            return self
        return EagerBackend(options.block_chunks)

    def forward(self, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size,
                cu_seqlens=None):
        return chunk_gated_delta_rule_eager(
            q, k, v, g, beta, scale, initial_state, use_qk_l2norm, chunk_size,
            self.block_chunks, cu_seqlens,
        )


class TritonBackend(GDNBackend):
    """Fused Triton kernels (``overlap_runtime.ops.gdn.triton``), imported on first use.

    ``check`` applies the capability rules of ``triton/capability.py`` (device cuda, npu with
    triton-ascend >= 3.2.1, < 3.3, or cpu under ``TRITON_INTERPRET=1``; bf16/fp16/fp32
    q/k/v/beta, fp32 g and state; K, V in {64, 128}; chunk 64) and raises
    ``NotImplementedError`` naming the rule; ``forward`` runs the kernels' autograd Function.
    ``num_segments`` fixes how many segments the state scan splits each sequence into
    (None: chosen from the machine); ``recompute_w`` leaves the WY factor w out of the saved
    tensors and forms it again in the backward (less memory, one more launch);
    ``fused_forward`` runs the fused walk (triton/fused_fwd.py) after its own two prep kernels.
    """

    name = "triton"

    def __init__(self, num_segments: int | None = None, recompute_w: bool = False,
                 fused_forward: bool = False) -> None:
        if num_segments is not None and num_segments < 1:
            raise ValueError(f"num_segments={num_segments} must be >= 1 or None")
        if not isinstance(recompute_w, bool):
            raise TypeError(f"recompute_w={recompute_w!r} must be a bool")
        if not isinstance(fused_forward, bool):
            raise TypeError(f"fused_forward={fused_forward!r} must be a bool")
        self.num_segments = num_segments
        self.recompute_w = recompute_w
        self.fused_forward = fused_forward

    def check(self, q, k, v, g, beta, *, initial_state, chunk_size,  # noqa: D102
              cu_seqlens=None) -> None:
        from .triton.capability import check_triton_inputs

        check_triton_inputs(q, k, v, g, beta, initial_state, chunk_size)

    def with_options(self, options: GDNKernelOptions) -> "TritonBackend":  # noqa: D102
        options.check_backend(self.name)
        if (options.num_segments is None and options.recompute_w is None
                and options.fused_forward is None):
            return self
        return TritonBackend(
            self.num_segments if options.num_segments is None else options.num_segments,
            self.recompute_w if options.recompute_w is None else options.recompute_w,
            self.fused_forward if options.fused_forward is None else options.fused_forward)

    def forward(self, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size,
                cu_seqlens=None):
        self.check(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size,
                   cu_seqlens=cu_seqlens)
        from .triton.function import chunk_gated_delta_rule_triton

        # cu_seqlens and recompute_w are the kernels' keywords (ops/gdn/triton);
        # passed only when set, so a kernel version without them still runs every plain call
        extra: dict = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if self.recompute_w:
            extra["recompute_w"] = True
        if self.fused_forward:
            extra["fused_forward"] = True
        return chunk_gated_delta_rule_triton(
            q, k, v, g, beta, scale, initial_state, use_qk_l2norm, self.num_segments, **extra
        )


_BACKENDS: Mapping[str, GDNBackend] = MappingProxyType(
    {"eager": EagerBackend(), "triton": TritonBackend()}
)
SUPPORTED_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def get_backend(name: str) -> GDNBackend:
    """The registered backend called ``name``; ValueError naming it and the supported set."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(
            f"unknown GDN backend {name!r}; supported backends: {SUPPORTED_BACKENDS} "
            "(there is no 'auto': choose one explicitly)"
        )
    return _BACKENDS[name]


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in x.shape) + "]"


def validate_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """The layout rules shared by every backend; raises naming the value and the rule.

    q, k ``[B, T, H, K]`` (same shape and dtype); v ``[B, T, HV, V]`` (q's dtype) with
    ``HV % H == 0``; g, beta ``[B, T, HV]``, g float32/float64; initial_state ``[B, HV, K, V]``
    float32/float64; T >= 1; chunk_size a positive int; one device for all tensors.
    With ``cu_seqlens``: 1-D int32/int64 ``[N + 1]`` (N >= 1) offsets on the inputs' device,
    starting at 0, ending at T, non-decreasing (empty sequences allowed); B == 1;
    initial_state ``[N, HV, K, V]``. Reading the offsets is one host read (a device sync).
    """
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if initial_state is not None:
        named["initial_state"] = initial_state
    if cu_seqlens is not None:
        _check_offsets_tensor(cu_seqlens)
        named["cu_seqlens"] = cu_seqlens
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in named.items():
        if name != "cu_seqlens" and x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; GDN needs one of {_FLOAT_DTYPES}")
    devices = {name: x.device for name, x in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all GDN inputs must be on one device, got {devices}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {_shape(q)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {_shape(q)} ([B, T, H, K]), got {_shape(k)}")
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, HV, V], got shape {_shape(v)}")
    batch, seq_len, num_heads, key_dim = q.shape
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"v has (B, T) = {tuple(v.shape[:2])} but q has {tuple(q.shape[:2])}: they must match"
        )
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    if num_value_heads % num_heads != 0:
        raise ValueError(
            f"HV % H != 0: v has HV={num_value_heads} heads, q/k have H={num_heads}; each key "
            "head must serve a whole group of value heads"
        )
    if seq_len < 1:
        raise ValueError(f"sequence length T={seq_len} must be >= 1")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
        )
    expected = (batch, seq_len, num_value_heads)
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != expected:
            raise ValueError(
                f"{name} must be [B, T, HV] = {list(expected)}, got {_shape(x)}"
            )
    if g.dtype not in _STATE_DTYPES:
        raise TypeError(
            f"g (log decay) must be float32 or float64, got {g.dtype}: it is summed over each "
            "chunk and half precision loses the decay"
        )
    num_states = batch
    if cu_seqlens is not None:
        num_states = _check_offsets_values(cu_seqlens, batch, seq_len)
    if initial_state is not None:
        expected_state = (num_states, num_value_heads, key_dim, value_dim)
        if tuple(initial_state.shape) != expected_state:
            layout = "[B, HV, K, V]" if cu_seqlens is None else (
                "[N, HV, K, V] (N = len(cu_seqlens) - 1 sequences)")
            raise ValueError(
                f"initial_state must be {layout} = {list(expected_state)}, "
                f"got {_shape(initial_state)}"
            )
        if initial_state.dtype not in _STATE_DTYPES:
            raise TypeError(
                f"initial_state must be float32 or float64 (the state is kept in fp32), "
                f"got {initial_state.dtype}"
            )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    if scale is not None and not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")


def _check_offsets_tensor(cu_seqlens: torch.Tensor) -> None:
    """Type, dtype and rank of ``cu_seqlens`` (no values read)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _OFFSET_DTYPES:
        raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; it must be int32 or int64 "
                        "(token offsets)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1 sequences, got shape "
                         f"{_shape(cu_seqlens)}")


def _check_offsets_values(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> int:
    """B == 1 and the offsets' values; returns N, the number of sequences."""
    if batch != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (the sequences packed along T), got B={batch}; "
                         "flatten the batch into one row first")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={offsets[0]}")
    if offsets[-1] != seq_len:
        raise ValueError(f"cu_seqlens must end at T={seq_len} (the packed length), got "
                         f"cu_seqlens[-1]={offsets[-1]}")
    for i in range(len(offsets) - 1):
        if offsets[i + 1] < offsets[i]:
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]="
                             f"{offsets[i]} > cu_seqlens[{i + 1}]={offsets[i + 1]}")
    return len(offsets) - 1


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    backend: str = "eager",
    cu_seqlens: torch.Tensor | None = None,
    options: GDNKernelOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule (decay first, then the delta update), differentiable.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV % H == 0``, value head j uses key head
            ``j // (HV // H)``); g: ``[B, T, HV]`` log decay, fp32; beta: ``[B, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` fp32, or None for zeros.
        output_final_state: return the final state (else None).
        use_qk_l2norm: l2-normalise q and k over the head dim.
        chunk_size: tokens per chunk (64).
        backend: ``"eager"`` or ``"triton"``; no automatic choice, no fallback.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N sequences packed into the one row
            (B == 1): the state restarts at each, ``initial_state`` and the final state are
            ``[N, HV, K, V]``; empty sequences allowed. None: each batch row is one sequence.
        options: :class:`GDNKernelOptions` tuning knobs of the chosen backend (``block_chunks``
            for eager, ``num_segments`` and ``recompute_w`` for triton); one that does not
            apply raises.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [B or N, HV, K, V] fp32 or None)``; with
        float64 inputs the eager backend computes and returns the state in float64.
    """
    impl = get_backend(backend)
    validate_inputs(q, k, v, g, beta, initial_state, chunk_size, scale, cu_seqlens)
    if options is not None:
        if not isinstance(options, GDNKernelOptions):
            raise TypeError(f"options must be a GDNKernelOptions or None, got "
                            f"{type(options).__name__}")
        impl = impl.with_options(options)
    impl.check(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size,
               cu_seqlens=cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state = impl.forward(
        q, k, v, g, beta, scale=float(scale), initial_state=initial_state,
        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
    )
    return o, (final_state if output_final_state else None)
