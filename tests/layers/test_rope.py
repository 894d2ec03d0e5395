"""Partial RoPE (``layers.rope.apply_partial_rotary``, an autograd Function that widens only the
rotated channels): equal bit for bit, forward and backward, to the same arithmetic as plain ops
(every channel widened, rotated halves concatenated, rounded once); the float64 gradient checked
numerically; only the angles saved for backward."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.layers.rope import apply_partial_rotary


def _plain(x: torch.Tensor, pos: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    compute = torch.promote_types(x.dtype, torch.float32)
    half = rot // 2
    inv_freq = base ** (-torch.arange(0, half, dtype=compute) * 2 / rot)
    angle = (pos.to(compute).reshape(-1, x.shape[1]).unsqueeze(-1) * inv_freq).unsqueeze(2)
    cos, sin = angle.cos(), angle.sin()
    xc = x.to(compute)
    x1, x2, rest = xc[..., :half], xc[..., half:rot], xc[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rot,batch_positions", [(32, False), (128, True), (2, False)])
def test_equals_plain_ops_bit_for_bit(dtype: torch.dtype, rot: int, batch_positions: bool
                                      ) -> None:
    gen = torch.Generator().manual_seed(rot)
    x = torch.randn(2, 50, 3, 128, generator=gen).to(dtype)
    pos = (torch.randint(0, 100_000, (2, 50), generator=gen) if batch_positions
           else torch.arange(50) + 7)
    dy = torch.randn(x.shape, generator=gen).to(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = apply_partial_rotary(a, pos, rot, 1e6), _plain(b, pos, rot, 1e6)
    ya.backward(dy)
    yb.backward(dy)
    assert ya.dtype == dtype and a.grad.dtype == dtype
    assert torch.equal(ya, yb) and torch.equal(a.grad, b.grad)


def test_float64_gradient_and_saved_set() -> None:
    x = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(6)
    assert torch.autograd.gradcheck(lambda t: apply_partial_rotary(t, pos, 4, 10_000.0), (x,))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        apply_partial_rotary(x, pos, 4, 10_000.0)
    assert sorted(tuple(t.shape) for t in saved) == [(1, 6, 1, 2), (1, 6, 1, 2)]  # cos, sin
