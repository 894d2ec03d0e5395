"""What one decoder layer really does, op by op: the layer program of a :class:`TrainConfig`.

``layer_program(config, layer, direction, shape, cp_rank=r)`` lists, in the order the runtime
issues them on CP rank ``r``, the communication and compute ops of decoder layer ``layer`` in
one direction: ``F`` (forward), ``B`` (full backward), ``I`` (input gradient: every message of
the backward) or ``W`` (weight gradient: compute only). Each op is a :class:`LayerOp`: its group
(``cp`` / ``ep``), its kind (``compute``, ``send``, ``recv``, ``collective``), the peer of a
send/receive as an offset inside the group (``+1`` the next CP rank), the bytes this rank puts
on the wire and the FLOPs of a compute op, as functions of the microbatch shape
(:class:`MicrobatchShape`). Pure Python: no torch, no process group; the step graph
(``stepgraph.compose``) and the simulator build on it.

Each layer's mode is its own (``config.cp.layer_cp_modes``: the per-layer lists, or the
scalar modes). Read from the code (``context_parallel/*``, ``moe/dispatcher.py``; the conformance checker of
``stepgraph.conformance`` compares a recorded run with it, so a drift fails the tests):

=================  =========================================================================
GDN, cp > 1        forward: ``agree`` (all-gather of 9 int64: the ranks compare their call)
                   ulysses    a2a seq->heads (conv channels + a + b of each rank's heads), GDN
                              core on the whole sequence, a2a heads->seq (outputs)
                   p2p        halo: recv from r-1 (r > 0), send to r+1 (r < P-1); chain: recv
                              H_in (r > 0), prepare + summary, send H_out (r < P-1), output
                   all_gather halo as p2p, summary, all-gather of (M, S) fp32, core
                   prefix_scan halo as p2p; the scan's receives of every round (from r - 2^d),
                              prepare + summary, its sends round by round (to r + 2^d; an
                              (M, S) pair, or a state once the window reaches rank 0), output
                   backward (I): the mirror; p2p: recv dH_out (r < P-1), local backward, send
                   dH_in (r > 0), summary backward, then the halo gradient: send to r-1, recv
                   from r+1; all_gather: the gather's backward is an all-to-all; prefix_scan:
                   the reversed scan's receives (from r + 2^d), local backward, its sends (to
                   r - 2^d), summary backward, then the halo gradient
attention, cp > 1  forward: ``agree`` (all-gather of 10 int64)
                   ulysses    a2a q/k/v seq->heads, local attention, a2a outputs heads->seq
                   ring       P-1 ring hops of K/V (send to r+1, recv from r-1)
                   all_gather_kv  all-gather of K/V
                   hierarchical  ``agree`` and a2a q/k/v on ``cp_a2a`` (A ranks), ``agree``
                              and R-1 ring hops on ``cp_ring`` (R ranks), a2a outputs
                   backward: ulysses the two a2a reversed; ring one K/V hop, then per step
                   (K/V hop while one is left) and a dK/dV hop (fp32); all_gather_kv an a2a;
                   hierarchical the output a2a reversed, the ring's backward over R, the
                   q/k/v a2a reversed
MoE, ep > 1        router, a2a ``{tag}.dispatch_counts`` (E int64), a2a ``{tag}.dispatch``,
                   experts, a2a ``{tag}.combine`` launched, shared expert while it flies,
                   combine wait; backward: ``{tag}.combine`` reversed, experts, shared expert,
                   ``{tag}.dispatch`` reversed (the counts a2a has no backward)
=================  =========================================================================

With ``train.activation_checkpoint`` the backward first replays the forward's messages (the
recompute issues the same collectives). FSDP's collectives are not layer ops (see
``stepgraph.compose``). MoE message sizes depend on the routing unless every token goes to
every expert: such ops have ``exact=False`` and the group's total is what is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Literal

from overlap_runtime.config.cp import layer_cp_modes
from overlap_runtime.config.cp_modes import (GDN_ALL_GATHER, GDN_P2P, GDN_PREFIX_SCAN, GDN_ULYSSES,
                                             get_cp_mode)

if TYPE_CHECKING:
    from overlap_runtime.config.train import TrainConfig

Direction = Literal["F", "B", "I", "W"]
OpKind = Literal["compute", "send", "recv", "collective"]
GroupName = Literal["cp", "ep", "pp", "fsdp", "cp_a2a", "cp_ring", "host"]
_INT64 = 8
_FP32 = 4
AGREE_GDN_FIELDS = 9  # context_parallel/gdn/common.check_ranks_agree_on_call
AGREE_ATTENTION_FIELDS = 10  # context_parallel/peers.check_attention_call


@dataclass(frozen=True)
class MicrobatchShape:
    """One microbatch on one rank: ``rows`` sequences of ``seq_len`` global tokens, split over
    ``cp`` ranks (``local_len`` each), activations of ``dtype_bytes`` bytes per element."""

    rows: int
    seq_len: int
    cp: int = 1
    dtype_bytes: int = 4

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp

    @property
    def tokens(self) -> int:
        """Tokens of this rank's shard: ``rows * local_len``."""
        return self.rows * self.local_len


@dataclass(frozen=True)
class LayerOp:
    """One op of a layer program.

    ``name``: unique within its program (``gdn.chain.send_H``). ``kind``: ``compute``,
    ``send``, ``recv`` or ``collective``. ``group``: the communication group (``cp``, ``ep``).
    ``peer``: for send/recv the peer's offset inside the group (``+1``: next rank). ``nbytes``:
    bytes this rank sends (a collective: its input; a receive: what arrives). ``flops``: of a
    compute op. ``collective``: ``all_to_all`` or ``all_gather``. ``label``: the name the
    runtime gives the message where it has one (the MoE dispatcher's ``S0.L1.dispatch``).
    ``exact``: False when ``nbytes`` depends on the routing (then it is the mean per rank).
    On a message op, ``flops`` is the GDN state work tied to it (fp32, the ``state`` class of
    ``stepgraph.costs``): a chain receive's apply per hop, a scan receive's compose per round,
    the summary all-gather's prefix compose of the far end (``stepgraph.scale.priced_ops``).

    ``join``: a non-blocking message that the next op of that name waits for (the forward MoE
    combine joins ``moe.combine_wait``: the shared expert runs while it flies).

    Priced (the same type, filled in by a pricing pass such as ``stepgraph.scale.priced_ops``
    or ``stepgraph.predict.measured_ops``; None / defaults on the layer program's ops):
    ``cost`` (seconds), ``task_kind`` (the cost-model key the op's task carries; default its
    name), ``group_size`` (the ranks of its group: a representative expansion builds one
    rank per pipeline coordinate, whose collective then stands for ``group_size`` identical
    ones) and ``program_only`` (a leading op only the program order waits for: the task's
    inputs go to the op after it). ``stepgraph.expand`` expands priced and unpriced ops alike.
    """

    name: str
    kind: OpKind
    group: GroupName | None = None
    peer: int | None = None
    nbytes: int = 0
    flops: float = 0.0
    collective: str | None = None
    label: str | None = None
    exact: bool = True
    cost: float | None = None
    task_kind: str | None = None
    group_size: int = 1
    join: str | None = None
    program_only: bool = False

    @property
    def is_comm(self) -> bool:
        return self.kind != "compute"


def microbatch_shape(config: "TrainConfig") -> MicrobatchShape:
    """The microbatch of ``config`` on one rank: ``batch_size / microbatches`` rows with a
    pipeline (pp > 1), the whole ``batch_size`` without; fp32 or bf16 elements."""
    acc, pl = config.train.accelerator, config.train.pipeline
    rows = config.data.batch_size // pl.microbatches if acc.pp > 1 else config.data.batch_size
    return MicrobatchShape(rows, config.data.seq_len, acc.cp,
                           2 if config.train.precision == "bf16" else 4)


def _c(name: str, flops: float) -> LayerOp:
    return LayerOp(name, "compute", flops=float(flops))


def _coll(name: str, group: GroupName, what: str, nbytes: int, label: str | None = None,
          exact: bool = True) -> LayerOp:
    return LayerOp(name, "collective", group, None, int(nbytes), 0.0, what, label, exact)


def _p2p(name: str, kind: OpKind, peer: int, nbytes: int, group: GroupName = "cp") -> LayerOp:
    return LayerOp(name, kind, group, peer, int(nbytes))


def _layer_mode(config: "TrainConfig", layer: int) -> str:
    """The CP mode of decoder layer ``layer`` (its kind's per-layer list entry, or the scalar
    mode: ``config.cp.layer_cp_modes``)."""
    return layer_cp_modes(config.train.accelerator, config.model.layer_types)[layer]


# ----------------------------------------------------------------------------- mixers


def _gdn_forward(config: "TrainConfig", s: MicrobatchShape, r: int, mode: str) -> list[LayerOp]:
    m, acc = config.model, config.train.accelerator
    p, t, e = s.cp, s.tokens, s.dtype_bytes
    h, hv, k, v = (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim,
                   m.linear_value_head_dim)
    conv_dim = 2 * h * k + hv * v
    proj = 2 * t * m.hidden_size * (conv_dim + 2 * hv + hv * v) + 2 * t * hv * v * m.hidden_size
    core = 6 * t * hv * k * v + 2 * t * hv * m.gdn_chunk_size * (k + v)
    if p == 1:
        return [_c("gdn.proj", proj), _c("gdn.core", core)]
    program = get_cp_mode("linear_attention", mode).program
    if program is not None:  # a registered mode's own plan
        return list(program(config, s, r, None))
    ops = [_coll("gdn.agree", "cp", "all_gather", AGREE_GDN_FIELDS * _INT64), _c("gdn.proj", proj)]
    state = s.rows * hv * k * v * _FP32
    halo = s.rows * (m.linear_conv_kernel_dim - 1) * conv_dim * e
    if mode == GDN_ULYSSES.name:
        h_l = h // p if h % p == 0 else 1
        hv_l = hv // p
        width = 2 * h_l * k + hv_l * v + 2 * hv_l
        return ops + [_coll("gdn.a2a_in", "cp", "all_to_all", p * t * width * e),
                      _c("gdn.core", core),
                      _coll("gdn.a2a_out", "cp", "all_to_all", p * t * hv_l * v * e)]
    if r > 0:
        ops.append(_p2p("gdn.halo.recv", "recv", -1, halo))
    if r < p - 1:
        ops.append(_p2p("gdn.halo.send", "send", +1, halo))
    if mode == GDN_P2P.name:
        if r > 0:
            ops.append(replace(_p2p("gdn.chain.recv_H", "recv", -1, state),
                               flops=_chain_hop_flops(s, m)))
        ops.append(_c("gdn.prepare_summary", core / 2))
        if r < p - 1:
            ops.append(_p2p("gdn.chain.send_H", "send", +1, state))
        return ops + [_c("gdn.output", core / 2)]
    if mode == GDN_ALL_GATHER.name:
        summary = s.rows * hv * k * (k + v) * _FP32
        gather = replace(_coll("gdn.gather_summary", "cp", "all_gather", summary),
                         flops=max(p - 2, 0) * _compose_flops(s, m))  # the far end's prefix
        return ops + [_c("gdn.summary", core / 2), gather,
                      _c("gdn.core", core)]
    if mode == GDN_PREFIX_SCAN.name:
        pair = s.rows * hv * k * (k + v) * _FP32
        recvs, sends = _scan_messages(p, r, reverse=False, state=state, pair=pair, tag="",
                                      compose=_compose_flops(s, m))
        return (ops + recvs + [_c("gdn.prepare_summary", core / 2)] + sends
                + [_c("gdn.output", core / 2)])
    raise ValueError(f"train.accelerator.linear_attention_cp_mode={mode!r}: a registered mode "
                     f"without a program (config.cp_modes.CPMode.program) that layer_program "
                     f"does not know")


def _chain_hop_flops(s: MicrobatchShape, m: object) -> float:
    """FLOPs of one state-chain hop on its receiver, as the Triton chain measured them (four
    ``[K, K] x [K, V]`` fp32 products per value head; docs/benchmarks.md, 0.021 ms)."""
    return 4 * 2.0 * s.rows * m.linear_num_value_heads * m.linear_key_head_dim ** 2 \
        * m.linear_value_head_dim  # type: ignore[attr-defined]


def _compose_flops(s: MicrobatchShape, m: object) -> float:
    """FLOPs of one summary compose ``(M1 M0, M1 S0 + S1)``: ``[K, K] x [K, K + V]`` per value
    head (``ops.gdn.compose``)."""
    k = m.linear_key_head_dim  # type: ignore[attr-defined]
    return 2.0 * s.rows * m.linear_num_value_heads * k * k * (k + m.linear_value_head_dim)  # type: ignore[attr-defined]


def _scan_messages(p: int, r: int, *, reverse: bool, state: int, pair: int, tag: str,
                   compose: float = 0.0) -> tuple[list[LayerOp], list[LayerOp]]:
    """The receives and sends of the prefix scan on CP rank ``r`` (``gdn/scan_rounds.py``):
    position ``r`` (``P - 1 - r`` when ``reverse``); round ``d`` receives from position
    ``pos - 2^d`` and sends to ``pos + 2^d``; a message is a state when its sender's window
    reaches position 0 (sender position ``< 2^d``), else an ``(M, S)`` pair. All receives are
    posted first, the sends follow round by round. A receive carries the ``compose`` FLOPs
    its round costs the receiver (``flops`` of a message op: the state work it waits for)."""
    pos = p - 1 - r if reverse else r
    sign = -1 if reverse else 1
    recvs: list[LayerOp] = []
    sends: list[LayerOp] = []
    d = 0
    while (1 << d) < p:
        step = 1 << d
        if pos - step >= 0:
            recvs.append(replace(_p2p(f"gdn.scan{tag}{d}.recv", "recv", -sign * step,
                                      pair if pos - step >= step else state), flops=compose))
        if pos + step < p:
            sends.append(_p2p(f"gdn.scan{tag}{d}.send", "send", sign * step,
                              pair if pos >= step else state))
        d += 1
    return recvs, sends


def _gdn_backward(config: "TrainConfig", s: MicrobatchShape, r: int,
                  fwd: list[LayerOp], mode: str) -> list[LayerOp]:
    p = s.cp
    by = {o.name: o for o in fwd}
    core = 2 * sum(o.flops for o in fwd if o.kind == "compute")
    if p == 1:
        return [_c("gdn.bwd", core)]
    program = get_cp_mode("linear_attention", mode).program
    if program is not None:  # a registered mode's own plan
        return list(program(config, s, r, fwd))
    if mode == GDN_ULYSSES.name:
        return [replace(by["gdn.a2a_out"], name="gdn.a2a_out.bwd"), _c("gdn.core.bwd", core),
                replace(by["gdn.a2a_in"], name="gdn.a2a_in.bwd")]
    ops: list[LayerOp] = []
    if mode == GDN_P2P.name:
        state = s.rows * config.model.linear_num_value_heads * config.model.linear_key_head_dim \
            * config.model.linear_value_head_dim * _FP32
        if r < p - 1:
            ops.append(replace(_p2p("gdn.chain.recv_dH", "recv", +1, state),
                               flops=_chain_hop_flops(s, config.model)))
        ops.append(_c("gdn.output.bwd", core / 2))
        if r > 0:
            ops.append(_p2p("gdn.chain.send_dH", "send", -1, state))
        ops.append(_c("gdn.summary.bwd", core / 2))
    elif mode == GDN_PREFIX_SCAN.name:  # the reversed scan over (M^T, dH_local)
        m = config.model
        state = s.rows * m.linear_num_value_heads * m.linear_key_head_dim \
            * m.linear_value_head_dim * _FP32
        pair = s.rows * m.linear_num_value_heads * m.linear_key_head_dim \
            * (m.linear_key_head_dim + m.linear_value_head_dim) * _FP32
        recvs, sends = _scan_messages(p, r, reverse=True, state=state, pair=pair, tag=".bwd",
                                      compose=_compose_flops(s, m))
        ops += recvs + [_c("gdn.output.bwd", core / 2)] + sends
        ops.append(_c("gdn.summary.bwd", core / 2))
    else:  # all_gather: the gather's backward is an all-to-all of P times its input
        g = by["gdn.gather_summary"]
        ops += [_c("gdn.core.bwd", core / 2),
                replace(g, name="gdn.gather_summary.bwd", collective="all_to_all",
                        nbytes=g.nbytes * p, flops=2 * g.flops),  # the compose's backward
                _c("gdn.summary.bwd", core / 2)]
    halo = next(o.nbytes for o in fwd if o.name.startswith("gdn.halo."))
    if r > 0:
        ops.append(_p2p("gdn.halo.send_grad", "send", -1, halo))
    if r < p - 1:
        ops.append(_p2p("gdn.halo.recv_grad", "recv", +1, halo))
    return ops


def _ring_forward(p: int, kv_block: int, core: float, group: GroupName, prefix: str = "attn."
                  ) -> list[LayerOp]:
    """The ring's forward over ``p`` ranks: the next block is prefetched before this one
    computes; one hop is a single launch, recorded as its send and its recv."""
    ops: list[LayerOp] = []
    for step in range(p):
        if step + 1 < p:
            ops += [_p2p(f"{prefix}ring{step + 1}.send_kv", "send", +1, kv_block, group),
                    _p2p(f"{prefix}ring{step + 1}.recv_kv", "recv", -1, kv_block, group)]
        ops.append(_c(f"{prefix}block{step}", core / p))
    return ops


def _ring_backward(p: int, kv: int, dtype_bytes: int, work: float, group: GroupName,
                   prefix: str = "attn.") -> list[LayerOp]:
    """The ring's backward: one K/V hop, then per step (K/V hop while one is left) a block and
    a dK/dV hop (fp32 accumulators); the diagonal block in two halves around them."""
    dkv = kv // dtype_bytes * _FP32
    b = f"{prefix}bwd."
    ops = [_p2p(f"{b}ring1.send_kv", "send", +1, kv, group),
           _p2p(f"{b}ring1.recv_kv", "recv", -1, kv, group), _c(f"{b}block0a", work / (2 * p))]
    for step in range(1, p):
        if step + 1 < p:
            ops += [_p2p(f"{b}ring{step + 1}.send_kv", "send", +1, kv, group),
                    _p2p(f"{b}ring{step + 1}.recv_kv", "recv", -1, kv, group)]
        ops += [_c(f"{b}block{step}", work / p),
                _p2p(f"{b}dkv{step}.send", "send", +1, dkv, group),
                _p2p(f"{b}dkv{step}.recv", "recv", -1, dkv, group)]
    return ops + [_c(f"{b}block0b", work / (2 * p))]


def _attention_forward(config: "TrainConfig", s: MicrobatchShape, mode: str) -> list[LayerOp]:
    m, acc = config.model, config.train.accelerator
    p, t, e, d = s.cp, s.tokens, s.dtype_bytes, m.head_dim
    hq, hkv = m.num_attention_heads, m.num_key_value_heads
    proj = 2 * t * m.hidden_size * d * (hq * (2 if m.attn_output_gate else 1) + 2 * hkv + hq)
    core = 2 * s.rows * s.local_len * s.seq_len * hq * d  # causal: half of 4 * T_q * T_k * H * D
    if p == 1:
        return [_c("attn.proj", proj), _c("attn.core", core)]
    ops = [_c("attn.proj", proj),
           _coll("attn.agree", "cp", "all_gather", AGREE_ATTENTION_FIELDS * _INT64)]
    kv_block = 2 * t * hkv * d * e
    if mode == "ulysses":
        hkv_u = hkv if hkv % p == 0 else p  # k/v heads repeated up to cp when fewer
        return ops + [_coll("attn.a2a_in", "cp", "all_to_all", t * (hq + 2 * hkv_u) * d * e),
                      _c("attn.core", core),
                      _coll("attn.a2a_out", "cp", "all_to_all", t * hq * d * e)]
    if mode == "ring":
        return ops + _ring_forward(p, kv_block, core, "cp")
    if mode == "hierarchical":  # a2a over the inner A ranks, ring over the outer R
        hc = acc.hierarchical_cp
        assert hc is not None  # the config rule
        a2a, ring = hc.a2a, hc.ring
        hkv_u = hkv if hkv % a2a == 0 else a2a
        ops = [ops[0], replace(ops[1], group="cp_a2a"),
               _coll("attn.a2a_in", "cp_a2a", "all_to_all", t * (hq + 2 * hkv_u) * d * e),
               _coll("attn.ring.agree", "cp_ring", "all_gather",
                     AGREE_ATTENTION_FIELDS * _INT64)]
        # the ring's local block: A shards' tokens with hkv_u / A heads: 2 t hkv_u D bytes
        return ops + _ring_forward(ring, 2 * t * hkv_u * d * e, core, "cp_ring") + [
            _coll("attn.a2a_out", "cp_a2a", "all_to_all", t * hq * d * e)]
    if mode == "all_gather_kv":
        return ops + [_coll("attn.gather_kv", "cp", "all_gather", kv_block), _c("attn.core", core)]
    raise ValueError(f"train.accelerator.full_attention_cp_mode={mode!r}: layer_program knows "
                     f"ulysses, ring, all_gather_kv and hierarchical")


def _attention_backward(config: "TrainConfig", s: MicrobatchShape,
                        fwd: list[LayerOp], mode: str) -> list[LayerOp]:
    p = s.cp
    by = {o.name: o for o in fwd}
    work = 2 * sum(o.flops for o in fwd if o.kind == "compute")
    if p == 1:
        return [_c("attn.bwd", work)]
    if mode == "ulysses":
        return [replace(by["attn.a2a_out"], name="attn.a2a_out.bwd"), _c("attn.core.bwd", work),
                replace(by["attn.a2a_in"], name="attn.a2a_in.bwd")]
    if mode == "all_gather_kv":
        g = by["attn.gather_kv"]
        return [_c("attn.core.bwd", work),
                replace(g, name="attn.gather_kv.bwd", collective="all_to_all", nbytes=g.nbytes * p)]
    kv = by["attn.ring1.send_kv"].nbytes
    if mode == "hierarchical":  # the output a2a reversed, the ring's backward, q/k/v a2a reversed
        ring = config.train.accelerator.hierarchical_cp.ring  # type: ignore[union-attr]
        return ([replace(by["attn.a2a_out"], name="attn.a2a_out.bwd")]
                + _ring_backward(ring, kv, s.dtype_bytes, work, "cp_ring")
                + [replace(by["attn.a2a_in"], name="attn.a2a_in.bwd")])
    return _ring_backward(p, kv, s.dtype_bytes, work, "cp")


# ----------------------------------------------------------------------------- feed-forward


def _ffn_forward(config: "TrainConfig", s: MicrobatchShape, tag: str) -> list[LayerOp]:
    m, acc = config.model, config.train.accelerator
    t, e, hid = s.tokens, s.dtype_bytes, m.hidden_size
    if m.mlp != "moe":
        return [_c("mlp", 6 * t * hid * m.intermediate_size)]
    k, n_exp = m.num_experts_per_tok, m.num_experts
    router = _c("moe.router", 2 * t * hid * n_exp)
    experts = _c("moe.experts", 6 * t * k * hid * m.moe_intermediate_size)
    shared = ([_c("moe.shared_expert", 6 * t * hid * m.shared_expert_intermediate_size)]
              if m.shared_expert_intermediate_size else [])
    if acc.ep == 1:
        return [router, experts] + shared
    exact = k == n_exp  # every token to every expert: each rank receives what it sends
    rows = t * k * hid * e
    return ([router,
             _coll("moe.dispatch_counts", "ep", "all_to_all", n_exp * _INT64,
                   f"{tag}.dispatch_counts"),
             _coll("moe.dispatch", "ep", "all_to_all", rows, f"{tag}.dispatch"),
             experts,
             replace(_coll("moe.combine", "ep", "all_to_all", rows, f"{tag}.combine", exact),
                     join="moe.combine_wait")]
            + shared + [_c("moe.combine_wait", t * k * hid * 2)])


def _ffn_backward(config: "TrainConfig", fwd: list[LayerOp]) -> list[LayerOp]:
    by = {o.name: o for o in fwd}
    work = {o.name: 2 * o.flops for o in fwd if o.kind == "compute"}
    if "mlp" in by:
        return [_c("mlp.bwd", work["mlp"])]
    ops: list[LayerOp] = []
    if "moe.combine" in by:  # the reverse all-to-alls: combine's first, dispatch's last
        c, d = by["moe.combine"], by["moe.dispatch"]
        ops.append(replace(c, name="moe.combine.bwd", exact=True, join=None))
        ops.append(_c("moe.experts.bwd", work["moe.experts"]))
        if "moe.shared_expert" in by:
            ops.append(_c("moe.shared_expert.bwd", work["moe.shared_expert"]))
        ops.append(replace(d, name="moe.dispatch.bwd", exact=c.exact))
    else:
        ops += [_c(f"{n}.bwd", w) for n, w in work.items() if n != "moe.router"]
    return ops + [_c("moe.router.bwd", work["moe.router"])]


# ----------------------------------------------------------------------------- programs


def _norms(s: MicrobatchShape, hidden: int, name: str) -> LayerOp:
    return _c(name, 8 * s.tokens * hidden)


def layer_program(config: "TrainConfig", layer: int, direction: Direction,
                  shape: MicrobatchShape | None = None, *, cp_rank: int = 0,
                  moe_tag: str | None = None) -> tuple[LayerOp, ...]:
    """The ops of decoder layer ``layer`` in ``direction`` on CP rank ``cp_rank`` (module doc).

    Args:
        config: the training configuration (model, layout, CP modes).
        layer: global decoder-layer index (its type: ``config.model.layer_types[layer]``).
        direction: ``F``, ``B`` (= the backward's messages and all its compute), ``I`` (input
            gradient: every message) or ``W`` (weight gradient: compute only).
        shape: the microbatch (default :func:`microbatch_shape`).
        cp_rank: rank in the CP group (the p2p chain's ends differ).
        moe_tag: the MoE dispatcher's tag (``S{stage}.L{index in stage}``), for labels.

    Returns:
        The ops in issue order. Raises ValueError naming an unknown mode or direction.
    """
    s = shape if shape is not None else microbatch_shape(config)
    m = config.model
    if not 0 <= layer < m.num_hidden_layers:
        raise ValueError(f"layer {layer} is not a decoder layer of a model with "
                         f"{m.num_hidden_layers} layers")
    if not 0 <= cp_rank < s.cp:
        raise ValueError(f"cp_rank {cp_rank} is not a rank of a CP group of {s.cp}")
    tag = moe_tag if moe_tag is not None else f"L{layer}"
    gdn = m.layer_types[layer] == "linear_attention"
    mode = _layer_mode(config, layer)
    fwd = ([_norms(s, m.hidden_size, "norm1")]
           + (_gdn_forward(config, s, cp_rank, mode) if gdn
              else _attention_forward(config, s, mode))
           + [_norms(s, m.hidden_size, "norm2")] + _ffn_forward(config, s, tag))
    if direction == "F":
        return tuple(fwd)
    if direction not in ("B", "I", "W"):
        raise ValueError(f"direction {direction!r} is not one of F, B, I, W")
    mixer_f = [o for o in fwd if o.name.startswith(("gdn.", "attn."))]
    ffn_f = [o for o in fwd if o.name.startswith(("mlp", "moe."))]
    bwd = (_ffn_backward(config, ffn_f) + [_norms(s, m.hidden_size, "norm2.bwd")]
           + (_gdn_backward(config, s, cp_rank, mixer_f, mode) if gdn
              else _attention_backward(config, s, mixer_f, mode))
           + [_norms(s, m.hidden_size, "norm1.bwd")])
    if config.train.activation_checkpoint:
        # the replay's combine is issued like a blocking one (no join)
        bwd = [replace(o, name=f"recompute.{o.name}", join=None) for o in fwd] + bwd
    if direction == "B":
        return tuple(bwd)
    if direction == "I":  # half the compute (input gradients), every message
        return tuple(o if o.is_comm else replace(o, flops=o.flops / 2) for o in bwd)
    return (_c("weight_grads", sum(o.flops for o in bwd if not o.is_comm) / 2),)


def stage_program(config: "TrainConfig", layers: list[int], direction: Direction,
                  shape: MicrobatchShape | None = None, *, cp_rank: int = 0, stage: int = 0,
                  first: bool = False, last: bool = False) -> tuple[tuple[int, LayerOp], ...]:
    """``(layer, op)`` of one pipeline stage holding decoder ``layers`` (ascending) in
    ``direction``: forward in layer order, backward in reverse, the embedding on the first
    stage and the LM head (+ loss) on the last (layer ``-1``); MoE tags ``S{stage}.L{i}``."""
    s = shape if shape is not None else microbatch_shape(config)
    m = config.model
    head = 2 * s.tokens * m.hidden_size * m.vocab_size
    order = list(enumerate(layers))
    if direction != "F":
        order.reverse()
    out: list[tuple[int, LayerOp]] = []
    if direction == "F" and first:
        out.append((-1, _c("embed", 0.0)))
    if direction != "F" and last:
        out.append((-1, _c("head.wgrad" if direction == "W" else "head.bwd",
                          2 * head if direction == "B" else head)))
    for i, layer in order:
        out += [(layer, op) for op in layer_program(config, layer, direction, s, cp_rank=cp_rank,
                                                    moe_tag=f"S{stage}.L{i}")]
    if direction == "F" and last:
        out.append((-1, _c("head", head)))
    return tuple(out)


def builtin_gdn_program(mode: str) -> Callable[..., list[LayerOp]]:
    """The layer program of the built-in GDN CP mode ``mode`` in the form a registered mode
    gives (``config.cp_modes.CPMode.program``): ``(config, shape, cp_rank, forward_ops | None)
    -> ops`` of the mixer, cp > 1. A mode that runs a built-in algorithm under a new strategy
    can reuse its plan and cost."""
    if get_cp_mode("linear_attention", mode).program is not None:
        raise ValueError(f"{mode!r} is a registered mode with its own program, not a built-in")

    def program(config: "TrainConfig", s: MicrobatchShape, r: int,
                fwd: list[LayerOp] | None) -> list[LayerOp]:
        return _gdn_forward(config, s, r, mode) if fwd is None else \
            _gdn_backward(config, s, r, fwd, mode)

    return program
