"""A drop-in for flash-linear-attention 0.6.0's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

Swapping ``from fla.ops.gated_delta_rule import chunk_gated_delta_rule`` for
``from overlap_runtime.ops.gdn.fla_compat import chunk_gated_delta_rule`` keeps every call's
meaning: the same parameters in the same order with the same defaults (fla-core 0.6.0,
``fla/ops/gated_delta_rule/chunk.py``; ``tests/ops/test_gdn_fla_compat.py`` compares the
signatures through ``ast`` on the wheel), the same return convention ``(o, final_state or None)``
with o in q's dtype and the final state float32 (float64 when the state was computed in
float64: float64 inputs stay float64 end to end, forward and backward), and the same semantics:

* ``use_qk_l2norm_in_kernel=False`` by default: q and k are used as given (the project's own
  ``ops.gdn.chunk_gated_delta_rule`` defaults to ``use_qk_l2norm=True``);
* g is log-space decay (any float dtype, used in fp32); with ``use_gate_in_kernel=True``
  (a keyword of ``**kwargs``, as in fla) g is raw and the decay is
  ``-exp(A_log) * softplus(g + dt_bias)`` (``A_log``, ``dt_bias`` ``[HV]``);
* ``use_beta_sigmoid_in_kernel``: beta is logits, ``sigmoid(beta)`` (``2 sigmoid(beta)`` with
  ``allow_neg_eigval``, which requires it);
* ``state_v_first``: initial and final state ``[N, HV, V, K]`` instead of ``[N, HV, K, V]``
  (the deprecated ``transpose_state_layout`` keyword is accepted with a DeprecationWarning);
* ``cu_seqlens``: packed sequences (B == 1), ``initial_state`` / final state per sequence;
  ``cu_seqlens_cpu`` and ``chunk_indices`` are fla's precomputed host copies, checked against
  ``cu_seqlens`` here (a mismatch raises: fla would compute garbage);
* ``head_first`` in the keywords raises ``DeprecationWarning`` (as an exception, whatever its
  value), as 0.6.0 does; ``chunk_size`` (a keyword, default 64) must be 16, 32 or 64.

Where this function is stricter than fla (it raises where fla ignores or asserts): an unknown
keyword raises ``TypeError`` (fla drops it silently, so a misspelt option changed nothing);
``A_log`` / ``dt_bias`` without ``use_gate_in_kernel``, ``cu_seqlens_cpu`` / ``chunk_indices``
without ``cu_seqlens``, and a missing ``A_log`` raise ``ValueError``; ``cp_context`` (fla's own
context parallelism) raises ``NotImplementedError`` naming ``overlap_runtime.context_parallel``.

Ours, keyword-only: ``backend`` (default ``"triton"``) and ``options``
(:class:`~overlap_runtime.ops.gdn.options.GDNKernelOptions`). The default is a fixed choice,
not an automatic one: fla's function is a Triton kernel, so a caller swapping the import gets
the same class of kernel, and on a machine where Triton cannot run the call raises
``NotImplementedError`` naming the rule (pass ``backend="eager"`` there) instead of quietly
running something else.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from .backend import chunk_gated_delta_rule as _chunk_gated_delta_rule
from .options import GDNKernelOptions

FLA_VERSION = "0.6.0"
DEFAULT_BACKEND = "triton"
_CHUNK_SIZES = (16, 32, 64)
_KNOWN_KWARGS = ("transpose_state_layout", "head_first", "chunk_size", "use_gate_in_kernel",
                 "A_log", "dt_bias")


def _expected_chunk_indices(offsets: list[int], chunk_size: int) -> list[list[int]]:
    """fla's ``chunk_indices`` for these offsets: ``[sequence, chunk within it]`` per chunk."""
    rows = []
    for n in range(len(offsets) - 1):
        chunks = -(-(offsets[n + 1] - offsets[n]) // chunk_size)
        rows.extend([n, c] for c in range(chunks))
    return rows


def _check_host_copies(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                       chunk_indices: torch.Tensor | None, chunk_size: int) -> None:
    """``cu_seqlens_cpu`` and ``chunk_indices`` agree with ``cu_seqlens`` (fla trusts them)."""
    if cu_seqlens is None:
        for name, x in (("cu_seqlens_cpu", cu_seqlens_cpu), ("chunk_indices", chunk_indices)):
            if x is not None:
                raise ValueError(f"{name} was given without cu_seqlens: it describes packed "
                                 "sequences, pass cu_seqlens too (or drop it)")
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    offsets = cu_seqlens.tolist()
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.tolist() != offsets:
        raise ValueError(f"cu_seqlens_cpu={cu_seqlens_cpu.tolist()} differs from "
                         f"cu_seqlens={offsets}: it must be the host copy of cu_seqlens")
    if chunk_indices is not None:
        expected = _expected_chunk_indices(offsets, chunk_size)
        if chunk_indices.tolist() != expected:
            raise ValueError(f"chunk_indices differs from the [sequence, chunk] pairs of "
                             f"cu_seqlens at chunk_size={chunk_size} ({len(expected)} chunks): "
                             "pass fla's prepare_chunk_indices(cu_seqlens, chunk_size) or None")


def _gate(g: torch.Tensor, use_gate_in_kernel: bool, A_log: torch.Tensor | None,
          dt_bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 (or float64) log decay ``[B, T, HV]``: g itself, or fla's in-kernel gate."""
    dtype = torch.promote_types(g.dtype, torch.float32)
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{name} is used only with use_gate_in_kernel=True (g is "
                                 "already the log decay otherwise)")
        return g.to(dtype)
    if A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log ([HV]): the decay is "
                         "-exp(A_log) * softplus(g + dt_bias)")
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype)
    return -A_log.to(dtype).exp() * F.softplus(x)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: Any | None = None,
    *,
    backend: str = DEFAULT_BACKEND,
    options: GDNKernelOptions | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla 0.6.0's ``chunk_gated_delta_rule`` on this project's backends (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (``HV % H == 0``); g: ``[B, T, HV]`` log
            decay (raw with ``use_gate_in_kernel``); beta: ``[B, T, HV]`` (logits with
            ``use_beta_sigmoid_in_kernel``).
        scale: default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any float
            dtype (used in fp32); N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: return the final state (else None).
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B == 1).
        backend: ours, ``"triton"`` (default) or ``"eager"``; no automatic choice.
        options: ours, tuning knobs of that backend.
        **kwargs: fla's ``chunk_size``, ``use_gate_in_kernel``, ``A_log``, ``dt_bias``,
            ``transpose_state_layout`` (deprecated), ``head_first`` (refused).

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] float32 (float64 for a
        float64 state) or None)``.
    """
    unknown = sorted(set(kwargs) - set(_KNOWN_KWARGS))
    if unknown:
        raise TypeError(f"chunk_gated_delta_rule got unexpected keyword(s) {unknown}; fla "
                        f"{FLA_VERSION} would ignore them silently, this drop-in refuses them "
                        f"(known: {list(_KNOWN_KWARGS)})")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated "
                             "`transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=2)
        state_v_first = kwargs.pop("transpose_state_layout")
    if "head_first" in kwargs:
        # fla 0.6.0 raises (not warns) this, whatever the value
        raise DeprecationWarning(
            "head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in _CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got "
                         f"{chunk_size}.")
    if cp_context is not None:
        raise NotImplementedError(
            "cp_context (fla's context parallelism) is not supported by this drop-in: use "
            "overlap_runtime.context_parallel (docs/gdn_context_parallel.md)")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    _check_host_copies(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size)

    g = _gate(g, bool(kwargs.get("use_gate_in_kernel", False)), kwargs.get("A_log"),
              kwargs.get("dt_bias"))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
        if allow_neg_eigval:
            beta = 2.0 * beta
    if initial_state is not None:
        if state_v_first:
            initial_state = initial_state.transpose(-1, -2)
        initial_state = initial_state.to(torch.promote_types(initial_state.dtype, torch.float32))
    o, final_state = _chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
        chunk_size=chunk_size, backend=backend, cu_seqlens=cu_seqlens, options=options,
    )
    if final_state is not None:
        # fla's state is float32; a float64 state stays float64 (never rounded, forward or
        # backward: its gradient would reach k, v, g and beta rounded to float32 too)
        final_state = final_state.to(torch.promote_types(final_state.dtype, torch.float32))
        if state_v_first:
            final_state = final_state.transpose(-1, -2).contiguous()
    return o.to(q.dtype), final_state
