"""GatedDeltaNet (the module the GDN CP layer parallelises) against an independent composition.

The reference below uses nn.Conv1d's own causal padding, the token-by-token recurrence and
written-out gate / norm formulas, in float64, so a wrong piece of the module (channel layout,
gate sign, norm, grouping) shows up as a mismatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overlap_runtime.models import GatedDeltaNet
from overlap_runtime.ops.gdn import recurrent_gated_delta_rule
from overlap_runtime.testing import rel_l2


def _reference(m: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    mixed = m.in_proj_qkv(x)
    conv = F.silu(m.conv1d(mixed.transpose(1, 2))[..., :t]).transpose(1, 2)
    kd, vd, h, hv = m.head_k_dim, m.head_v_dim, m.num_key_heads, m.num_value_heads
    q = conv[..., : h * kd].reshape(b, t, h, kd)
    k = conv[..., h * kd : 2 * h * kd].reshape(b, t, h, kd)
    v = conv[..., 2 * h * kd :].reshape(b, t, hv, vd)
    g = -torch.exp(m.A_log) * F.softplus(m.in_proj_a(x) + m.dt_bias)
    beta = torch.sigmoid(m.in_proj_b(x))
    o, _ = recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    z = m.in_proj_z(x).reshape(b, t, hv, vd)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.eps) * m.norm.weight
    return m.out_proj((normed * F.silu(z)).reshape(b, t, hv * vd))


def test_module_matches_composition_float64() -> None:
    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 4, 8, 8).double()
    with torch.no_grad():
        m.A_log.uniform_(-4.0, 0.0)
        m.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    assert rel_l2(m(x), _reference(m, x)) <= 1e-10


def test_qwen35_default_shapes() -> None:
    m = GatedDeltaNet()  # Qwen3.5: hidden 2048, 16 key heads, 32 value heads, head dims 128
    assert (m.num_key_heads, m.num_value_heads, m.head_k_dim, m.head_v_dim) == (16, 32, 128, 128)
    assert m.conv1d.weight.shape == (2 * 16 * 128 + 32 * 128, 1, 4)
    assert m.conv_halo == 3
    assert m.A_log.shape == m.dt_bias.shape == (32,)


def test_left_padding_equals_unpadded_run() -> None:
    torch.manual_seed(1)
    m = GatedDeltaNet(32, 2, 4, 8, 8)
    x = torch.randn(1, 90, 32)
    mask = torch.ones(1, 90)
    mask[:, :25] = 0
    y = m(x, attention_mask=mask)
    assert torch.count_nonzero(y[:, :25]) == 0
    assert rel_l2(y[:, 25:], m(x[:, 25:])) <= 1e-6
