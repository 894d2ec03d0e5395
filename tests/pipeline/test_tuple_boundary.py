"""Tuples of tensors across stage boundaries (issue #27 item 4): a model passes
``(hidden, aux, ids)`` between stages - ``hidden`` needs grad, ``aux`` is a float computed without
grad, ``ids`` is int64 - under 1F1B and interleaved 1F1B with OVERLAP_B_F (plus zero bubble's
split I/W and dualpipev's same-rank hand-off) on 2 gloo ranks, the losses and every gradient
equal to one process; plus in-process checks of the stage's rules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from overlap_runtime.pipeline import (PipelineSchedule, PipelineStage, Schedule1F1B,
                                      ScheduleInterleaved1F1B, TensorMeta)
from overlap_runtime.schedules import ActionKind, ScheduleSpec
from overlap_runtime.testing import rel_l2, run_ranks

TOL = 1e-6
HIDDEN, BATCH, M, VOCAB = 8, 8, 4, 5
# name -> virtual stages: the two the issue asks for, plus split backward (I/W through
# autograd.grad) and the V placement (a tuple handed from stage 1 to stage 2 on one rank)
SCHEDULES = {"1f1b": 1, "interleaved_overlap_b_f": 2, "zero_bubble": 1, "dualpipev": 2}


def _spec(name: str, world: int) -> ScheduleSpec:
    kind = "interleaved_1f1b" if name.startswith("interleaved") else name
    return ScheduleSpec(kind=kind, pp_size=world, num_microbatches=M,
                        virtual_stages=SCHEDULES[name], overlap_b_f=name.endswith("overlap_b_f"),
                        placement="v" if name == "dualpipev" else "loop")


class TupleChunk(nn.Module):
    """Stage ``s`` of ``n``: the first takes ``x [B, H] f32`` and makes ``ids [B, H] int64``;
    the others take ``(h [B, H] f32 grad, aux [B, H] f32 no grad, ids [B, H] int64)``; all but
    the last return such a triple, the last returns ``[B, H]``."""

    def __init__(self, s: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(10 + s)
        self.s, self.n = s, n
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.table = nn.Parameter(torch.randn(VOCAB) * 0.1)

    def forward(self, h: torch.Tensor, aux: torch.Tensor | None = None,
                ids: torch.Tensor | None = None) -> Any:
        if ids is None:  # first stage
            ids = (h.abs() * 7).long() % VOCAB
            aux = torch.ones_like(h)
        assert aux is not None and not aux.requires_grad and ids.dtype == torch.int64
        h = torch.tanh(self.lin(h)) * aux + self.table[ids]
        if self.s == self.n - 1:
            return h
        with torch.no_grad():
            aux = torch.sigmoid(h) + 0.5  # a float that carries no gradient
        return h, aux, (ids + 1) % VOCAB


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, HIDDEN, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(n: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: every chunk in order per microbatch, the mean of the microbatch losses."""
    chunks = [TupleChunk(s, n) for s in range(n)]
    x, y = _data()
    losses = []
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        v: Any = (xm,)
        for c in chunks:
            v = c(*v) if isinstance(v, tuple) else c(v)
        losses.append(_loss(v, ym))
    torch.stack(losses).mean().backward()
    return [float(v.detach()) for v in losses], {f"S{s}.{k}": p.grad.clone() for s, c in enumerate(chunks)
                                        for k, p in c.named_parameters()}


def _run(rank: int, world: int) -> dict[str, Any]:
    from overlap_runtime.ops import comm

    sent_b: list[str] = []
    isend = comm.isend

    def counting_isend(x: torch.Tensor, *args: Any, what: str = "", **kw: Any) -> Any:
        if "SEND_B" in what:
            sent_b.append(f"{what} {x.dtype}")
        return isend(x, *args, what=what, **kw)

    comm.isend = counting_isend  # type: ignore[assignment]
    results: dict[str, Any] = {}
    for name, virtual in SCHEDULES.items():
        spec = _spec(name, world)
        n = spec.num_stages
        mine = [s for s in range(n) if spec.stage_to_rank(s) == rank]
        chunks = {s: TupleChunk(s, n) for s in mine}
        stages = [PipelineStage(chunks[s], s, n) for s in mine]
        sched: Any
        if name == "1f1b":  # torch-style constructors for the two the issue names
            sched = Schedule1F1B(stages, M, loss_fn=_loss, timeout_s=30)
        elif name == "interleaved_overlap_b_f":
            sched = ScheduleInterleaved1F1B(stages, M, loss_fn=_loss, overlap_b_f=True,
                                            timeout_s=30)
        else:
            sched = PipelineSchedule(spec, stages, _loss, timeout_s=30)
        x, y = _data()
        losses: list[torch.Tensor] = []
        sent_b.clear()
        sched.step(*((x,) if 0 in chunks else ()), target=y if n - 1 in chunks else None,
                   losses=losses)
        results[name] = {
            "grads": {f"S{s}.{k}": p.grad.clone() for s, c in chunks.items()
                      for k, p in c.named_parameters()},
            "losses": [float(v) for v in losses],
            "input_meta": {s: sched.stages[s].input_meta for s in mine if s > 0},
            "sent_b": list(sent_b),
            "overlapped": sum(a.kind is ActionKind.OVERLAP_B_F for a in sched.program),
            "split": sum(a.kind is ActionKind.I for a in sched.program),
        }
    return results


def test_tuple_boundary_matches_one_process_under_four_schedules() -> None:
    out = run_ranks(_run, 2, timeout_s=90)
    for name in SCHEDULES:
        spec = _spec(name, 2)
        n = spec.num_stages
        ref_losses, ref_grads = _reference(n)
        got = {k: v for r in out for k, v in r[name]["grads"].items()}
        assert sorted(got) == sorted(ref_grads)
        for k, g in got.items():
            assert rel_l2(g, ref_grads[k]) <= TOL, (name, k, rel_l2(g, ref_grads[k]))
        last = out[spec.stage_to_rank(n - 1)][name]["losses"]
        assert rel_l2(torch.tensor(last), torch.tensor(ref_losses)) <= TOL, name
        # the metadata exchange learnt which tensors carry a gradient (torch 2.13's rule)
        for rank, r in enumerate(out):
            for s, meta in r[name]["input_meta"].items():
                assert meta == (TensorMeta((BATCH // M, HIDDEN), torch.float32, True),
                                TensorMeta((BATCH // M, HIDDEN), torch.float32, False),
                                TensorMeta((BATCH // M, HIDDEN), torch.int64)), (name, s)
            # one gradient message per microbatch and boundary: hidden's, none for aux or ids
            n_boundaries_sending_b = sum(1 for s in range(1, n) if spec.stage_to_rank(s) == rank
                                         and spec.stage_to_rank(s - 1) != rank)
            assert len(r[name]["sent_b"]) == M * n_boundaries_sending_b, r[name]["sent_b"]
            assert all(e.endswith("torch.float32") for e in r[name]["sent_b"])
    assert out[0]["interleaved_overlap_b_f"]["overlapped"] > 0
    assert out[0]["zero_bubble"]["split"] > 0


# ---------------------------------------------------------------------- in-process rules
def test_stage_backward_returns_one_gradient_per_input_none_where_none() -> None:
    chunk = TupleChunk(1, 3)
    stage = PipelineStage(chunk, 1, 3)
    h, aux = torch.randn(2, HIDDEN), torch.rand(2, HIDDEN)
    ids = torch.randint(0, VOCAB, (2, HIDDEN))
    stage.input_meta = (TensorMeta.of(h), TensorMeta.of(aux, False), TensorMeta.of(ids))
    stage.output_meta = stage.input_meta
    out = stage.forward(0, (h, aux, ids))
    assert isinstance(out, tuple) and len(out) == 3 and out[2].dtype == torch.int64
    g = torch.randn(2, HIDDEN)
    grads = stage.backward(0, (g, None, None))
    assert isinstance(grads, tuple) and grads[1] is None and grads[2] is None
    # the reference: the same chunk on plain tensors
    hr = h.clone().requires_grad_(True)
    torch.autograd.backward(chunk(hr, aux, ids)[0], g)
    assert rel_l2(grads[0], hr.grad) <= TOL


def test_an_unused_float_input_gets_zeros_and_an_integer_one_cannot_carry_grad() -> None:
    class Ignores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, h: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
            return h * self.w

    stage = PipelineStage(Ignores(), 1, 2)
    stage.input_meta = (TensorMeta((3,), torch.float32), TensorMeta((3,), torch.float32))
    stage.forward(0, (torch.ones(3), torch.ones(3)), loss_fn=lambda o, t: o.sum())
    grads = stage.backward(0, None)
    assert torch.equal(grads[0], torch.ones(3)) and torch.equal(grads[1], torch.zeros(3))
    with pytest.raises(ValueError, match="only floating point and complex tensors can carry"):
        TensorMeta((3,), torch.int64, requires_grad=True)


def test_a_non_tensor_output_is_a_named_error() -> None:
    class ReturnsInt(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x * 2, 3

    stage = PipelineStage(ReturnsInt(), 0, 2)
    with pytest.raises(TypeError, match=r"stage 0 microbatch 0: output 1 is int, not a tensor"):
        stage.forward(0, (torch.ones(2),))


def test_an_output_needing_grad_where_its_meta_carries_none_raises() -> None:
    stage = PipelineStage(nn.Linear(2, 2), 0, 2)
    stage.output_meta = TensorMeta((1, 2), torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match=r"output 0 requires grad but its boundary meta "
                                         r"\[1, 2\] float32 \(no grad\) carries no gradient"):
        stage.forward(0, (torch.ones(1, 2),))
