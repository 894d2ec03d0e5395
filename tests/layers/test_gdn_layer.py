"""GatedDeltaNet (the layer GDN CP parallelises) against an independent composition, and its
sequence-mixer strategy slot.

The reference below uses nn.Conv1d's own causal padding, the token-by-token recurrence and
written-out gate / norm formulas, in float64, so a wrong piece of the module (channel layout,
gate sign, norm, grouping) shows up as a mismatch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlap_runtime.layers import (
    GatedDeltaNet,
    GDNProjections,
    GDNSequenceMixer,
    LocalGDNMixer,
)
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


class _FixedMixer(GDNSequenceMixer):
    """A strategy that checks what the layer hands it and returns a fixed ``o``."""

    def __init__(self, o: torch.Tensor) -> None:
        super().__init__()
        self.o = o

    def forward(self, layer: GatedDeltaNet, proj: GDNProjections,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, t = proj.mixed_qkv.shape[:2]
        assert proj.mixed_qkv.shape == (b, t, layer.conv_dim)
        assert proj.a.shape == proj.b.shape == (b, t, layer.num_value_heads)
        assert mask is not None and mask.shape == (b, t)
        return self.o


def test_forward_is_mask_project_mixer_finish() -> None:
    torch.manual_seed(2)
    m = GatedDeltaNet(32, 2, 4, 8, 8)
    assert isinstance(m.sequence_mixer, LocalGDNMixer)
    x = torch.randn(2, 20, 32)
    mask = torch.ones(2, 20)
    mask[1, :6] = 0
    o = torch.randn(2, 20, 4, 8)
    m.sequence_mixer = _FixedMixer(o)
    z = m.project(m.mask_input(x, mask)).z
    assert torch.equal(m(x, attention_mask=mask), m.finish(o, z, mask))


def test_mixer_adds_no_state() -> None:
    m = GatedDeltaNet(32, 2, 4, 8, 8)
    names = {n for n, _ in m.named_parameters()}
    assert set(m.state_dict()) == names  # swapping the strategy never changes a checkpoint
    assert not list(m.sequence_mixer.parameters()) and not list(m.sequence_mixer.buffers())


def test_mixer_protocol_and_shape_errors() -> None:
    m = GatedDeltaNet(32, 2, 4, 8, 8)
    m.sequence_mixer = GDNSequenceMixer()
    with pytest.raises(NotImplementedError, match=r"GDNSequenceMixer must implement forward"):
        m(torch.randn(1, 8, 32))
    m.sequence_mixer = LocalGDNMixer()
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\] = \[1, 8\], got \[1, 7\]"):
        m(torch.randn(1, 8, 32), attention_mask=torch.ones(1, 7))
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden=32\], got \[1, 8, 16\]"):
        m(torch.randn(1, 8, 16))


def _nan_padding_case(mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B=2, T=150 (three chunks, the last partial): row 0 padded at its end and in two gaps (one
    on a chunk boundary), row 1 left-padded. Returns (x with zeros at the pads, x with NaN /
    +inf / -inf at the pads, mask of ``mask_dtype``)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 150, 32, generator=gen)
    keep = torch.ones(2, 150, dtype=torch.bool)
    keep[0, 10] = False
    keep[0, 60:70] = False       # across the chunk boundary at 64
    keep[0, 140:] = False
    keep[1, :33] = False
    pad = ~keep
    x_zero = torch.where(pad[..., None], 0.0, x)
    poison = torch.full_like(x, float("nan"))
    poison[1, :5] = float("inf")
    poison[1, 5:9] = -float("inf")
    x_bad = torch.where(pad[..., None], poison, x)
    return x_zero, x_bad, keep.to(mask_dtype)


def _run(m: GatedDeltaNet, x: torch.Tensor, mask: torch.Tensor, w: torch.Tensor):
    m.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(True)
    y = m(xr, attention_mask=mask)
    (y * w).sum().backward()
    return y.detach(), xr.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool, torch.int64])
def test_nan_in_padded_slots_changes_nothing(mask_dtype: torch.dtype) -> None:
    """NaN / inf hidden states at padded positions (mask 0) give exactly the output, input
    gradient and parameter gradients of the same sequence with zeros there: the masks select
    (``torch.where``), they do not multiply (``NaN * 0 = NaN`` made every row from the first
    padded NaN on NaN)."""
    torch.manual_seed(3)
    m = GatedDeltaNet(32, 2, 4, 8, 8)
    with torch.no_grad():
        m.A_log.uniform_(-5.0, -3.0)  # slow decay: a leaked NaN would travel far
    x_zero, x_bad, mask = _nan_padding_case(mask_dtype)
    w = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(6))
    y0, dx0, g0 = _run(m, x_zero, mask, w)
    y1, dx1, g1 = _run(m, x_bad, mask, w)
    assert torch.isfinite(y0).all()
    assert torch.equal(y1, y0), f"{(~torch.isfinite(y1)).any(-1).sum().item()} rows non-finite"
    assert torch.equal(dx1, dx0)
    for n in g0:
        assert torch.equal(g1[n], g0[n]), n
    pad = mask == 0
    assert torch.count_nonzero(y1[pad]) == 0 and torch.count_nonzero(dx1[pad]) == 0


def test_mask_pieces_select_not_multiply() -> None:
    """Each place the layer applies the mask (input, the gates g and beta, the output) gives
    exact zeros at padded positions whatever they hold (NaN, inf), and leaves real positions
    bit for bit as they are."""
    torch.manual_seed(4)
    m = GatedDeltaNet(32, 2, 4, 8, 8)
    mask = torch.ones(2, 12)
    mask[0, 3] = 0
    mask[1, :4] = 0
    pad = mask == 0
    nan = float("nan")

    x = torch.randn(2, 12, 32)
    x_bad = x.masked_fill(pad[..., None], nan)
    xm = m.mask_input(x_bad, mask)
    assert torch.equal(xm[pad], torch.zeros_like(xm[pad]))
    assert torch.equal(xm[~pad], x[~pad])

    a = torch.randn(2, 12, 4).masked_fill(pad[..., None], float("inf"))  # softplus(inf) = inf
    b = torch.randn(2, 12, 4).masked_fill(pad[..., None], nan)
    with torch.no_grad():
        m.A_log[1] = nan  # a NaN parameter reaches real tokens too, but no padded one
    g, beta = m.gates(a, b, mask=mask)
    g_ref, beta_ref = m.gates(a, b)
    assert torch.equal(g[pad], torch.zeros_like(g[pad])) and torch.equal(beta[pad], torch.zeros_like(beta[pad]))
    assert torch.equal(g[~pad][:, [0, 2, 3]], g_ref[~pad][:, [0, 2, 3]])
    assert torch.equal(beta[~pad], beta_ref[~pad])

    o = torch.randn(2, 12, 4, 8).masked_fill(pad[..., None, None], nan)
    z = torch.randn(2, 12, 4, 8)
    out = m.finish(o, z, mask)
    out_ref = m.finish(o, z)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    assert torch.equal(out[~pad], out_ref[~pad])
