"""trainer.grad_norm.clip_grad_norm on plain tensors (the DTensor / EP / PP sums are covered by
the 4D alignment tests): the norm and the clipping of ``torch.nn.utils.clip_grad_norm_``, kept
on the device as a tensor (the loop reads it after queueing the optimizer step), and no
clipping when the norm is not finite."""

from __future__ import annotations

import math

import pytest
import torch

from overlap_runtime.testing import rel_l2
from overlap_runtime.trainer.grad_norm import clip_grad_norm


def _params(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(7, 5), (13,), (3, 4, 2)]:
        p = torch.nn.Parameter(torch.randn(*shape, generator=gen))
        p.grad = torch.randn(*shape, generator=gen) * scale
        params.append(p)
    return params


@pytest.mark.parametrize("scale, max_norm", [(10.0, 1.0), (0.01, 1.0), (3.0, None)])
def test_matches_torch_clip_grad_norm(scale: float, max_norm: float | None) -> None:
    ours, ref = _params(scale), _params(scale)
    norm = clip_grad_norm(ours, max_norm, device="cpu")
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm is not None else math.inf,
                                              foreach=False)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.dtype == torch.float32
    assert abs(float(norm) - float(ref_norm)) <= 1e-6 * float(ref_norm)
    for p, q in zip(ours, ref):
        assert rel_l2(p.grad, q.grad) <= 1e-6
    if max_norm is not None and scale > 1:
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ours))
        assert abs(total - max_norm) <= 1e-5


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_norm_leaves_gradients_alone(bad: float) -> None:
    params = _params(10.0)
    params[1].grad[3] = bad
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1.0, device="cpu")
    assert not math.isfinite(float(norm))
    for p, b in zip(params, before):
        assert torch.equal(torch.nan_to_num(p.grad), torch.nan_to_num(b))
