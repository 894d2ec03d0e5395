"""Token-by-token recurrent reference for the Gated DeltaNet rule (the semantic baseline).

One step per token, decay first, then the delta update (flash-linear-attention's naive recurrence,
Qwen3.5)::

    S_t = exp(g_t) S_(t-1)
    r_t = beta_t (v_t - S_t^T k_t)
    S_t = S_t + k_t r_t^T
    o_t = S_t^T (scale q_t)

with the state ``S`` of shape ``[K, V]``. This file is deliberately naive: it keeps a per-token
autograd graph and is meant for tests (float64) and small sizes, never for training.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last dim (the head dim); same shape and dtype.

    The epsilon sits inside the square root, so a zero vector maps to zero (the chunked path relies
    on this for its zero padding).
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the eager paths: float64 stays float64, everything else runs in fp32."""
    return torch.promote_types(dtype, torch.float32)


def expand_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """Repeat key heads for grouped values: ``[B, T, H, D] -> [B, T, HV, D]``.

    Value head ``j`` uses key head ``j // (HV // H)`` (the consecutive grouping of
    flash-linear-attention and Qwen3.5).
    """
    group = num_value_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the gated delta rule one token at a time.

    Args:
        q, k: ``[B, T, H, K]``, any float dtype.
        v: ``[B, T, HV, V]`` with ``HV % H == 0``.
        g: ``[B, T, HV]`` log decay (fp32 or fp64).
        beta: ``[B, T, HV]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` or None (zeros).
        use_qk_l2norm: l2-normalise q and k over the head dim first.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state ``[B, HV, K, V]`` in
        the compute dtype (fp32, or float64 for float64 inputs). Differentiable through autograd.
    """
    batch, seq_len, _, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    if scale is None:
        scale = key_dim**-0.5
    out_dtype, dtype = v.dtype, compute_dtype(q.dtype)
    if use_qk_l2norm:
        q, k = l2norm(q.to(dtype)), l2norm(k.to(dtype))
    q = expand_heads(q.to(dtype), num_value_heads) * scale
    k = expand_heads(k.to(dtype), num_value_heads)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    if initial_state is None:
        state = q.new_zeros(batch, num_value_heads, key_dim, value_dim)
    else:
        state = initial_state.to(dtype)
    outputs = []
    for t in range(seq_len):
        k_t = k[:, t]  # [B, HV, K]
        state = state * g[:, t].exp()[..., None, None]
        residual = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * residual[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    o = torch.stack(outputs, dim=1)
    return o.to(out_dtype), state
