"""State-summary kernels for context parallelism, with the eager functions' signatures.

Same algebra as ``overlap_runtime.ops.gdn.summary`` (``H_out = M H_in + S``,
``compose((M1, S1), (M0, S0)) = (M1 M0, M1 S0 + S1)``, ``dH_in = M^T dH_out + dH_in_local``),
computed by the kernels of the Triton backend, fp32 throughout for M, S and the state
gradients:

* :func:`state_summary` - the segment is split into ``NS`` sub-segments whose summaries are built
  in parallel (``fwd_scan_kernel`` in summary mode, grid ``((K + V) / BV, NS, B * HV)``), then
  composed in order by ``chain_kernel`` (``NS`` steps of one ``K x K x (K + V)`` product).
* :func:`output_state_grad` - ``dH_in_local`` from the segment's output gradient alone: the
  reverse scan from zero per sub-segment in parallel, combined with the sub-segments' ``M^T``.
* :func:`apply_summary`, :func:`apply_summary_backward`, :func:`compose` - one ``chain_kernel``
  launch each (grid ``(N / BN, B * HV)``).

These are forward-only helpers (no autograd graph): in a context-parallel chain the input
gradients come from the local ``chunk_gated_delta_rule(..., backend="triton")`` backward given
``dH_out``; the summaries only let a rank send ``H_out`` / ``dH_in`` early.
"""

from __future__ import annotations

import torch
import triton

from .common import CHUNK
from .launch import (chain, dv_local, prepare, segment_layout, segment_summaries,
                     state_grad_scan, value_block)


def _check_chunk(chunk_size: int) -> None:
    if chunk_size != CHUNK:
        raise NotImplementedError(
            f"chunk_size={chunk_size} is not supported by the Triton summaries (chunk size 64)")


def _fp32(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (summaries are kept in fp32), got {x.dtype}")
    return x.contiguous()


def _segments(k: torch.Tensor, v: torch.Tensor, num_segments: int | None, columns: int
              ) -> tuple[int, int]:
    batch, seq_len, _, key_dim = k.shape
    bh = batch * v.shape[2]
    programs = bh * (columns // value_block(key_dim, v.shape[3]))
    return segment_layout(triton.cdiv(seq_len, CHUNK), programs, k.device, num_segments)


@torch.no_grad()
def state_summary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, use_qk_l2norm: bool = True, chunk_size: int = 64,
                  num_segments: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary of a segment: running it from ``H_in`` ends in ``M H_in + S``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]`` (bf16/fp16/fp32);
            g: ``[B, T, HV]`` fp32. q only fixes the layout.
        num_segments: parallel sub-segments (None: chosen from the machine).

    Returns:
        ``(M [B, HV, K, K], S [B, HV, K, V])`` fp32.
    """
    _check_chunk(chunk_size)
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    batch, _, _, key_dim = k.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    bh = batch * num_value_heads
    prep = prepare(k, k, v, g, beta, use_qk_l2norm)  # q is not needed: k stands in for it
    ns, per_segment = _segments(k, v, num_segments, key_dim + value_dim)
    m_seg, s_seg = segment_summaries(prep["kn"], prep["w"], prep["u"], prep["gamma"], ns,
                                     per_segment)
    if ns == 1:
        m, s = m_seg[:, 0], s_seg[:, 0]
    else:
        eye = torch.eye(key_dim, device=k.device, dtype=torch.float32).expand(bh, key_dim,
                                                                               key_dim)
        m, _ = chain(m_seg, None, eye.contiguous())
        s, _ = chain(m_seg, s_seg, None)
    return (m.reshape(batch, num_value_heads, key_dim, key_dim),
            s.reshape(batch, num_value_heads, key_dim, value_dim))


@torch.no_grad()
def output_state_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, do: torch.Tensor, scale: float | None = None,
                      use_qk_l2norm: bool = True, chunk_size: int = 64,
                      num_segments: int | None = None) -> torch.Tensor:
    """``dH_in_local``: the gradient reaching a segment's entering state from its own outputs.

    The eager :func:`~overlap_runtime.ops.gdn.summary.output_state_grad` takes prepared chunks;
    this one takes the raw inputs (the kernels prepare them). ``dH_in = M^T dH_out +
    dH_in_local`` then follows with :func:`apply_summary_backward`.

    Args:
        q, k, v, g, beta: as :func:`state_summary`; do: ``[B, T, HV, V]`` output gradient.
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``[B, HV, K, V]`` fp32.
    """
    _check_chunk(chunk_size)
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    batch, _, _, key_dim = k.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    if scale is None:
        scale = key_dim ** -0.5
    prep = prepare(q, k, v, g, beta, use_qk_l2norm)
    ns, per_segment = _segments(k, v, num_segments, value_dim)
    dvl = dv_local(prep["qn"], prep["kn"], prep["gamma"], do, float(scale))
    _, _, local = state_grad_scan(prep["qn"], prep["kn"], prep["w"], prep["gamma"], do, dvl,
                                  None, float(scale), ns, per_segment, store=False)
    if ns == 1:
        dh = local[:, 0]
    else:
        m_seg, _ = segment_summaries(prep["kn"], prep["w"], prep["u"], prep["gamma"], ns,
                                     per_segment)
        dh, _ = chain(m_seg, local, None, reverse=True)
    return dh.reshape(batch, num_value_heads, key_dim, value_dim)


def _flat(x: torch.Tensor, name: str) -> torch.Tensor:
    x = _fp32(name, x)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _check_pair(m: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if m.dim() < 2 or m.shape[-1] != m.shape[-2]:
        raise ValueError(f"M must be [..., K, K], got {list(m.shape)}")
    if x.shape[:-1] != m.shape[:-1]:
        raise ValueError(f"{name} must be [..., K, N] matching M {list(m.shape)}, "
                         f"got {list(x.shape)}")


@torch.no_grad()
def apply_summary(m: torch.Tensor, s: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
    """``H_out = M @ H_in + S`` in fp32: M ``[B, HV, K, K]``, S and H_in ``[B, HV, K, V]``."""
    _check_pair(m, s, "S")
    _check_pair(m, h_in, "H_in")
    mf = _flat(m, "M")
    out, _ = chain(mf[:, None], _flat(s, "S")[:, None], _flat(h_in.to(torch.float32), "H_in"))
    return out.reshape(s.shape)


@torch.no_grad()
def apply_summary_backward(m: torch.Tensor, dh_out: torch.Tensor,
                           dh_in_local: torch.Tensor | None = None) -> torch.Tensor:
    """``dH_in = M^T dH_out + dH_in_local`` in fp32 (shapes as :func:`apply_summary`)."""
    _check_pair(m, dh_out, "dH_out")
    local = None
    if dh_in_local is not None:
        _check_pair(m, dh_in_local, "dH_in_local")
        local = _flat(dh_in_local.to(torch.float32), "dH_in_local")[:, None]
    out, _ = chain(_flat(m, "M")[:, None], local, _flat(dh_out.to(torch.float32), "dH_out"),
                   reverse=True)
    return out.reshape(dh_out.shape)


@torch.no_grad()
def compose(later: tuple[torch.Tensor, torch.Tensor], earlier: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of running ``earlier`` then ``later``: ``(M1 M0, M1 S0 + S1)``, fp32."""
    m1, s1 = later
    m0, s0 = earlier
    _check_pair(m1, m0, "M0")
    _check_pair(m1, s1, "S1")
    _check_pair(m1, s0, "S0")
    m1f = _flat(m1, "M1")[:, None]
    m, _ = chain(m1f, None, _flat(m0, "M0"))
    s, _ = chain(m1f, _flat(s1, "S1")[:, None], _flat(s0, "S0"))
    return m.reshape(m0.shape), s.reshape(s0.shape)
