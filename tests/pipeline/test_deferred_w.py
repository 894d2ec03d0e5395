"""DeferredWQueue and DeferredLinear in one process: dX now, dW later, same gradients."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from overlap_runtime.pipeline.deferred_w import (DeferredLinear, DeferredWQueue,
                                                  find_deferred_w_queue)
from overlap_runtime.pipeline import PipelineStage
from overlap_runtime.testing import rel_l2


def _pair(queue: DeferredWQueue, shape=(3, 5, 6)):
    torch.manual_seed(0)
    ref = nn.Linear(6, 4)
    lin = DeferredLinear(6, 4, queue=queue)
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(*shape)
    return ref, lin, x


def test_outside_a_capture_it_is_nn_linear() -> None:
    ref, lin, x = _pair(DeferredWQueue())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa).square().sum().backward()
    lin(xb).square().sum().backward()
    assert rel_l2(xb.grad, xa.grad) < 1e-6
    assert rel_l2(lin.weight.grad, ref.weight.grad) < 1e-6
    assert rel_l2(lin.bias.grad, ref.bias.grad) < 1e-6


def test_inside_a_capture_dw_waits_in_the_queue_until_run() -> None:
    q = DeferredWQueue()
    ref, lin, x = _pair(q)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xa).square().sum().backward()
    with q.capture((1, 7)):
        lin(xb).square().sum().backward()
    assert rel_l2(xb.grad, xa.grad) < 1e-6  # dX at once
    assert lin.weight.grad is None and lin.bias.grad is None
    assert q.pending() == 1 and q.pending((1, 7)) == 1 and q.pending_keys() == [(1, 7)]
    # holds the input [3, 5, 6] and the output gradient [3, 5, 4], fp32
    assert q.held_bytes() == 4 * (3 * 5 * 6 + 3 * 5 * 4)
    runs = []
    q.listeners.append(runs.append)
    assert q.run((1, 7)) == 1 and q.pending() == 0 and q.held_bytes() == 0
    assert runs[0].key == (1, 7) and runs[0].reason == "action"
    assert rel_l2(lin.weight.grad, ref.weight.grad) < 1e-6
    assert rel_l2(lin.bias.grad, ref.bias.grad) < 1e-6
    # a second microbatch accumulates
    with q.capture((1, 8)):
        lin(xb.detach()).square().sum().backward()
    q.drain()
    assert rel_l2(lin.weight.grad, 2 * ref.weight.grad) < 1e-6


def test_flush_runs_oldest_first_until_the_deadline() -> None:
    q = DeferredWQueue()
    order: list[int] = []
    deadline = threading.Event()
    for i in range(5):
        with q.capture(("k", i)):
            q.push(lambda i=i: (order.append(i), deadline.set() if i == 2 else None))
    assert q.flush(max_tasks=1) == 1 and order == [0]
    assert q.flush(deadline) == 2 and order == [0, 1, 2]  # stops once the event is set
    assert q.flush(lambda: False) == 2 and order == [0, 1, 2, 3, 4]
    assert q.flush() == 0


def test_misuse_is_loud() -> None:
    q = DeferredWQueue("q0")
    with pytest.raises(RuntimeError, match="outside a capture"):
        q.push(lambda: None, what="w")
    with q.capture((0, 0)):
        with pytest.raises(RuntimeError, match=r"capture\(\(0, 1\)\) while capture\(\(0, 0\)\)"):
            with q.capture((0, 1)):
                pass
    assert q.capturing is None
    with q.capture((0, 1)):
        q.push(lambda: None)
        q.push(lambda: None)
    with q.capture((2, 1)):
        q.push(lambda: None)
    assert q.discard(lambda key: key[0] == 0) == 2 and q.pending_keys() == [(2, 1)]
    with pytest.raises(TypeError, match="needs a DeferredWQueue"):
        DeferredLinear(2, 2, queue=None)  # type: ignore[arg-type]
    two = nn.Sequential(DeferredLinear(2, 2, queue=q), DeferredLinear(2, 2, queue=DeferredWQueue()))
    with pytest.raises(ValueError, match="2 different DeferredWQueue"):
        find_deferred_w_queue(two)


class _Block(nn.Module):
    def __init__(self, lin: nn.Module) -> None:
        super().__init__()
        self.lin = lin
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain + x


@pytest.mark.parametrize("deferred", [True, False])
def test_stage_i_then_w_equals_b(deferred: bool) -> None:
    """PipelineStage: I + W (deferred queue, or public autograd for plain modules) gives the
    input gradient and every parameter gradient of B; with the queue, I frees the graph and
    only the W task's tensors stay."""
    q = DeferredWQueue()
    torch.manual_seed(0)
    ref = _Block(nn.Linear(6, 6))
    torch.manual_seed(0)
    mod = _Block(DeferredLinear(6, 6, queue=q) if deferred else nn.Linear(6, 6))
    a, b = PipelineStage(ref, 1, 3), PipelineStage(mod, 1, 3)
    assert b.deferred_w is (q if deferred else None)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    for st in (a, b):
        st.forward(0, (x,))
    dx_ref = a.backward(0, g)
    dx = b.backward_input(0, g)
    assert rel_l2(dx, dx_ref) < 1e-6
    if deferred:
        assert mod.lin.weight.grad is None and mod.gain.grad is not None  # gain: during I
        assert q.pending((1, 0)) == 1 and b.microbatches[0].output is None
    with pytest.raises(RuntimeError, match="before its I"):
        b.forward(1, (x,))
        b.backward_weight(1)
    b.backward_weight(0)
    assert 0 not in b.microbatches and q.pending() == 0
    for (name, p), (_, r) in zip(mod.named_parameters(), ref.named_parameters()):
        assert rel_l2(p.grad, r.grad) < 1e-6, name
