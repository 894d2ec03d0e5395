"""ZB-H1 and DualPipeV: IR, simulated bubbles against the published formulas, and runs on real
gloo ranks compared with a single-process run (loss and every gradient)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn

from overlap_runtime.graph.simulate import CostModel, simulate
from overlap_runtime.pipeline import (DeferredLinear, DeferredWQueue, FlushWhileWaiting,
                                      PipelineSchedule, PipelineStage, SavedTensorMeter)
from overlap_runtime.schedules import ActionKind, ScheduleSpec, build_schedule, compile_spec
from overlap_runtime.schedules.bubbles import (analytic_idle, couple_overlapped_steps,
                                               simulate_compute_only)
from overlap_runtime.schedules.ir import parse_action
from overlap_runtime.testing import rel_l2, run_ranks

from tests.support.schedules import torch_pipelining

TOL = 1e-6
HIDDEN = 8


def _spec(kind: str, pp: int, m: int) -> ScheduleSpec:
    if kind == "dualpipev":
        return ScheduleSpec(kind=kind, pp_size=pp, num_microbatches=m, virtual_stages=2,
                            placement="v")
    return ScheduleSpec(kind=kind, pp_size=pp, num_microbatches=m)


# ---------------------------------------------------------------------------- IR and spec


def test_kinds_work_after_a_plain_spec_import() -> None:
    import subprocess
    import sys

    code = ("from overlap_runtime.schedules import ScheduleSpec\n"
            "s = ScheduleSpec(kind='zero_bubble', pp_size=4, num_microbatches=8)\n"
            "d = ScheduleSpec(kind='dualpipev', pp_size=2, num_microbatches=4, virtual_stages=2,"
            " placement='v')\nprint(s.kind, d.num_stages)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["zero_bubble", "4"]


@pytest.mark.parametrize("fields, needle", [
    (dict(kind="dualpipev", pp_size=4, num_microbatches=7, virtual_stages=2, placement="v"),
     "rule num_microbatches >= 2 * pp_size = 8"),
    (dict(kind="dualpipev", pp_size=4, num_microbatches=8, virtual_stages=2),
     "placement='loop' is not supported by kind='dualpipev'"),
    (dict(kind="dualpipev", pp_size=4, num_microbatches=8, placement="v"),
     "virtual_stages=1 is out of range for kind='dualpipev'"),
    (dict(kind="zero_bubble", pp_size=4, num_microbatches=8, virtual_stages=2),
     "virtual_stages=2 is out of range for kind='zero_bubble'"),
    (dict(kind="zero_bubble", pp_size=4, num_microbatches=8, overlap_b_f=True),
     "splits every backward into I and W"),
    (dict(kind="dualpipev", pp_size=2, num_microbatches=4, virtual_stages=2, placement="v",
          split_backward=True), "split_backward=True is not supported by kind='dualpipev'"),
])
def test_invalid_specs_name_the_rule(fields: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        ScheduleSpec(**fields)
    assert needle in str(info.value)


def test_zero_bubble_diagram() -> None:
    sched = build_schedule(_spec("zero_bubble", 4, 6))
    text = {r: " ".join(str(a)[1:] for a in acts) for r, acts in sched.items()}
    assert text[0] == "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5"
    assert text[3] == "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5"


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 12), (8, 16)])
def test_orders_equal_torchs(p: int, m: int) -> None:
    """Per rank, our compute order equals torch's ScheduleInterleavedZeroBubble (one stage per
    rank, bubbles dropped) and ScheduleDualPipeV."""
    ts = torch_pipelining()
    zb = build_schedule(_spec("zero_bubble", p, m))
    dv = build_schedule(_spec("dualpipev", p, m))
    for rank in range(p):
        t = ts.ScheduleInterleavedZeroBubble.__new__(ts.ScheduleInterleavedZeroBubble)
        t.pp_group_size, t._n_microbatches, t.n_local_stages, t.rank = p, m, 1, rank
        t.number_of_rounds = max(1, m // p)
        t.microbatches_per_round = m // t.number_of_rounds
        if m % t.number_of_rounds == 0:
            theirs = [str(a) for a in t._calculate_single_rank_operations(rank) if a is not None]
            assert theirs == [str(a) for a in zb[rank]], (rank, theirs)
        d = ts.ScheduleDualPipeV.__new__(ts.ScheduleDualPipeV)
        d.pp_group_size, d._n_microbatches = p, m
        theirs = [str(a) for a in d._calculate_single_rank_operations(rank) if a is not None]
        assert theirs == [str(a) for a in dv[rank]], (rank, theirs)


def test_dualpipev_steady_state_is_overlapped() -> None:
    spec = _spec("dualpipev", 4, 12)
    sched = build_schedule(spec)
    for rank, acts in sched.items():
        stages = {rank, 2 * 4 - 1 - rank}
        compound = [a for a in acts if a.is_compound]
        assert len(compound) == 2 * (12 - 8 + rank + 1) - (1 if rank == 3 else 0) + (3 - rank)
        for a in compound:
            f, b = a.sub_actions
            assert a.kind is ActionKind.OVERLAP_F_B and f.kind is ActionKind.F
            assert b.kind is ActionKind.B and {f.stage, b.stage} == stages
    compile_spec(spec)  # lowers, validates, proves deadlock freedom


# ---------------------------------------------------------------------------- bubbles

EQUAL = CostModel(F=1.0, B=2.0, I=1.0, W=1.0)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_zero_bubble_bubble_is_a_third_of_1f1bs(p: int, mult: int) -> None:
    """ZB-H1: (p-1)(F+I-W) idle per rank against 1F1B's (p-1)(F+I+W), in the lowered schedule
    (blocking comm lane) and with free instantaneous communication alike."""
    m = mult * p
    zb = compile_spec(_spec("zero_bubble", p, m)).simulate(EQUAL)
    ref = compile_spec(_spec("1f1b", p, m)).simulate(EQUAL)
    assert zb.makespan == 3 * m + (p - 1) == 3 * m + analytic_idle("zero_bubble", p, EQUAL)
    assert ref.makespan == 3 * m + 3 * (p - 1)
    assert zb.bubble_ratio == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    for r, busy in zb.busy_by_rank.items():
        assert zb.makespan - busy == p - 1 == (ref.makespan - ref.busy_by_rank[r]) / 3
    free = simulate_compute_only(_spec("zero_bubble", p, m), EQUAL)
    assert free.makespan == zb.makespan
    # also exact for I = 2F = 2W (the order is tuned for t_W <= t_F <= t_I)
    costs = CostModel(F=1.0, B=3.0, I=2.0, W=1.0)
    zb2 = compile_spec(_spec("zero_bubble", p, m)).simulate(costs)
    assert zb2.makespan == 4 * m + analytic_idle("zero_bubble", p, costs) == 4 * m + 2 * (p - 1)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_dualpipev_bubble_equals_the_published_formula(p: int, extra: int) -> None:
    """(p-1)(F&B + B - 3W) per rank (DeepSeek-V3 report / DualPipe README, PP = 2p stages on p
    ranks), F&B = F + B on one device: with overlapped steps run as a unit (both sub-actions
    start when both inputs are here, as DualPipe runs them) and free communication."""
    m = 2 * p + extra
    spec = _spec("dualpipev", p, m)
    unit = simulate_compute_only(spec, EQUAL, overlapped_as_unit=True)
    work = 2 * m * 3
    idle = analytic_idle("dualpipev", p, EQUAL)
    assert idle == 2 * (p - 1)
    assert unit.makespan == work + idle
    assert all(unit.makespan - b == idle for b in unit.busy_by_rank.values())
    # the simulator's default threads may start the forward of an overlapped step before the
    # backward's input is here: half of that bubble goes, (p-1) F per rank
    free = simulate_compute_only(spec, EQUAL)
    assert free.makespan == work + (p - 1)


def test_couple_overlapped_steps_only_adds_edges_between_compound_sub_actions() -> None:
    spec = _spec("dualpipev", 2, 4)
    graph, schedule = simulate_compute_only(spec, EQUAL, return_graph=True)
    before = graph.num_edges()
    added = couple_overlapped_steps(graph, schedule)
    assert graph.num_edges() == before + len(added) and added
    ids = {str(x) for acts in schedule.values() for a in acts if a.is_compound
           for x in a.sub_actions}
    assert all(v in ids for _, v in added)
    assert simulate(graph, EQUAL).makespan == 24 + 2


# ---------------------------------------------------------------------------- runtime


class Block(nn.Module):
    """linear (deferred or not) -> tanh -> gain, with a residual; ``gain`` is a parameter that
    no deferred layer owns (its gradient comes from the I walk)."""

    def __init__(self, width: int, queue: DeferredWQueue | None) -> None:
        super().__init__()
        self.lin = (DeferredLinear(width, width, queue=queue) if queue is not None
                    else nn.Linear(width, width))
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain + x


def _model(num_stages: int, queue: DeferredWQueue | None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(HIDDEN, queue) for _ in range(num_stages)])


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, HIDDEN, generator=g), torch.randn(batch, HIDDEN, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(num_stages: int, batch: int) -> tuple[nn.Sequential, torch.Tensor]:
    model = _model(num_stages, DeferredWQueue("reference"))  # never captures: plain gradients
    x, y = _data(batch)
    loss = _loss(model(x), y)
    loss.backward()
    return model, loss.detach()


def _run_and_compare(rank: int, world: int, kind: str, m: int, deferred: bool,
                     flush: bool = False) -> dict:
    spec = _spec(kind, world, m)
    queue = DeferredWQueue(f"rank {rank}") if deferred else None
    model = _model(spec.num_stages, queue)
    stages = [PipelineStage(model[s], s, spec.num_stages)
              for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank]
    assert all(st.deferred_w is queue for st in stages)
    sched = PipelineSchedule(spec, stages, _loss, timeout_s=60)
    program = [str(a) for a in sched.program]
    cur = {"step": -1, "action": ""}
    runs: list[tuple] = []

    def track(action, ctx):  # noqa: ANN001
        cur["step"], cur["action"] = ctx.step_index, str(ctx.current_action)
        if flush and rank == world - 1 and action.kind is ActionKind.F:
            time.sleep(0.02)  # a slow peer: the other ranks' receives stay in flight a while
        ctx.run_default(action)

    if flush:
        for k in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W):
            sched.register_custom_function(k, track)
        sched.register_custom_function(ActionKind.OVERLAP_F_B,
                                       FlushWhileWaiting(queue, defer_backward=True))
        queue.listeners.append(lambda run: runs.append(
            (run.key, run.seq, run.reason, run.step if run.step is not None else cur["step"])))
    batch = 2 * m
    x, y = _data(batch)
    ref_model, ref_loss = _reference(spec.num_stages, batch)
    errs: dict[str, float] = {}
    for step in range(2):
        for p in model.parameters():
            p.grad = None
        runs.clear()
        losses: list[torch.Tensor] = []
        sched.step(x, target=y, losses=losses)
        assert queue is None or queue.pending() == 0
        for st in stages:
            for (name, p), (_, q) in zip(model[st.stage_index].named_parameters(),
                                         ref_model[st.stage_index].named_parameters()):
                errs[f"step{step}.stage{st.stage_index}.{name}"] = rel_l2(p.grad, q.grad)
        if losses:
            errs[f"step{step}.loss"] = rel_l2(torch.stack(losses).mean(), ref_loss)
    return {"errs": errs, "program": program, "runs": runs}


RUN_CASES = [
    ("zero_bubble", 2, 4, True), ("zero_bubble", 4, 8, True), ("zero_bubble", 4, 8, False),
    ("dualpipev", 2, 4, True), ("dualpipev", 4, 8, True), ("dualpipev", 2, 5, False),
]


@pytest.mark.parametrize("kind,world,m,deferred", RUN_CASES)
def test_loss_and_every_gradient_match_single_process(kind, world, m, deferred) -> None:
    results = run_ranks(_run_and_compare, world, args=(kind, m, deferred))
    worst = max(max(r["errs"].values()) for r in results)
    assert worst <= TOL, results
    assert sum(1 for r in results for k in r["errs"] if k.endswith("loss")) == 2  # one rank
    n_params = sum(1 for r in results for k in r["errs"] if k.startswith("step0.stage"))
    stages = world * (2 if kind == "dualpipev" else 1)
    assert n_params == 3 * stages  # lin.weight, lin.bias, gain of every stage


@pytest.mark.parametrize("world,m", [(2, 6), (4, 8)])
def test_w_flushed_in_overlapped_windows_and_drained_in_cool_down(world: int, m: int) -> None:
    """DualPipeV with FlushWhileWaiting(defer_backward=True): every deferred W task runs exactly
    once, after the step that produced it; the W of an I runs in a window or at its own W action
    (never later); window flushes happen inside OVERLAP_F_B steps, oldest first; the rest is
    drained at the end of the program. Gradients still match."""
    results = run_ranks(_run_and_compare, world, args=("dualpipev", m, True, True))
    windows = 0
    for rank, res in enumerate(results):
        assert max(res["errs"].values()) <= TOL, res["errs"]
        program = res["program"]
        producer: dict[tuple[int, int], int] = {}
        w_action: dict[tuple[int, int], int] = {}
        for i, text in enumerate(program):
            a = parse_action(text)
            for x in a.leaves():
                # tasks come from every I and from the B of overlapped steps (deferred by the
                # callback); a B alone computes its weight gradient at once
                if x.kind is ActionKind.I or (x.kind is ActionKind.B and a.is_compound):
                    producer[(x.stage, x.microbatch)] = i
                if x.kind is ActionKind.W:
                    w_action[(x.stage, x.microbatch)] = i
        keys = [r[0] for r in res["runs"]]
        assert sorted(keys) == sorted(producer), (rank, keys)  # one linear per stage: one task
        last_window_seq = -1
        for key, seq, reason, step in res["runs"]:
            assert step > producer[key], (rank, key, reason, step)
            if key in w_action:
                assert step <= w_action[key] and reason in ("window", "action")
                if reason == "action":
                    assert step == w_action[key]
            if reason == "window":
                windows += 1
                assert program[step].endswith("OVERLAP_F_B"), program[step]
                assert seq > last_window_seq
                last_window_seq = seq
            if reason == "drain":
                assert step == len(program) and key not in w_action
    assert windows > 0


# ---------------------------------------------------------------------------- memory


def _peak_memory(rank: int, world: int, kind: str, m: int, deferred: bool, width: int) -> int:
    spec = _spec(kind, world, m)
    queue = DeferredWQueue() if deferred else None
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width, queue) for _ in range(spec.num_stages)])
    stages = [PipelineStage(model[s], s, spec.num_stages)
              for s in range(spec.num_stages) if spec.stage_to_rank(s) == rank]
    sched = PipelineSchedule(spec, stages, _loss, timeout_s=60)
    meter = SavedTensorMeter([queue] if queue is not None else [])

    def sampled(action, ctx):  # noqa: ANN001
        ctx.run_default(action)
        meter.sample()

    for k in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W):
        sched.register_custom_function(k, sampled)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4 * m, width, generator=g), torch.randn(4 * m, width, generator=g)
    with meter:
        sched.step(x, target=y)
        after = meter.sample()
    return meter.peak if after == 0 else -after


def test_deferred_w_memory_against_1f1b_measured() -> None:
    """Peak bytes of saved activations per rank (SavedTensorMeter), pp=4, m=8, [4, 32] fp32
    microbatches (one activation = 512 B). A Block saves 2 activations per microbatch (linear
    input, tanh output; the last stage 1 more for the loss); a pending deferred W holds 2 (the
    linear input and its output gradient). Stage 0's inputs are views of the whole batch, held
    as one 4096 B storage."""
    world, m, width = 4, 8, 32
    act, batch = 4 * width * 4, 4 * m * width * 4
    plain = run_ranks(_peak_memory, world, args=("1f1b", m, False, width))
    zb_def = run_ranks(_peak_memory, world, args=("zero_bubble", m, True, width))
    zb_pub = run_ranks(_peak_memory, world, args=("zero_bubble", m, False, width))
    assert min(plain + zb_def + zb_pub) > 0  # nothing is left held after the step
    last = world - 1
    # 1F1B: p - r microbatches in flight on rank r
    assert plain == [batch + world * act] + [2 * (world - r) * act for r in range(1, last)] \
        + [3 * act]
    # ZB-H1 with deferred W: the same p - r in flight, plus the r W held back on rank r
    assert zb_def == [batch + world * act] + [2 * world * act for r in range(1, last)] \
        + [(3 + 2 * last) * act]
    # public-autograd I/W retains each held-back microbatch's whole graph (here as large as a
    # pending W, except on the last stage where the loss graph is retained too)
    assert zb_pub[:last] == zb_def[:last] and zb_pub[last] == 4 * 3 * act > zb_def[last]
