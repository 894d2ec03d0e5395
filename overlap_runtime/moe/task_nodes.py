"""The MoE layer as task-graph nodes: predicted overlap beside the measured one.

A MoE layer is five schedulable nodes per rank (lane ``compute`` or ``comm:ep``)::

    router ──> dispatch ──> experts ──> combine_start ──┬──────────────> combine_wait ──> (add)
    compute    comm:ep      compute     comm:ep         └─> shared_expert ──┘
                                                            compute (while the combine flies)

``moe_layer_task_graph`` builds one layer's forward on every EP rank (the shared expert beside
the combine, or after it when ``overlap=False``); ``moe_overlap_pair_task_graph`` builds one
OVERLAP_B_F pairing: the forward chunk (lane ``fwd``) and the backward chunk (lane ``bwd``) of
``layers`` MoE layers each on every EP rank, their all-to-alls on ``comm:ep`` in exactly the
order the HookCoordinator launches them (backward first, then alternating), and each side's
compute after a comm region waiting until the peer has launched its next all-to-all (the
COMPUTE-hook rule). ``overlap=False`` gives the serial baseline (backward chunk, then forward).

Costs come from :class:`MoENodeCosts`, measured on a real step by :func:`node_costs_from_trace`
(the serial run's execution trace: all-to-all spans, expert and shared-expert spans, F/B action
spans). The all-to-all overlap of a simulated or measured run is ``graph.comm_overlap``'s (one
definition for both).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, Iterable

from overlap_runtime.graph import CommInfo, Task, TaskGraph
from overlap_runtime.schedules.ir import parse_compute_action
from overlap_runtime.schedules.overlap_order import BACKWARD, comm_turns

__all__ = ["MoENodeCosts", "moe_layer_task_graph", "moe_overlap_pair_task_graph",
           "node_costs_from_trace"]

COMPUTE, COMM = "compute", "comm:ep"


@dataclass(frozen=True)
class MoENodeCosts:
    """Seconds per node. Backward compute defaults to twice the forward, backward all-to-alls to
    the forward ones (same bytes). ``attn`` is the compute before each MoE layer (attention,
    router, permutation); ``tail`` the compute after a chunk's last layer."""

    attn: float = 1.0
    experts: float = 1.0
    shared_expert: float = 0.0
    tail: float = 0.0
    dispatch: float = 1.0
    combine: float = 1.0
    attn_bwd: float | None = None
    experts_bwd: float | None = None
    shared_expert_bwd: float | None = None
    tail_bwd: float | None = None
    dispatch_bwd: float | None = None
    combine_bwd: float | None = None

    def resolved(self) -> "MoENodeCosts":
        """Backward costs filled in from the defaults."""
        return replace(
            self,
            attn_bwd=2 * self.attn if self.attn_bwd is None else self.attn_bwd,
            experts_bwd=2 * self.experts if self.experts_bwd is None else self.experts_bwd,
            shared_expert_bwd=(2 * self.shared_expert if self.shared_expert_bwd is None
                               else self.shared_expert_bwd),
            tail_bwd=2 * self.tail if self.tail_bwd is None else self.tail_bwd,
            dispatch_bwd=self.dispatch if self.dispatch_bwd is None else self.dispatch_bwd,
            combine_bwd=self.combine if self.combine_bwd is None else self.combine_bwd)


def _compute(graph: TaskGraph, tid: str, rank: int, lane: str, kind: str, cost: float) -> str:
    graph.add_task(Task(tid, rank, lane, kind, cost=float(cost), label=tid.split(":", 1)[1]))
    return tid


def _comm(graph: TaskGraph, tid: str, rank: int, kind: str, cost: float) -> str:
    graph.add_task(Task(tid, rank, COMM, kind, cost=float(cost), comm=CommInfo("collective", "ep"),
                        label=tid.split(":", 1)[1]))
    return tid


def moe_layer_task_graph(ep_size: int, costs: MoENodeCosts, *, shared_expert: bool = True,
                         overlap: bool = True) -> TaskGraph:
    """One MoE layer's forward on ``ep_size`` ranks (see the module doc)."""
    if ep_size < 1:
        raise ValueError(f"moe_layer_task_graph: ep_size={ep_size} must be >= 1")
    g = TaskGraph(name=f"moe_layer_ep{ep_size}{'_overlap' if overlap else ''}")
    for r in range(ep_size):
        p = f"r{r}:"
        router = _compute(g, p + "router", r, COMPUTE, "attn", costs.attn)
        dispatch = _comm(g, p + "dispatch", r, "dispatch", costs.dispatch)
        experts = _compute(g, p + "experts", r, COMPUTE, "experts", costs.experts)
        combine = _comm(g, p + "combine_start", r, "combine", costs.combine)
        wait = _compute(g, p + "combine_wait", r, COMPUTE, "combine_wait", 0.0)
        g.add_edges([(router, dispatch), (dispatch, experts), (experts, combine),
                     (combine, wait)], "data")
        g.add_edges([(router, experts)], "program")
        if shared_expert:
            shared = _compute(g, p + "shared_expert", r, COMPUTE, "shared_expert",
                              costs.shared_expert)
            if overlap:  # launched combine, then the shared expert, then the wait
                g.add_edges([(experts, shared), (shared, wait)], "program")
            else:
                g.add_edges([(experts, wait), (wait, shared)], "program")
        else:
            g.add_edges([(experts, wait)], "program")
    return g


def _pair_order(layers: int) -> list[tuple[str, str, int]]:
    """All-to-alls of one OVERLAP_B_F pairing in launch order: ``(side, what, layer)``, in the
    coordinator's turns (``schedules.overlap_order.comm_turns``)."""
    bwd = [("bwd", w, l) for l in reversed(range(layers)) for w in ("combine", "dispatch")]
    fwd = [("fwd", w, l) for l in range(layers) for w in ("dispatch", "combine")]
    return [bwd[k] if side == BACKWARD else fwd[k] for side, k in comm_turns(len(bwd), len(fwd))]


def moe_overlap_pair_task_graph(costs: MoENodeCosts, *, layers: int = 2, ep_size: int = 2,
                                overlap: bool = True) -> TaskGraph:
    """One OVERLAP_B_F pairing of two chunks with ``layers`` MoE layers each (module doc)."""
    if layers < 1 or ep_size < 1:
        raise ValueError(f"moe_overlap_pair_task_graph: layers={layers} and ep_size={ep_size} "
                         f"must be >= 1")
    c = costs.resolved()
    g = TaskGraph(name=f"moe_pair_L{layers}_ep{ep_size}{'_overlap' if overlap else '_serial'}")
    for r in range(ep_size):
        p = f"r{r}:"
        fl, bl = ("fwd", "bwd") if overlap else (COMPUTE, COMPUTE)
        comm_ids: dict[tuple[str, str, int], str] = {}
        before: dict[tuple[str, str, int], str] = {}  # compute right before each all-to-all
        after: dict[tuple[str, str, int], str] = {}  # compute right after each all-to-all
        # forward chunk
        prev = None
        fwd_first = ""
        for layer in range(layers):
            q = f"{p}F.L{layer}."
            attn = _compute(g, q + "attn", r, fl, "attn", c.attn)
            fwd_first = fwd_first or attn
            disp = _comm(g, q + "dispatch", r, "dispatch", c.dispatch)
            exp = _compute(g, q + "experts", r, fl, "experts", c.experts)
            comb = _comm(g, q + "combine", r, "combine", c.combine)
            shared = _compute(g, q + "shared_expert", r, fl, "shared_expert", c.shared_expert)
            wait = _compute(g, q + "combine_wait", r, fl, "combine_wait", 0.0)
            g.add_edges([(attn, disp), (disp, exp), (exp, comb), (comb, wait)], "data")
            g.add_edges([(attn, exp), (exp, shared), (shared, wait)], "program")
            if prev is not None:
                g.add_edges([(prev, attn)], "program")
            comm_ids[("fwd", "dispatch", layer)], comm_ids[("fwd", "combine", layer)] = disp, comb
            before[("fwd", "dispatch", layer)], after[("fwd", "dispatch", layer)] = attn, exp
            before[("fwd", "combine", layer)], after[("fwd", "combine", layer)] = exp, wait
            prev = wait
        g.add_edges([(prev, _compute(g, f"{p}F.tail", r, fl, "tail", c.tail))], "program")
        # backward chunk (layers in reverse)
        prev = _compute(g, f"{p}B.tail", r, bl, "tail_bwd", c.tail_bwd)
        for layer in reversed(range(layers)):
            q = f"{p}B.L{layer}."
            comb = _comm(g, q + "combine", r, "combine_bwd", c.combine_bwd)
            shared = _compute(g, q + "shared_expert", r, bl, "shared_expert_bwd",
                              c.shared_expert_bwd)
            exp = _compute(g, q + "experts", r, bl, "experts_bwd", c.experts_bwd)
            disp = _comm(g, q + "dispatch", r, "dispatch_bwd", c.dispatch_bwd)
            attn = _compute(g, q + "attn", r, bl, "attn_bwd", c.attn_bwd)
            # the backward all-to-alls are synchronous in the autograd thread: nothing of this
            # side runs beside them (the shared expert's backward follows the combine's)
            g.add_edges([(prev, comb), (comb, shared), (exp, disp), (disp, attn)], "data")
            g.add_edges([(shared, exp), (exp, attn)], "program")
            comm_ids[("bwd", "combine", layer)], comm_ids[("bwd", "dispatch", layer)] = comb, disp
            before[("bwd", "combine", layer)], after[("bwd", "combine", layer)] = prev, shared
            before[("bwd", "dispatch", layer)], after[("bwd", "dispatch", layer)] = exp, attn
            prev = attn
        bwd_last = prev
        if overlap:
            order = _pair_order(layers)
            # comm token: one all-to-all at a time, in the coordinator's order
            g.add_edges([(comm_ids[a], comm_ids[b]) for a, b in zip(order, order[1:])], "program")
            # COMPUTE-hook rule: after its comm region, a side computes once the peer launched
            # its next all-to-all (i.e. finished the compute before it)
            for k, key in enumerate(order):
                nxt = next((o for o in order[k + 1:] if o[0] != key[0]), None)
                if nxt is not None and before[nxt] != after[key]:
                    g.add_edges([(before[nxt], after[key])], "data")
        else:
            g.add_edges([(bwd_last, fwd_first)], "program")
            order = ([("bwd", w, l) for l in reversed(range(layers)) for w in ("combine", "dispatch")]
                     + [("fwd", w, l) for l in range(layers) for w in ("dispatch", "combine")])
            g.add_edges([(comm_ids[a], comm_ids[b]) for a, b in zip(order, order[1:])], "program")
    return g


def node_costs_from_trace(events: Iterable[Any], layers: int) -> MoENodeCosts:
    """Mean node costs (seconds) from a serial run's trace events (see the module doc).

    All-to-all spans are named ``"<tag>.dispatch fwd"`` / ``"<tag>.combine bwd"`` ...; expert
    and shared-expert spans ``"<tag>.experts"`` / ``"<tag>.shared_expert"``; the rest of each F
    (B) action span, less its receive waits (``comm`` spans), is split evenly over the chunk's
    ``layers`` attention regions and its tail. Backward expert compute is taken as twice the
    forward (not measured separately).
    """
    evs = list(events)

    def mean(sel: list[Any]) -> float:
        return statistics.fmean([(e.end_ns - e.start_ns) / 1e9 for e in sel]) if sel else 0.0

    def named(cat: str, suffix: str) -> list[Any]:
        return [e for e in evs if e.cat == cat and e.name.endswith(suffix)]

    a2a = {k: mean(named("a2a", f".{k.replace('_', ' ')}")) for k in
           ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd")}
    experts = mean(named("moe_compute", ".experts"))
    shared = mean(named("moe_compute", ".shared_expert"))

    def rest(kind: str, direction: str) -> float:
        spans = [e for e in evs if e.cat == "compute" and _action_kind(e.name) == kind]
        if not spans:
            return 0.0
        per = []
        for s in spans:
            inner = [e for e in evs if e.rank == s.rank and e.thread == s.thread
                     and ((e.cat == "a2a" and e.name.endswith(direction)) or e.cat == "comm")
                     and s.start_ns <= e.start_ns and e.end_ns <= s.end_ns]
            per.append((s.end_ns - s.start_ns - sum(e.end_ns - e.start_ns for e in inner)) / 1e9)
        return statistics.fmean(per)

    f_rest = max(0.0, rest("F", "fwd") - layers * experts)
    b_rest = max(0.0, rest("B", "bwd") - layers * 2 * (experts + shared))
    return MoENodeCosts(
        attn=f_rest / (layers + 1), experts=experts, shared_expert=shared,
        tail=f_rest / (layers + 1), dispatch=a2a["dispatch_fwd"],
        combine=max(0.0, a2a["combine_fwd"] - shared),
        attn_bwd=b_rest / (layers + 1), tail_bwd=b_rest / (layers + 1),
        experts_bwd=2 * experts, shared_expert_bwd=2 * shared,
        dispatch_bwd=a2a["dispatch_bwd"], combine_bwd=a2a["combine_bwd"])


def _action_kind(name: str) -> str | None:
    """``"2F5"`` -> ``"F"``; None for anything else."""
    parsed = parse_compute_action(name)
    return None if parsed is None else parsed[1]
