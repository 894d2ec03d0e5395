"""The p2p GDN state chain, forward and backward, as a :class:`~overlap_runtime.graph.TaskGraph`.

Two graphs: :func:`gdn_p2p_task_graph` for the eager chain (``GDNStateChain``, below) and
:func:`gdn_p2p_fused_task_graph` for the Triton chain (``TritonStateChain``: the op's own
segment summaries continue across ranks; its docstring has the nodes).

One node per step of ``p2p.GDNStateChain`` on every rank, so the validator proves the
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

__all__ = ["GDN_P2P_NODE_KINDS", "GDN_P2P_FUSED_NODE_KINDS", "gdn_p2p_task_graph",
           "gdn_p2p_fused_task_graph", "gdn_p2p_cost_model", "simulate_gdn_p2p"]

GDN_P2P_NODE_KINDS: tuple[str, ...] = (
    "gdn_prepare", "gdn_summary", "gdn_apply", "gdn_output",
    "gdn_output_bwd", "gdn_apply_bwd", "gdn_summary_bwd",
)

#: Node kinds of the Triton chain (:func:`gdn_p2p_fused_task_graph`).
GDN_P2P_FUSED_NODE_KINDS: tuple[str, ...] = (
    "layer_fwd", "gdn_fwd_pre", "gdn_fwd_chain", "gdn_fwd_post",
    "gdn_bwd_pre", "gdn_bwd_chain", "gdn_bwd_post", "layer_bwd",
)

COMPUTE, COMM = "compute", "comm:cp"


class _Builder:
    """Tasks and edges of one chain graph (both builders below share it)."""

    def __init__(self, name: str, cp_size: int) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size={cp_size!r} must be a positive int")
        self.graph = TaskGraph(name=name)
        self.data: list[tuple[str, str]] = []
        self.program: list[tuple[str, str]] = []
        self.match: list[tuple[str, str]] = []

    def node(self, rank: int, name: str, kind: str, step: int,
             comm: CommInfo | None = None) -> str:
        tid = f"{rank}{name}"
        self.graph.add_task(Task(tid, rank, COMM if comm else COMPUTE, kind, comm=comm,
                                 step=step, label=tid))
        return tid

    def finish(self) -> TaskGraph:
        self.graph.add_edges(self.data, "data")
        self.graph.add_edges(self.program, "program")
        self.graph.add_edges(self.match, "match")
        return self.graph


def gdn_p2p_task_graph(cp_size: int, state_bytes: float | None = None) -> TaskGraph:
    """Forward + backward p2p chain for ``cp_size`` ranks (see the module docstring).

    Args:
        cp_size: P >= 1.
        state_bytes: size of one state message (``B * HV * K * V * 4`` for fp32), or None for
            the cost model's ``message_bytes``.

    Returns:
        The graph; node costs come from :func:`gdn_p2p_cost_model` (by kind).
    """
    b = _Builder(f"gdn_p2p_cp{cp_size}", cp_size)
    p, node, data, program, match = cp_size, b.node, b.data, b.program, b.match

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
    return b.finish()


def gdn_p2p_fused_task_graph(cp_size: int, state_bytes: float | None = None) -> TaskGraph:
    """The chain of ``backend="triton"`` (``p2p.TritonStateChain``), forward + backward,
    for ``cp_size`` ranks, with the layer around the GDN core.

    Nodes of rank ``r`` of ``P`` (kind in :data:`GDN_P2P_FUSED_NODE_KINDS`, or send/recv)::

        L.fwd      layer_fwd       projections, conv, gates (and, folded in, the rest of the
                                   layer's forward: norm, out_proj)
        F.pre      gdn_fwd_pre     prepare + segment summaries            (no state needed)
        F.recv_H   recv            r > 0, posted at the start
        F.chain    gdn_fwd_chain   the NS segment maps from H_in -> H_out, segment states
        F.send_H   send            r < P-1
        F.post     gdn_fwd_post    per-segment scans + outputs
        B.pre      gdn_bwd_pre     dv_local + segment-local reverse scans   (no dH needed)
        B.recv_dH  recv            r < P-1, posted when the backward starts
        B.chain    gdn_bwd_chain   the reverse chain from dH_out -> dH_in
        B.send_dH  send            r > 0
        B.post     gdn_bwd_post    per-chunk reverse scan + every input-gradient kernel
        L.bwd      layer_bwd       the layer's backward outside the GDN core

    Every rank runs both chains (rank 0 chains from zero, the last rank needs the segment
    states), so with costs ``c_kind`` and a message cost ``l`` the makespan is
    ``T_1 + (P - 1) (c_fwd_chain + c_bwd_chain + 2 l)``, ``T_1`` being the sum of all eight
    costs (one device on the local length, same segments); tested. The conv halo messages
    (three positions) are left out: they leave every rank at the same time.
    """
    b = _Builder(f"gdn_p2p_fused_cp{cp_size}", cp_size)
    p, node, data, program, match = cp_size, b.node, b.data, b.program, b.match

    for r in range(p):
        first, last = r == 0, r == p - 1
        lf = node(r, "L.fwd", "layer_fwd", 0)
        pre = node(r, "F.pre", "gdn_fwd_pre", 1)
        chain = node(r, "F.chain", "gdn_fwd_chain", 2)
        post = node(r, "F.post", "gdn_fwd_post", 3)
        program += [(lf, pre), (pre, chain), (chain, post)]
        send_h = None
        if not first:
            recv_h = node(r, "F.recv_H", "recv", 0, CommInfo("recv", ("H", r), r - 1))
            data.append((recv_h, chain))
        if not last:
            send_h = node(r, "F.send_H", "send", 3, CommInfo("send", ("H", r + 1), r + 1,
                                                             state_bytes))
            data.append((chain, send_h))
            match.append((send_h, f"{r + 1}F.recv_H"))
        bpre = node(r, "B.pre", "gdn_bwd_pre", 4)
        bchain = node(r, "B.chain", "gdn_bwd_chain", 5)
        bpost = node(r, "B.post", "gdn_bwd_post", 6)
        lb = node(r, "L.bwd", "layer_bwd", 7)
        program += [(post, bpre), (bpre, bchain), (bchain, bpost), (bpost, lb)]
        if send_h is not None:
            program.append((send_h, bpre))  # the forward waits its send before returning
        if not last:
            recv_dh = node(r, "B.recv_dH", "recv", 4, CommInfo("recv", ("dH", r), r + 1))
            program.append((post, recv_dh))
            data.append((recv_dh, bchain))
        if not first:
            send_dh = node(r, "B.send_dH", "send", 6, CommInfo("send", ("dH", r - 1), r - 1,
                                                               state_bytes))
            data.append((bchain, send_dh))
            match.append((send_dh, f"{r - 1}B.recv_dH"))
    return b.finish()


def gdn_p2p_cost_model(
    costs: Mapping[str, float],
    comm_latency: float = 0.0,
    comm_bandwidth: float = float("inf"),
    message_bytes: float = 0.0,
) -> CostModel:
    """A :class:`CostModel` with a cost for every kind in :data:`GDN_P2P_NODE_KINDS` (the
    eager chain) or every kind in :data:`GDN_P2P_FUSED_NODE_KINDS` (the Triton chain).

    Raises ValueError naming the missing kinds.
    """
    fused = any(k in costs for k in GDN_P2P_FUSED_NODE_KINDS)
    kinds = GDN_P2P_FUSED_NODE_KINDS if fused else GDN_P2P_NODE_KINDS
    missing = [k for k in kinds if k not in costs]
    if missing:
        raise ValueError(f"gdn_p2p_cost_model: no cost for node kinds {missing}")
    return CostModel(kinds=dict(costs), comm_latency=comm_latency,
                     comm_bandwidth=comm_bandwidth, message_bytes=message_bytes)


def simulate_gdn_p2p(cp_size: int, costs: CostModel, state_bytes: float | None = None,
                     fused: bool = False) -> SimulationResult:
    """Validate and simulate the chain for ``cp_size`` ranks under ``costs`` (``fused``: the
    Triton chain of :func:`gdn_p2p_fused_task_graph`)."""
    build = gdn_p2p_fused_task_graph if fused else gdn_p2p_task_graph
    graph = build(cp_size, state_bytes)
    matching = graph.validate()
    from overlap_runtime.graph import simulate

    return simulate(graph, costs, matching=matching)
