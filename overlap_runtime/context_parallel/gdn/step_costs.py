"""Costs of the p2p GDN state chain's ops, for pricing a compiled step of a GDN layer.

The chain itself is the compiled step's (``stepgraph.compile_step`` of a config whose GDN
layers run ``linear_attention_cp_mode: p2p``; the conformance checker holds it to what the
runtime issues). :func:`chain_op_seconds` turns measured node costs into the cost model of a
pricing pass (``stepgraph.pricing.predict_priced``): seconds of one op task.

Two sets of node costs (all keys of one set, seconds or any one unit):

eager chain (``GDNStateChain``)           Triton chain (``TritonStateChain``)
  gdn_prepare, gdn_summary, gdn_apply,      layer_fwd, gdn_fwd_pre, gdn_fwd_chain, gdn_fwd_post,
  gdn_output, gdn_output_bwd,               gdn_bwd_pre, gdn_bwd_chain, gdn_bwd_post, layer_bwd
  gdn_apply_bwd, gdn_summary_bwd

How the compiled ops are priced on CP rank ``r`` of ``P`` (``r = rank % P``: the trainer's
rank order puts CP innermost)::

    op                    eager                          Triton
    gdn.prepare_summary   prepare (+ summary if r<P-1)   fwd_pre (+ fwd_chain if r=0)
    gdn.chain.send_H      message + apply at the         message + fwd_chain at the receiver
                          receiver (if it is not P-1)
    gdn.output            output                         fwd_post
    gdn.output.bwd        output_bwd                     bwd_pre (+ bwd_chain if r=P-1)
    gdn.chain.send_dH     message + apply_bwd at the     message + bwd_chain at the receiver
                          receiver (if it is not 0)
    gdn.summary.bwd       summary_bwd if r<P-1           bwd_post
    gdn.proj / norm1.bwd  0                              layer_fwd / layer_bwd (the layer
                                                         outside the GDN core, folded in)
    P = 1: gdn.core       prepare + output               fwd_pre + fwd_chain + fwd_post
           gdn.bwd        output_bwd                     bwd_pre + bwd_chain + bwd_post

A hop's state work is priced on the message that brings the state (the receiver's apply or
segment maps run as soon as it lands, and the next send waits for them). The halo messages
cost ``halo_s`` (default 0: they leave every rank at the same time), receives and every other
op 0 (the eager costs cover the GDN core only). An op of another GDN mode (all-gather, prefix
scan, Ulysses) raises ValueError: these costs are the p2p chain's.
"""

from __future__ import annotations

from typing import Callable, Mapping

from overlap_runtime.graph.tasks import Task

#: Node costs of the eager chain.
GDN_P2P_NODE_KINDS: tuple[str, ...] = (
    "gdn_prepare", "gdn_summary", "gdn_apply", "gdn_output",
    "gdn_output_bwd", "gdn_apply_bwd", "gdn_summary_bwd",
)

#: Node costs of the Triton chain (the op's own segment summaries continue across ranks).
GDN_P2P_FUSED_NODE_KINDS: tuple[str, ...] = (
    "layer_fwd", "gdn_fwd_pre", "gdn_fwd_chain", "gdn_fwd_post",
    "gdn_bwd_pre", "gdn_bwd_chain", "gdn_bwd_post", "layer_bwd",
)

_OTHER_MODES = ("gdn.a2a_", "gdn.gather_summary", "gdn.scan", "gdn.summary")


def chain_op_seconds(costs: Mapping[str, float], cp_size: int, *, message_s: float = 0.0,
                     halo_s: float = 0.0) -> Callable[[Task], float]:
    """The cost model of a compiled step's p2p chain ops (module doc).

    Args:
        costs: every key of :data:`GDN_P2P_NODE_KINDS` (eager) or of
            :data:`GDN_P2P_FUSED_NODE_KINDS` (Triton; any fused key selects this set).
        cp_size: ``P``, the CP group's size (>= 1).
        message_s: one state message (latency + bytes / bandwidth).
        halo_s: one halo message.

    Raises ValueError naming the missing keys, or a non-positive ``cp_size``.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be a positive int")
    fused = any(k in costs for k in GDN_P2P_FUSED_NODE_KINDS)
    kinds = GDN_P2P_FUSED_NODE_KINDS if fused else GDN_P2P_NODE_KINDS
    missing = [k for k in kinds if k not in costs]
    if missing:
        raise ValueError(f"chain_op_seconds: no cost for node kinds {missing}")
    c = {k: float(costs[k]) for k in kinds}
    last = cp_size - 1

    def eager(name: str, r: int) -> float:
        table = {
            "gdn.prepare_summary": c["gdn_prepare"] + (c["gdn_summary"] if r < last else 0.0),
            "gdn.chain.send_H": message_s + (c["gdn_apply"] if r + 1 < last else 0.0),
            "gdn.output": c["gdn_output"],
            "gdn.output.bwd": c["gdn_output_bwd"],
            "gdn.chain.send_dH": message_s + (c["gdn_apply_bwd"] if r - 1 > 0 else 0.0),
            "gdn.summary.bwd": c["gdn_summary_bwd"] if r < last else 0.0,
            "gdn.core": c["gdn_prepare"] + c["gdn_output"],
            "gdn.bwd": c["gdn_output_bwd"],
        }
        return table.get(name, 0.0)

    def triton(name: str, r: int) -> float:
        table = {
            "gdn.proj": c["layer_fwd"],
            "gdn.prepare_summary": c["gdn_fwd_pre"] + (c["gdn_fwd_chain"] if r == 0 else 0.0),
            "gdn.chain.send_H": message_s + c["gdn_fwd_chain"],
            "gdn.output": c["gdn_fwd_post"],
            "gdn.output.bwd": c["gdn_bwd_pre"] + (c["gdn_bwd_chain"] if r == last else 0.0),
            "gdn.chain.send_dH": message_s + c["gdn_bwd_chain"],
            "gdn.summary.bwd": c["gdn_bwd_post"],
            "norm1.bwd": c["layer_bwd"],
            "gdn.core": c["gdn_fwd_pre"] + c["gdn_fwd_chain"] + c["gdn_fwd_post"],
            "gdn.bwd": c["gdn_bwd_pre"] + c["gdn_bwd_chain"] + c["gdn_bwd_post"],
        }
        return table.get(name, 0.0)

    price = triton if fused else eager

    def seconds(task: Task) -> float:
        op = task.meta.get("op")
        if op is None:  # a pipeline message: none in a one-stage step
            return 0.0
        name = op.name.removeprefix("recompute.")
        if name.startswith(_OTHER_MODES) and name != "gdn.summary.bwd":
            raise ValueError(f"chain_op_seconds: op {op.name!r} ({task.label}) is not of the "
                             f"p2p chain; these costs price linear_attention_cp_mode p2p")
        if op.kind == "recv":
            return 0.0
        if op.name.startswith("gdn.halo."):
            return halo_s if op.kind == "send" else 0.0
        return price(name, task.rank % cp_size)

    return seconds
