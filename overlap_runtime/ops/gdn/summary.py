"""Affine state summaries of a segment: ``H_out = M @ H_in + S``.

Per token the state (``[K, V]``) evolves as ``S_t = A_t S_(t-1) + beta_t k_t v_t^T`` with
``A_t = exp(g_t) (I - beta_t k_t k_t^T)`` (``[K, K]``, it acts on the *key* side, from the left).
A chunk composes to ``M_c = exp(gamma_C) I - Ktail^T W`` and ``S_c = Ktail^T U`` (see chunk.py);
a segment to the ordered product of its chunks::

    compose((M1, S1), (M0, S0)) = (M1 M0, M1 S0 + S1)        # segment 0 runs first

``compose`` is associative but not commutative. :func:`summarize` builds every chunk's pair at
once and composes them in a balanced tree (log2 N levels, each level one batched matmul), never as
a second sequential scan (N dependent steps where the tree has log2 N). Everything here is plain PyTorch and differentiable
through autograd; the summaries are kept in fp32 (float64 for float64 inputs).

Backward mirrors the chain with transposed maps: ``dH_in = M^T dH_out + dH_in_local``, where
``dH_in_local`` (:func:`output_state_grad`) is what the segment's own outputs contribute; it
needs only the local output gradient, so a context-parallel rank can form it before ``dH_out``
arrives.
"""

from __future__ import annotations

import torch

from .chunk import PreparedChunks, prepare_chunks, to_chunks


def compose(
    later: tuple[torch.Tensor, torch.Tensor], earlier: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary of running ``earlier`` then ``later``: ``(M1 M0, M1 S0 + S1)``.

    Args:
        later: ``(M1 [..., K, K], S1 [..., K, V])``, the segment that runs second.
        earlier: ``(M0 [..., K, K], S0 [..., K, V])``, the segment that runs first.
    """
    m1, s1 = later
    m0, s0 = earlier
    return m1 @ m0, m1 @ s0 + s1


def apply_summary(m: torch.Tensor, s: torch.Tensor, h_in: torch.Tensor) -> torch.Tensor:
    """``H_out = M @ H_in + S``: M ``[B, HV, K, K]``, S and H_in ``[B, HV, K, V]``.

    The result has the summary's dtype (fp32 or float64); H_in is cast to it first.
    """
    return m @ h_in.to(m.dtype) + s


def apply_summary_backward(
    m: torch.Tensor, dh_out: torch.Tensor, dh_in_local: torch.Tensor | None = None
) -> torch.Tensor:
    """State gradient through a segment: ``dH_in = M^T dH_out + dH_in_local``.

    Args:
        m: ``[B, HV, K, K]`` the segment's transition.
        dh_out: ``[B, HV, K, V]`` gradient of the loss with respect to the segment's final state.
        dh_in_local: ``[B, HV, K, V]`` gradient reaching H_in from the segment's own outputs
            (:func:`output_state_grad`), or None for zero.
    """
    dh_in = m.transpose(-1, -2) @ dh_out.to(m.dtype)
    return dh_in if dh_in_local is None else dh_in + dh_in_local.to(m.dtype)


def chunk_transitions(prep: PreparedChunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine map of every chunk, all at once: ``h_(n+1) = M_n h_n + S_n``.

    Returns:
        ``(M [B, HV, N, K, K], S [B, HV, N, K, V])`` in the compute dtype, where
        ``M_n = exp(gamma_C) I - Ktail_n^T W_n`` and ``S_n = Ktail_n^T U_n``.
    """
    k_tail_t = prep.k_tail.transpose(-1, -2)  # [B, HV, N, K, C]
    eye = torch.eye(prep.k.shape[-1], dtype=prep.k.dtype, device=prep.k.device)
    m = prep.chunk_decay[..., None, None] * eye - k_tail_t @ prep.w
    return m, k_tail_t @ prep.u


def tree_compose(m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compose ``N`` summaries in time order along dim -3 with a balanced tree.

    Args:
        m: ``[..., N, K, K]``; s: ``[..., N, K, V]``; entry 0 runs first.

    Returns:
        ``(M [..., K, K], S [..., K, V])`` equal to ``c_(N-1) o ... o c_1 o c_0``. Each level
        composes neighbouring pairs in one batched matmul; an odd last entry waits for the next
        level, so the order (and hence the result) is exactly the sequential one.
    """
    while m.shape[-3] > 1:
        pairs = m.shape[-3] // 2
        m_early, m_late = m[..., 0 : 2 * pairs : 2, :, :], m[..., 1 : 2 * pairs : 2, :, :]
        s_early, s_late = s[..., 0 : 2 * pairs : 2, :, :], s[..., 1 : 2 * pairs : 2, :, :]
        m_next, s_next = compose((m_late, s_late), (m_early, s_early))
        if m.shape[-3] % 2:
            m_next = torch.cat([m_next, m[..., -1:, :, :]], dim=-3)
            s_next = torch.cat([s_next, s[..., -1:, :, :]], dim=-3)
        m, s = m_next, s_next
    return m[..., 0, :, :], s[..., 0, :, :]


def summarize(prep: PreparedChunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Summary ``(M [B, HV, K, K], S [B, HV, K, V])`` of a prepared segment (parallel tree)."""
    return tree_compose(*chunk_transitions(prep))


def state_summary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary of a segment from raw inputs: running it from ``H_in`` ends in ``M H_in + S``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]``. q only fixes the
            layout (the summary does not depend on queries or the scale).
        use_qk_l2norm: l2-normalise k first (as the forward does).
        chunk_size: C.

    Returns:
        ``(M [B, HV, K, K], S [B, HV, K, V])`` in fp32 (float64 for float64 inputs);
        differentiable through autograd.
    """
    return summarize(prepare_chunks(q, k, v, g, beta, None, use_qk_l2norm, chunk_size))


def output_state_grad(
    prep: PreparedChunks,
    do: torch.Tensor,
    transitions: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``dH_in_local``: gradient reaching a segment's entering state from its own outputs only.

    Per chunk, ``c_n = (diag(exp(gamma)) Q_n)^T dO_n - W_n^T attn_n^T dO_n`` is the gradient of
    chunk n's outputs with respect to the state entering it; the state gradients then follow
    ``dh_n = M_n^T dh_(n+1) + c_n`` backwards, an affine map again, reduced with the same tree as
    :func:`summarize` (over the reversed chunks with transposed M). Needs no ``dH_out``.

    Args:
        prep: the prepared segment.
        do: ``[B, T, HV, V]`` gradient of the loss with respect to the segment's outputs.
        transitions: per-chunk ``(M, S)`` from :func:`chunk_transitions`, if already computed.

    Returns:
        ``[B, HV, K, V]`` in the compute dtype.
    """
    do_c = to_chunks(do.to(prep.q.dtype), prep.chunk_size)  # [B, HV, N, C, V]
    q_decayed = prep.q * prep.gamma.exp()[..., None]
    c = q_decayed.transpose(-1, -2) @ do_c - prep.w.transpose(-1, -2) @ (
        prep.attn.transpose(-1, -2) @ do_c
    )
    m = (transitions or chunk_transitions(prep))[0]
    _, dh_in_local = tree_compose(m.transpose(-1, -2).flip(-3), c.flip(-3))
    return dh_in_local
