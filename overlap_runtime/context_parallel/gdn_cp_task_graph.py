"""The p2p GDN state chain, forward and backward, as a :class:`~overlap_runtime.graph.TaskGraph`.

One node per step of ``gdn_cp_p2p.GDNStateChain`` on every rank, so the validator proves the
chain cannot deadlock and the simulator predicts CP16/32/64 timelines from measured node costs
(``benchmarks/gdn_cp_predict.py``).

Nodes of rank ``r`` of ``P`` (lane ``compute`` or ``comm:cp``; kind = cost-model key)::

    forward                                       backward
    F.prepare    gdn_prepare      compute         B.output    gdn_output_bwd   compute
    F.summary    gdn_summary      compute  r<P-1  B.recv_dH   recv             comm    r<P-1
    F.recv_H     recv             comm     r>0    B.apply     gdn_apply_bwd    compute 0<r<P-1
    F.apply      gdn_apply        compute 0<r<P-1 B.send_dH   send             comm    r>0
    F.send_H     send             comm     r<P-1  B.summary   gdn_summary_bwd  compute r<P-1
    F.output     gdn_output       compute

``F.recv_H`` is posted at the start (no program predecessor), as the implementation posts its
``irecv`` before ``prepare``; ``B.recv_dH`` is posted when the backward starts. ``B.output``
waits for ``F.send_H`` (the forward waits its send after the local output, before returning).

With every compute node costing ``c`` and every state message ``l``, the makespan is
``(2P + 1) c + 2 (P - 1) l`` for ``P >= 2``: forward ``prepare + summary``, ``P - 2`` applies,
``P - 1`` messages and the last rank's output; backward its local backward, ``P - 2`` applies,
``P - 1`` messages and rank 0's summary backward (tested).
"""

from __future__ import annotations

from typing import Mapping

from overlap_runtime.graph import CommInfo, CostModel, SimulationResult, Task, TaskGraph

__all__ = ["GDN_P2P_NODE_KINDS", "gdn_p2p_task_graph", "gdn_p2p_cost_model", "simulate_gdn_p2p"]

GDN_P2P_NODE_KINDS: tuple[str, ...] = (
    "gdn_prepare", "gdn_summary", "gdn_apply", "gdn_output",
    "gdn_output_bwd", "gdn_apply_bwd", "gdn_summary_bwd",
)

COMPUTE, COMM = "compute", "comm:cp"


def gdn_p2p_task_graph(cp_size: int, state_bytes: float | None = None) -> TaskGraph:
    """Forward + backward p2p chain for ``cp_size`` ranks (see the module docstring).

    Args:
        cp_size: P >= 1.
        state_bytes: size of one state message (``B * HV * K * V * 4`` for fp32), or None for
            the cost model's ``message_bytes``.

    Returns:
        The graph; node costs come from :func:`gdn_p2p_cost_model` (by kind).
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive int")
    p = cp_size
    graph = TaskGraph(name=f"gdn_p2p_cp{p}")
    data: list[tuple[str, str]] = []
    program: list[tuple[str, str]] = []
    match: list[tuple[str, str]] = []

    def node(rank: int, name: str, kind: str, step: int, comm: CommInfo | None = None) -> str:
        tid = f"{rank}{name}"
        graph.add_task(Task(tid, rank, COMM if comm else COMPUTE, kind, comm=comm, step=step,
                            label=f"{rank}{name}"))
        return tid

    for r in range(p):
        first, last = r == 0, r == p - 1
        prep = node(r, "F.prepare", "gdn_prepare", 0)
        fwd_tail = prep
        if not last:
            summ = node(r, "F.summary", "gdn_summary", 1)
            program.append((prep, summ))
            fwd_tail = summ
        recv_h = None
        if not first:
            recv_h = node(r, "F.recv_H", "recv", 0, CommInfo("recv", ("H", r), r - 1))
        send_h = None
        if not last:
            h_out = summ
            if not first:
                apply = node(r, "F.apply", "gdn_apply", 2)
                data += [(summ, apply), (recv_h, apply)]
                h_out = fwd_tail = apply
            send_h = node(r, "F.send_H", "send", 3,
                          CommInfo("send", ("H", r + 1), r + 1, state_bytes))
            data.append((h_out, send_h))
            match.append((send_h, f"{r + 1}F.recv_H"))
        out = node(r, "F.output", "gdn_output", 4)
        program.append((fwd_tail, out))
        if recv_h is not None:
            data.append((recv_h, out))

        out_b = node(r, "B.output", "gdn_output_bwd", 5)
        program.append((out, out_b))
        if send_h is not None:
            program.append((send_h, out_b))  # the forward waits its send before returning
        bwd_tail = out_b
        recv_dh = None
        if not last:
            recv_dh = node(r, "B.recv_dH", "recv", 5, CommInfo("recv", ("dH", r), r + 1))
            program.append((out, recv_dh))
        if not first:
            dh_in = out_b
            if not last:
                apply_b = node(r, "B.apply", "gdn_apply_bwd", 6)
                data += [(out_b, apply_b), (recv_dh, apply_b)]
                dh_in = bwd_tail = apply_b
            send_dh = node(r, "B.send_dH", "send", 7,
                           CommInfo("send", ("dH", r - 1), r - 1, state_bytes))
            data.append((dh_in, send_dh))
            match.append((send_dh, f"{r - 1}B.recv_dH"))
        if not last:
            summ_b = node(r, "B.summary", "gdn_summary_bwd", 8)
            data.append((recv_dh, summ_b))
            program.append((bwd_tail, summ_b))
    graph.add_edges(data, "data")
    graph.add_edges(program, "program")
    graph.add_edges(match, "match")
    return graph


def gdn_p2p_cost_model(
    costs: Mapping[str, float],
    comm_latency: float = 0.0,
    comm_bandwidth: float = float("inf"),
    message_bytes: float = 0.0,
) -> CostModel:
    """A :class:`CostModel` with a cost for every kind in :data:`GDN_P2P_NODE_KINDS`.

    Raises ValueError naming the missing kinds.
    """
    missing = [k for k in GDN_P2P_NODE_KINDS if k not in costs]
    if missing:
        raise ValueError(f"gdn_p2p_cost_model: no cost for node kinds {missing}")
    return CostModel(kinds=dict(costs), comm_latency=comm_latency,
                     comm_bandwidth=comm_bandwidth, message_bytes=message_bytes)


def simulate_gdn_p2p(cp_size: int, costs: CostModel,
                     state_bytes: float | None = None) -> SimulationResult:
    """Validate and simulate the chain for ``cp_size`` ranks under ``costs``."""
    graph = gdn_p2p_task_graph(cp_size, state_bytes)
    matching = graph.validate()
    from overlap_runtime.graph import simulate

    return simulate(graph, costs, matching=matching)
