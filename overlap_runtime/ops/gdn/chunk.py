"""Chunked (WY / UT) form of the gated delta rule, as separate pieces.

Within a chunk of ``C`` tokens with entering state ``h`` (``[K, V]``), ``gamma_i`` the cumulative
sum of ``g`` inside the chunk, and rows of ``Q, K, V`` being tokens (q already l2-normed and
scaled)::

    A      = strict_lower(diag(beta) (K K^T) * exp(gamma_i - gamma_j))      [C, C]
    u      = (I + A)^-1 diag(beta) V                                          [C, V]
    w      = (I + A)^-1 diag(beta exp(gamma)) K                               [C, K]
    v_new  = u - w h              (the delta-rule residuals r_t of the chunk) [C, V]
    o      = diag(exp(gamma)) Q h + (Q K^T * exp(gamma_i - gamma_j), i >= j) v_new
    h'     = exp(gamma_C) h + Ktail^T v_new,  Ktail_j = exp(gamma_C - gamma_j) k_j

Gate sums are never differences: ``gamma_i - gamma_j`` is computed as the direct sum
``sum_{j < t <= i} g_t`` (:func:`gate_sums`) and ``gamma_C - gamma_j`` as ``sum_{t > j} g_t``.
A difference of cumulative sums cancels catastrophically once one gate is large (``g = -1e38``
in float64 or ``-1e4`` in fp32 loses every small gate after it) and is ``-inf - -inf = NaN`` for
``g = -inf`` (a state reset); sums of same-sign terms are exact to a few ulps, so any ``g <= 0``
including ``-inf`` is handled, forward and backward (docs/gdn.md, "Extreme gates").

The pieces, so that a context-parallel layer can split them around the arrival of ``H_in``:

* :func:`prepare_chunks` - everything that does not depend on the state, all chunks at once;
* :func:`scan_states` - the sequential inter-chunk state scan from an entering state;
* :func:`chunk_outputs` - intra-chunk attention + q . state, all chunks at once;
* :func:`chunk_output` - scan + outputs from a prepared segment and its entering state;
* :func:`chunk_forward` - all of the above on raw inputs (plain autograd, chunk-level graph).

All functions are differentiable through autograd. Tensors inside are laid out
``[B, HV, N, C, D]`` (N chunks); the compute dtype is fp32 (float64 for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import compute_dtype, expand_heads, l2norm


@dataclass(frozen=True)
class PreparedChunks:
    """State-independent per-chunk tensors of one segment (output of :func:`prepare_chunks`).

    Shapes use ``N = ceil(T / C)``; a partial last chunk is zero padded (``k = v = q = 0``,
    ``g = beta = 0``: an identity step that leaves the state unchanged). dtype: the compute dtype.

    Attributes:
        q: ``[B, HV, N, C, K]`` queries, l2-normed (if asked), scaled, expanded to HV heads.
        k: ``[B, HV, N, C, K]`` keys, l2-normed (if asked), expanded to HV heads.
        w: ``[B, HV, N, C, K]`` WY factor ``(I + A)^-1 diag(beta exp(gamma)) K``.
        u: ``[B, HV, N, C, V]`` WY factor ``(I + A)^-1 diag(beta) V``.
        gamma: ``[B, HV, N, C]`` within-chunk cumulative sum of g (``sum_{t <= i} g_t``).
        tail: ``[B, HV, N, C]`` the gate from after token j to the chunk end, ``sum_{t > j} g_t``
            (summed directly, never ``gamma_C - gamma_j``).
        attn: ``[B, HV, N, C, C]`` intra-chunk ``(Q K^T) * exp(gamma_i - gamma_j)`` for i >= j.
        seq_len: T, the number of real (unpadded) tokens.
        out_dtype: dtype of the output o (v's dtype).
    """

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    gamma: torch.Tensor
    tail: torch.Tensor
    attn: torch.Tensor
    seq_len: int
    out_dtype: torch.dtype

    @property
    def num_chunks(self) -> int:
        return self.q.shape[2]

    @property
    def chunk_size(self) -> int:
        return self.q.shape[3]

    @property
    def chunk_decay(self) -> torch.Tensor:
        """``[B, HV, N]`` total decay ``exp(gamma_C)`` of each chunk."""
        return self.gamma[..., -1].exp()

    @property
    def k_tail(self) -> torch.Tensor:
        """``[B, HV, N, C, K]`` keys decayed to the chunk end, ``exp(gamma_C - gamma_j) k_j``."""
        return self.k * self.tail.exp()[..., None]


def to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, T, H, *D] -> [B, H, N, C, *D]``, zero padding T up to ``N * C``."""
    batch, seq_len = x.shape[:2]
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])
    # [B, N, C, H, *D] -> [B, H, N, C, *D]
    return x.movedim(3, 1)


def from_chunks(x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, H, N, C, D] -> [B, T, H, D]``, dropping the padding."""
    batch, heads, num_chunks, chunk_size, dim = x.shape
    x = x.movedim(1, 3).reshape(batch, num_chunks * chunk_size, heads, dim)
    return x[:, :seq_len]


def gate_sums(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Within-chunk gate sums, each a direct sum of gates (no difference of cumulative sums).

    Args:
        g: ``[..., C]`` log decays (``<= 0``, ``-inf`` allowed) of one chunk per row.

    Returns:
        ``(gamma, tail, pair)`` in g's dtype: gamma ``[..., C]`` = ``sum_{t <= i} g_t``; tail
        ``[..., C]`` = ``sum_{t > j} g_t``; pair ``[..., C, C]`` = ``sum_{j < t <= i} g_t`` for
        ``i >= j`` (0 on the diagonal) and ``-inf`` above it, so ``pair.exp()`` is the causal
        decay matrix ``exp(gamma_i - gamma_j)``. ``pair`` is a masked cumulative sum down the
        rows: ``where`` (not a 0/1 product) keeps ``0 * -inf`` out.
    """
    size = g.shape[-1]
    idx = torch.arange(size, device=g.device)
    after = idx[:, None] > idx[None, :]  # [i, j]: token i lies after token j
    gi = g[..., :, None].expand(*g.shape, size)
    pair = torch.where(after, gi, torch.zeros((), dtype=g.dtype, device=g.device)).cumsum(dim=-2)
    tail = pair[..., -1, :]  # sum_{j < t <= C-1} g_t, read before the upper triangle is masked
    pair = pair.masked_fill(idx[:, None] < idx[None, :], float("-inf"))
    return g.cumsum(dim=-1), tail, pair


def prepare_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> PreparedChunks:
    """Gate cumsum, decayed KKT, triangular solve and the WY factors of every chunk, in parallel.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]`` (g: log decay).
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: l2-normalise q and k first.
        chunk_size: C.

    Returns:
        :class:`PreparedChunks` in the compute dtype (fp32, float64 for float64 inputs).
    """
    seq_len, num_value_heads, key_dim = q.shape[1], v.shape[2], q.shape[3]
    if scale is None:
        scale = key_dim**-0.5
    dtype = compute_dtype(q.dtype)
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = to_chunks(expand_heads(q, num_value_heads) * scale, chunk_size)
    k = to_chunks(expand_heads(k, num_value_heads), chunk_size)
    vc = to_chunks(v.to(dtype), chunk_size)
    # [B, HV, N, C] prefix / tail sums and [B, HV, N, C, C] pairwise sums (-inf above the
    # diagonal, so exp gives 0 there and never overflows)
    gamma, tail, pair = gate_sums(to_chunks(g.to(dtype), chunk_size))
    beta_c = to_chunks(beta.to(dtype), chunk_size)
    decay = pair.exp()  # exp(gamma_i - gamma_j) for i >= j, else 0
    idx = torch.arange(chunk_size, device=q.device)

    strict = idx[:, None] > idx[None, :]
    kkt = (k @ k.transpose(-1, -2)) * decay * beta_c[..., :, None]
    kkt = kkt.masked_fill(~strict, 0.0)
    # (I + A) is unit lower triangular: solve_triangular(unitriangular=True) never reads the
    # diagonal, so A itself is passed. This is the UT transform applied to both right-hand sides.
    rhs = torch.cat([beta_c[..., None] * vc, (beta_c * gamma.exp())[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(kkt, rhs, upper=False, unitriangular=True)
    value_dim = vc.shape[-1]
    u, w = sol[..., :value_dim], sol[..., value_dim:]

    # a where, not the zeros of decay: q_i . k_j with a NaN key j > i times 0 would be NaN in row i
    causal = idx[:, None] >= idx[None, :]
    attn = torch.where(causal, (q @ k.transpose(-1, -2)) * decay, 0.0)
    return PreparedChunks(
        q=q, k=k, w=w, u=u, gamma=gamma, tail=tail, attn=attn, seq_len=seq_len,
        out_dtype=v.dtype,
    )


def scan_states(
    prep: PreparedChunks, initial_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequential inter-chunk scan (the only step that walks the chunks in order).

    Args:
        prep: the prepared segment.
        initial_state: ``[B, HV, K, V]`` entering state, or None for zeros.

    Returns:
        ``(states, v_new, final_state)``: states ``[B, HV, N, K, V]`` (state entering each chunk),
        v_new ``[B, HV, N, C, V]`` (residuals ``u - w h``), final_state ``[B, HV, K, V]``; all in
        the compute dtype.
    """
    batch, heads, num_chunks, _, key_dim = prep.k.shape
    value_dim = prep.u.shape[-1]
    if initial_state is None:
        h = prep.u.new_zeros(batch, heads, key_dim, value_dim)
    else:
        h = initial_state.to(prep.u.dtype)
    k_tail_t = prep.k_tail.transpose(-1, -2)  # [B, HV, N, K, C]
    chunk_decay = prep.chunk_decay[..., None, None]  # [B, HV, N, 1, 1]
    states, residuals = [], []
    for n in range(num_chunks):
        states.append(h)
        v_new = prep.u[:, :, n] - prep.w[:, :, n] @ h
        residuals.append(v_new)
        h = chunk_decay[:, :, n] * h + k_tail_t[:, :, n] @ v_new
    return torch.stack(states, dim=2), torch.stack(residuals, dim=2), h


def chunk_outputs(prep: PreparedChunks, states: torch.Tensor, v_new: torch.Tensor,
                  contain_nan: bool = True) -> torch.Tensor:
    """Outputs of all chunks at once: ``diag(exp(gamma)) Q h_n + attn_n v_new_n``.

    Args:
        prep: the prepared segment.
        states: ``[B, HV, N, K, V]`` state entering each chunk (from :func:`scan_states`).
        v_new: ``[B, HV, N, C, V]`` residuals (from :func:`scan_states`).
        contain_nan: keep a non-finite residual out of the earlier rows of its chunk (below);
            False skips that work (identical results for finite residuals), as the eager
            backward's recompute does.

    Returns:
        o ``[B, T, HV, V]`` in ``prep.out_dtype``.
    """
    q_decayed = prep.q * prep.gamma.exp()[..., None]
    if not contain_nan:
        o = q_decayed @ states + prep.attn @ v_new
        return from_chunks(o, prep.seq_len).to(prep.out_dtype)
    # NaN containment (docs/gdn.md): a non-finite residual v_new[j, c] (a NaN in v, k, beta or g
    # at token j makes rows >= j non-finite, in the columns it reaches) would reach every
    # earlier row i of its chunk through attn_ij * v_new[j, c] = 0 * NaN. The product takes the
    # finite entries only, and each column is NaN from its first non-finite row on, as the
    # recurrence's output is (the count of non-finite rows <= i is a product with a lower
    # triangle of ones: a cumulative max along rows is ~10x slower on the CPU). One more
    # [C, C] x [C, V] product and a few elementwise passes, no device sync.
    size = v_new.shape[-2]
    ones_lower = torch.ones(size, size, dtype=v_new.dtype, device=v_new.device).tril()
    bad = (~torch.isfinite(v_new)).to(v_new.dtype)
    v_safe = torch.nan_to_num(v_new, nan=0.0, posinf=0.0, neginf=0.0)
    o = q_decayed @ states + prep.attn @ v_safe
    o = torch.where(ones_lower @ bad > 0, float("nan"), o)
    return from_chunks(o, prep.seq_len).to(prep.out_dtype)


def chunk_output(
    prep: PreparedChunks, initial_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state-dependent half of a segment: scan from ``initial_state``, then the outputs.

    Returns:
        ``(o [B, T, HV, V] in prep.out_dtype, final_state [B, HV, K, V] compute dtype)``.
    """
    states, v_new, final_state = scan_states(prep, initial_state)
    return chunk_outputs(prep, states, v_new), final_state


def chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    contain_nan: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole chunked forward with plain autograd (keeps a chunk-level graph of the segment).

    Used by the memory-lean autograd function per block (without a graph in its forward, with
    autograd in its backward) and by the benchmark as the "plain autograd" baseline.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] compute dtype)``.
    """
    prep = prepare_chunks(q, k, v, g, beta, scale, use_qk_l2norm, chunk_size)
    states, v_new, final_state = scan_states(prep, initial_state)
    return chunk_outputs(prep, states, v_new, contain_nan), final_state
