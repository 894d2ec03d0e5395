"""layers.shared_input: several projections of one input with one accumulated input gradient
equal the separate linears (float64, and fp32 at the CPU tolerance), skip unused outputs, keep
non-plain modules' own calls, and leave no gradient-accumulation add in the backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlap_runtime.layers.shared_input import SharedInputLinearFunction, shared_input_linear
from overlap_runtime.pipeline.deferred_w import DeferredLinear, DeferredWQueue


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _linears(widths: tuple[int, ...], hidden: int, dtype: torch.dtype) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(hidden, w, bias=False, dtype=dtype) for w in widths]


def _grads(fn, x: torch.Tensor, linears: list[nn.Linear], weights: list[float]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and the gradients of x and every weight of ``sum_i c_i <y_i, r_i>``."""
    x = x.detach().clone().requires_grad_(True)
    for lin in linears:
        lin.weight.grad = None
    ys = fn(x, linears)
    torch.manual_seed(1)
    loss = sum(c * (y * torch.randn_like(y)).sum() for c, y in zip(weights, ys))
    loss.backward()
    return [y.detach() for y in ys], [x.grad] + [lin.weight.grad for lin in linears]


def _separate(x, linears):
    return [lin(x) for lin in linears]


def _shared(x, linears):
    return list(shared_input_linear(x, *linears))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_equals_the_separate_linears(dtype: torch.dtype, tol: float) -> None:
    """A GDN-like set (wide, medium, two narrow) on ``[B, T, hidden]``."""
    linears = _linears((48, 32, 4, 4), 24, dtype)
    x = torch.randn(2, 7, 24, dtype=dtype)
    ys_ref, g_ref = _grads(_separate, x, linears, [1.0, 0.5, 2.0, -1.0])
    ys, g = _grads(_shared, x, linears, [1.0, 0.5, 2.0, -1.0])
    for a, b in zip(ys, ys_ref):
        assert _rel(a, b) <= tol
    for a, b in zip(g, g_ref):
        assert a.shape == b.shape and _rel(a, b) <= tol, _rel(a, b)


def test_an_unused_output_contributes_nothing() -> None:
    linears = _linears((8, 6, 5), 10, torch.float64)
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    y0, _, y2 = shared_input_linear(x, *linears)
    (y0.sum() + (y2 * 3).sum()).backward()
    ref_x = linears[0].weight.sum(0) + 3 * linears[2].weight.sum(0)
    assert _rel(x.grad, ref_x.expand(3, 10)) <= 1e-12
    assert linears[1].weight.grad is None
    assert _rel(linears[2].weight.grad, 3 * x.detach().sum(0).expand(5, 10)) <= 1e-12


def test_one_product_chain_and_no_add_in_the_backward() -> None:
    """The engine's accumulation would show as an ``aten::add``; the function does ``mm`` then
    ``addmm_`` for the input gradient."""
    linears = _linears((16, 8, 2), 12, torch.float32)
    x = torch.randn(5, 12, requires_grad=True)
    ys = shared_input_linear(x, *linears)
    loss = sum(y.sum() for y in ys)
    with torch.profiler.profile() as prof:
        loss.backward()
    names = [e.name for e in prof.events()]
    assert names.count("aten::addmm_") == 2
    assert "aten::add" not in names and "aten::add_" not in names


def test_non_plain_modules_are_called_as_modules() -> None:
    """A bias, a forward hook or a subclass with its own forward keeps its module call."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    with_bias = [nn.Linear(6, 3), nn.Linear(6, 2, bias=False)]
    ys = shared_input_linear(x, *with_bias)
    assert torch.equal(ys[0], with_bias[0](x)) and torch.equal(ys[1], with_bias[1](x))
    seen: list[str] = []
    hooked = nn.Linear(6, 3, bias=False)
    hooked.register_forward_hook(lambda m, i, o: seen.append("hook"))
    shared_input_linear(x, hooked, nn.Linear(6, 2, bias=False))
    assert seen == ["hook"]
    deferred = DeferredLinear(6, 3, bias=False, queue=DeferredWQueue())
    y, = shared_input_linear(x.requires_grad_(True), deferred)
    assert "DeferredLinear" in type(y.grad_fn).__name__
    y, = shared_input_linear(x, nn.Linear(6, 3, bias=False))
    assert "SharedInputLinear" in type(y.grad_fn).__name__


def test_function_shapes() -> None:
    w = [torch.randn(3, 4), torch.randn(1, 4)]
    outs = SharedInputLinearFunction.apply(torch.randn(2, 5, 4), *w)
    assert [tuple(o.shape) for o in outs] == [(2, 5, 3), (2, 5, 1)]
