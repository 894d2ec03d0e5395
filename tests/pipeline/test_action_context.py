"""The public ActionContext API: what a user callback can do is what the executor does.

- a callback defers the weight gradients of a full backward (``ctx.backward(action,
  defer_w=True)``), the way ``FlushWhileWaiting`` does, on real gloo ranks; the step drains
  them and every gradient equals a single-process run;
- misuse of the API raises before any state changes, naming the action and the rule;
- no module outside ``pipeline/context.py`` touches a private member of an ActionContext.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

import overlap_runtime
from overlap_runtime.pipeline import DeferredLinear, DeferredWQueue, PipelineSchedule, PipelineStage
from overlap_runtime.schedules import Action, ActionKind, ScheduleSpec
from overlap_runtime.testing import rel_l2, run_ranks

TOL = 1e-6
HIDDEN = 8
M = 4


class Block(nn.Module):
    def __init__(self, queue: DeferredWQueue | None) -> None:
        super().__init__()
        self.lin = (DeferredLinear(HIDDEN, HIDDEN, queue=queue) if queue is not None
                    else nn.Linear(HIDDEN, HIDDEN))
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain + x


def _model(n: int, queue: DeferredWQueue | None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(queue) for _ in range(n)])


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2 * M, HIDDEN, generator=g), torch.randn(2 * M, HIDDEN, generator=g)


def _errors(ctx, action: Action) -> list[str]:  # noqa: ANN001
    """Misuses of the API at this point of a B; each must raise before touching state."""
    s, m = action.stage, action.microbatch
    calls = [
        lambda: ctx.backward(Action(s, ActionKind.I, m), defer_w=True),
        lambda: ctx.backward(Action(s, ActionKind.F, m)),
        lambda: ctx.forward(Action(s + 7, ActionKind.F, m)),
        lambda: ctx.peer(action),
        lambda: ctx.send(action),
        lambda: ctx.post_recv(action),
        lambda: ctx.wait_recv(ActionKind.RECV_F, s, m + 100),
    ]
    out = []
    for call in calls:
        try:
            call()
        except (ValueError, RuntimeError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        else:
            out.append("NO ERROR")
    return out


def _user_defers_w(rank: int, world: int) -> dict:
    spec = ScheduleSpec(kind="1f1b", pp_size=world, num_microbatches=M)
    queue = DeferredWQueue(f"rank {rank}")
    model = _model(world, queue)
    stage = PipelineStage(model[rank], rank, world)
    sched = PipelineSchedule(spec, [stage], _loss, timeout_s=60)
    pending_after_b: list[int] = []
    errors: list[str] = []

    def deferred_b(action: Action, ctx) -> None:  # noqa: ANN001 - the documented signature
        if not errors:
            errors.extend(_errors(ctx, action))
        with ctx.span(action, "compute"):
            ctx.backward(action, defer_w=True)
        pending_after_b.append(queue.pending((action.stage, action.microbatch)))

    sched.register_custom_function(ActionKind.B, deferred_b)
    runs: list[tuple] = []
    queue.listeners.append(lambda run: runs.append((run.key, run.reason)))
    x, y = _data()
    losses: list[torch.Tensor] = []
    sched.step(x, target=y, losses=losses)

    # the same B without a queue: defer_w is refused, naming the stage
    plain = PipelineStage(_model(world, None)[rank], rank, world)
    plain_sched = PipelineSchedule(spec, [plain], _loss, timeout_s=60)
    no_queue: list[str] = []

    def refuse(action: Action, ctx) -> None:  # noqa: ANN001
        try:
            ctx.backward(action, defer_w=True)
        except ValueError as exc:
            no_queue.append(str(exc))
        ctx.run_default(action)

    plain_sched.register_custom_function(ActionKind.B, refuse)
    plain_sched.step(x, target=y)

    torch.manual_seed(0)
    ref = _model(world, DeferredWQueue("reference"))  # never captures: plain gradients
    ref_loss = _loss(ref(x), y)
    ref_loss.backward()
    errs = {f"stage{rank}.{n}": rel_l2(p.grad, q.grad) for (n, p), (_, q)
            in zip(model[rank].named_parameters(), ref[rank].named_parameters())}
    if losses:
        errs["loss"] = rel_l2(torch.stack(losses).mean(), ref_loss.detach())
    return {"errs": errs, "pending_after_b": pending_after_b, "runs": runs,
            "left": queue.pending(), "errors": errors, "no_queue": no_queue}


def test_a_callback_defers_w_through_the_public_api_and_the_step_drains_it() -> None:
    results = run_ranks(_user_defers_w, 2)
    for rank, r in enumerate(results):
        assert max(r["errs"].values()) <= TOL, r["errs"]
        assert r["pending_after_b"] == [1] * M  # each B left its linear's dW in the queue
        assert sorted(r["runs"]) == [((rank, m), "drain") for m in range(M)]  # end of step
        assert r["left"] == 0
        e = r["errors"]
        assert "NO ERROR" not in e, e
        assert "defer_w is for a full backward B" in e[0]
        assert f"{rank}F0 is not a B/I action" in e[1]
        assert f"stage {rank + 7} is not on this rank (stages here: [{rank}])" in e[2]
        assert "peer(" in e[3] and "not a SEND/RECV action" in e[3]
        assert "not a SEND_F/SEND_B" in e[4] and "not a RECV_F/RECV_B" in e[5]
        assert f"{rank}RECV_F{100} was never posted" in e[6]
        assert len(r["no_queue"]) == M and f"stage {rank} has no DeferredWQueue" in r["no_queue"][0]
    assert "loss" in results[1]["errs"]


def test_nothing_outside_the_context_module_touches_its_private_members() -> None:
    """The executor (and every callback in the package) uses the public API only."""
    root = Path(overlap_runtime.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path == root / "pipeline" / "context.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "ctx" and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} ctx.{node.attr}")
    assert not offenders, offenders
