"""Cost models of a training step's tasks: machine profiles (links, collectives, compute
throughput) and costs measured on a short real run.

Two sources of costs feed the simulator (:func:`overlap_runtime.graph.simulate`):

* :class:`MachineProfile` prices what has not been run: an **alpha-beta** message
  (``latency + bytes / bandwidth``) over the link a group's placement uses (NVLink inside a node
  of ``gpus_per_node`` devices, the inter-node network otherwise), collectives by group size
  (all-to-all, ring all-gather / reduce-scatter, ring point-to-point step, the GDN state chain
  hop by hop and its prefix scan round by round), and compute from a FLOP count and the
  throughput of the op's class (``gemm``, ``moe``, ``gdn``, ``attention``, ``state``),
  each calibrated from a measured figure of docs/benchmarks.md (:func:`h200_profile` says which).
* :class:`MeasuredCosts` holds node costs read from an :class:`~overlap_runtime.pipeline.
  ExecutionTrace` of a few real steps (:func:`measured_costs`): per stage and action kind the
  median *busy* time of the action (its span minus the communication waits nested in it: an F
  that waits for its input is not computing), and per message size the median wait.

Placement. Ranks are numbered like the trainer's meshes (``trainer.parallel_dims``: pp outermost,
cp and ep innermost), so a cp or ep group of ``g`` ranks is ``g`` consecutive ranks (stride 1)
and the pp peers are ``world / pp`` apart. A group stays on NVLink while its ranks fit in one
node (``g * stride <= gpus_per_node``); an all-to-all of a group that spans ``n`` nodes sends
``(g - g / n) / g`` of its buffer over the inter-node link.

Units: seconds and bytes throughout.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from overlap_runtime.graph.intervals import WAIT_CATEGORIES, minus, total_length, union
from overlap_runtime.schedules.ir import parse_compute_action

from .shared_cores import work_of_spans


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: a message of ``n`` bytes takes ``latency_s + n / bandwidth_Bps``."""

    name: str
    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"Link {self.name!r}: latency_s={self.latency_s} must be finite >= 0")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"Link {self.name!r}: bandwidth_Bps={self.bandwidth_Bps} must be > 0")

    def time(self, nbytes: float) -> float:
        return self.latency_s + (nbytes / self.bandwidth_Bps if nbytes > 0 else 0.0)


@dataclass(frozen=True)
class MachineProfile:
    """A machine for the simulator: links, compute throughput per op class, memory.

    Attributes:
        name: for reports.
        gpus_per_node: devices that share the fast intra-node link.
        intra: the intra-node link (NVLink), per direction and device.
        inter: the inter-node link per device (one NIC per GPU).
        flops: achieved FLOP/s per op class (``gemm``, ``moe``, ``gdn``, ``attention``).
        hbm_Bps: achieved memory bandwidth, for layout copies around all-to-alls.
        memory_bytes: device memory, for the peak-memory check.
        source: where the figures come from (printed with every prediction).
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    flops: Mapping[str, float]
    hbm_Bps: float
    memory_bytes: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"MachineProfile {self.name!r}: gpus_per_node="
                             f"{self.gpus_per_node} must be >= 1")
        for k, v in self.flops.items():
            if not v > 0:
                raise ValueError(f"MachineProfile {self.name!r}: flops[{k!r}]={v} must be > 0")

    # -- placement -------------------------------------------------------------------------
    def nodes_spanned(self, group: int, stride: int = 1) -> int:
        """Nodes that ``group`` ranks ``stride`` apart occupy (1 when they fit in one node)."""
        if group < 1 or stride < 1:
            raise ValueError(f"group={group} and stride={stride} must be >= 1")
        span = (group - 1) * stride + 1
        if span <= self.gpus_per_node:
            return 1
        if stride >= self.gpus_per_node:
            return group
        return math.ceil(span / self.gpus_per_node)

    def link(self, group: int, stride: int = 1) -> Link:
        """The slowest link a message between members of the group crosses."""
        return self.intra if self.nodes_spanned(group, stride) == 1 else self.inter

    # -- communication ---------------------------------------------------------------------
    def p2p(self, nbytes: float, *, same_node: bool = True) -> float:
        """One point-to-point message."""
        return (self.intra if same_node else self.inter).time(nbytes)

    def all_to_all(self, nbytes: float, group: int, stride: int = 1) -> float:
        """An all-to-all in which every rank holds ``nbytes`` (sends ``(g-1)/g`` of it).

        Pairwise exchange: ``g - 1`` latencies overlap into ~one per node crossed; the bytes
        leaving the node go over the inter-node link, the rest over NVLink, both at once.
        """
        if group == 1:
            return 0.0
        n = self.nodes_spanned(group, stride)
        out = nbytes * (group - 1) / group
        if n == 1:
            return self.intra.time(out)
        remote = nbytes * (group - group / n) / group
        local = out - remote
        return max(self.intra.time(local), self.inter.time(remote)) + (n - 1) * self.inter.latency_s

    def all_gather(self, nbytes: float, group: int, stride: int = 1) -> float:
        """Ring all-gather of ``nbytes`` per rank (the same for a reduce-scatter of
        ``group * nbytes``): ``g - 1`` steps of ``nbytes`` over the slowest link."""
        if group == 1:
            return 0.0
        return (group - 1) * self.link(group, stride).time(nbytes)

    def ring_step(self, nbytes: float, group: int, stride: int = 1) -> float:
        """One step of a ring (ring attention's K/V block, the GDN state chain's hop)."""
        if group == 1:
            return 0.0
        return self.link(group, stride).time(nbytes)

    def state_chain(self, nbytes: float, group: int, hop_flop: float = 0.0) -> float:
        """The GDN state chain over ``group`` consecutive ranks, as its far end waits for it:
        ``group - 1`` hops, each one message of ``nbytes`` plus the receiver's apply
        (``hop_flop`` at the ``state`` throughput); a hop between two nodes (every
        ``gpus_per_node``-th) goes over the inter-node link, the others over NVLink."""
        if group <= 1:
            return 0.0
        crossing = self.nodes_spanned(group) - 1
        apply = self.compute(hop_flop, "state") if hop_flop else 0.0
        return ((group - 1 - crossing) * self.intra.time(nbytes)
                + crossing * self.inter.time(nbytes) + (group - 1) * apply)

    def prefix_scan(self, state_bytes: float, pair_bytes: float, group: int,
                    compose_flop: float = 0.0) -> float:
        """The Hillis-Steele scan of ``context_parallel/gdn/scan_rounds.py`` over ``group``
        consecutive ranks: ``ceil(log2 group)`` rounds, each as long as its slowest message
        plus one compose (``compose_flop`` at the ``state`` throughput). Round ``d``: position
        ``p`` sends to ``p + 2^d``, a state when ``p < 2^d``, else an ``(M, S)`` pair of
        ``pair_bytes``; it crosses a node boundary when some pair of that round does.
        Bulk-synchronous (a round waits for the previous round everywhere): an upper bound
        of the far end's critical path."""
        total, step = 0.0, 1
        compose = self.compute(compose_flop, "state") if compose_flop else 0.0
        while step < group:
            nbytes = pair_bytes if group - 1 - step >= step else state_bytes
            crosses = any(p // self.gpus_per_node != (p + step) // self.gpus_per_node
                          for p in range(group - step))
            total += (self.inter if crosses else self.intra).time(nbytes) + compose
            step *= 2
        return total

    def copy(self, nbytes: float) -> float:
        """A layout copy (read + write) of ``nbytes``."""
        return 2.0 * nbytes / self.hbm_Bps

    # -- compute ---------------------------------------------------------------------------
    def compute(self, flop: float, op_class: str) -> float:
        """Time of ``flop`` FLOPs in an op of class ``op_class``."""
        if op_class not in self.flops:
            raise ValueError(f"MachineProfile {self.name!r} has no throughput for op class "
                             f"{op_class!r}; known: {', '.join(sorted(self.flops))}")
        return flop / self.flops[op_class]


def h200_profile(gpus_per_node: int = 8) -> MachineProfile:
    """NVIDIA H200 (HGX, 8 GPUs per node) from the measured figures of docs/benchmarks.md.

    * NVLink: 99 GB/s effective per direction, 15 us latency: the MoE dispatch all-to-all of
      32768 rows x 4096 bf16 between 2 H200 took 1.36 ms (134 MB crossing); a 2 MiB GDN state
      message took 0.05-0.09 ms with a device sync (latency bound).
    * Inter-node: 40 GB/s per GPU and 25 us latency: one 400 Gb/s NDR InfiniBand NIC per GPU
      (the HGX H200 reference design) at the ~80% NCCL reaches; *not measured here* (the lent
      machines are single-node), so every cross-node figure rests on this assumption.
    * Compute, achieved bf16 FLOP/s: ``attention`` 552e12 (cuDNN SDPA fwd+bwd, 32K causal,
      16 heads of 128); ``gdn`` 205e12 (the whole GatedDeltaNet layer, Triton, hidden 2048, 16/32
      heads, local 16K: 6.28 ms fwd + 10.39 ms bwd for 3.4 TFLOP); ``moe`` 166e12 (2 MoE layers,
      16 experts top-4 + shared expert, 8192 tokens, fwd + bwd 44.6 ms of compute for 7.4 TFLOP);
      ``gemm`` 600e12 (dense projections and MLPs: 61% of the 989 TFLOP/s peak, between the
      attention and MoE figures; no dense-MLP-only figure was measured); ``state`` 25.6e12
      (fp32 products of the GDN state hand-over: one hop of the Triton chain, four
      ``[K, K] x [K, V]`` products over 32 heads of 128, took 0.021 ms; prices the chain's
      apply, the prefix scan's compose and the summary all-gather's prefix compose).
    * HBM: 3.0e12 B/s achieved (4.8 TB/s peak) for the layout copies around all-to-alls.
    """
    return MachineProfile(
        name="h200", gpus_per_node=gpus_per_node,
        intra=Link("nvlink", 15e-6, 99e9), inter=Link("ib-ndr400", 25e-6, 40e9),
        flops={"attention": 552e12, "gdn": 205e12, "moe": 166e12, "gemm": 600e12,
               "state": 25.6e12},
        hbm_Bps=3.0e12, memory_bytes=141e9,
        source="docs/benchmarks.md H200 figures (NVLink measured on 2 GPUs; inter-node assumed "
               "400 Gb/s NDR at 40 GB/s)")


def cpu_profile(flops: float = 20e9, latency_s: float = 60e-6,
                bandwidth_Bps: float = 2e9) -> MachineProfile:
    """A CPU host (gloo over loopback): one node, every op class at ``flops``. Only for
    relative figures; CPU predictions that must hold use :class:`MeasuredCosts` instead."""
    return MachineProfile(
        name="cpu", gpus_per_node=1 << 30, intra=Link("loopback", latency_s, bandwidth_Bps),
        inter=Link("loopback", latency_s, bandwidth_Bps),
        flops={"attention": flops, "gdn": flops, "moe": flops, "gemm": flops, "state": flops},
        hbm_Bps=10e9, memory_bytes=64e9, source="nominal CPU figures")


# -- measured costs ---------------------------------------------------------------------------

def _action_busy(events: Iterable[object]) -> dict[tuple[int, str, str], list[tuple[int, int]]]:
    """Busy intervals (ns) of every ``compute`` event: its span minus the waits of the same
    rank and thread inside it (an F whose input is still in flight waits inside its span; an MoE
    layer waits for its all-to-alls inside the F or B; categories
    :data:`~overlap_runtime.graph.intervals.WAIT_CATEGORIES`).

    Returns ``{(rank, thread, name): intervals}``; events are :class:`~overlap_runtime.pipeline.
    exec_trace.TraceEvent` objects.
    """
    by_thread: dict[tuple[int, str], list[Any]] = {}
    for e in events:
        by_thread.setdefault((e.rank, e.thread), []).append(e)  # type: ignore[attr-defined]
    out: dict[tuple[int, str, str], list[tuple[int, int]]] = {}
    for (rank, thread), evs in by_thread.items():
        waits = union((e.start_ns, e.end_ns) for e in evs if e.cat in WAIT_CATEGORIES)
        for e in evs:
            if e.cat == "compute" and e.end_ns > e.start_ns:
                out[(rank, thread, e.name)] = minus([(e.start_ns, e.end_ns)], waits)
    return out


def split_busy(events: Iterable[object]) -> dict[tuple[int, str, str], float]:
    """Busy seconds of every ``compute`` event (:func:`_action_busy`, summed)."""
    return {k: sum(b - a for a, b in v) / 1e9 for k, v in _action_busy(events).items()}


@dataclass
class MeasuredCosts:
    """Node costs measured on a real run.

    ``compute[(stage, kind)]``: median busy seconds of one ``kind`` action (F/B/I/W) of
    ``stage``; ``per_rank[(rank, stage, kind)]`` the same per rank (stages of one rank are
    alike, ranks of one stage may not be). ``comm[kind]``: median seconds of a communication
    kind (``a2a``: one all-to-all span). ``a2a[(stage, kind, paired)]``: how many all-to-alls
    one action runs and the median span of one (it includes waiting for the EP peer, and inside
    an OVERLAP step (``paired``) waiting for the GIL the other thread holds). ``samples``: how many spans each figure summarises.
    """

    compute: dict[tuple[int, str], float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    #: (stage, kind, paired) -> (all-to-alls inside one action, median seconds of one of them)
    a2a: dict[tuple[int, str, bool], tuple[int, float]] = field(default_factory=dict)
    #: (stage, kind, paired) -> share of the action's compute in each of its n + 1 regions
    #: (before the first all-to-all, between, after the last)
    regions: dict[tuple[int, str, bool], list[float]] = field(default_factory=dict)
    #: runtime time per program step that no span covers (the step loop, thread hand-offs)
    gap_s: float = 0.0
    #: the same figures per global rank (ranks of one stage differ: they drift apart)
    by_rank: dict[int, "MeasuredCosts"] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def cost(self, stage: int, kind: str) -> float:
        try:
            return self.compute[(stage, kind)]
        except KeyError:
            raise KeyError(f"no measured cost for {kind} of stage {stage}; measured: "
                           f"{sorted(self.compute)}") from None


def measured_costs(steps: Iterable[Iterable[object]], cores: int | None = None) -> MeasuredCosts:
    """Median node costs over the traces of a few steps (each an iterable of trace events of
    every rank, as :func:`~overlap_runtime.pipeline.gather_traces` returns them), over all
    ranks and, in ``by_rank``, per rank.

    Compute actions are named by their action text (``1F3``); their cost is the busy time of
    the span (:func:`_action_busy`). With ``cores`` fewer than the ranks, the busy time is
    turned into full-speed *work* (:func:`~overlap_runtime.stepgraph.shared_cores.
    work_of_spans`: while ``k`` ranks computed on ``cores`` cores each ran at ``cores / k``),
    the input of :func:`~overlap_runtime.stepgraph.shared_cores.simulate_shared_cores`.
    All-to-all spans (``cat == 'a2a'``) give ``comm['a2a']``, receive/send waits
    ``comm['p2p_wait']``, and ``comm['p2p_delivery']`` is how long after its producer ended a
    pipeline message reached a receiver that was already waiting for it (transfer plus the
    receiver's wake-up: on shared cores it must be scheduled first).
    """
    comp: list[tuple[int, tuple[int, str], float]] = []
    comm: list[tuple[int, str, float]] = []
    a2a: list[tuple[int, tuple[int, str, bool], int, list[float], list[float]]] = []
    gaps: list[tuple[int, float]] = []
    for events in steps:
        events = list(events)
        gaps.extend(_gaps(events))
        for rank, key, n, spans, regions in _nested_a2a(events):
            a2a.append((rank, key, n, spans, regions))
        busy = _action_busy(events)
        ranks = sorted({k[0] for k in busy})
        if cores is not None and cores < len(ranks):

            work = work_of_spans(busy, cores, {k: (k[0], k[1]) for k in busy})
            seconds = {k: w / 1e9 for k, w in work.items()}
        else:
            seconds = {k: sum(b - a for a, b in v) / 1e9 for k, v in busy.items()}
        for (rank, _thread, name), value in seconds.items():
            parsed = parse_compute_action(name)
            if parsed is not None:
                comp.append((rank, (parsed[0], parsed[1]), value))
        comm.extend(_deliveries(events))
        for e in events:
            cat = e.cat  # type: ignore[attr-defined]
            dur = (e.end_ns - e.start_ns) / 1e9  # type: ignore[attr-defined]
            if cat in ("a2a", "comm"):
                comm.append((e.rank, "a2a" if cat == "a2a" else "p2p_wait", dur))  # type: ignore[attr-defined]
    out = _summarise(comp, comm, a2a, gaps, None)
    for rank in sorted({r for r, _, _ in comp}):
        out.by_rank[rank] = _summarise(comp, comm, a2a, gaps, rank)
    return out


def _summarise(comp: list[Any], comm: list[Any], a2a: list[Any], gaps: list[Any],
               rank: int | None) -> MeasuredCosts:
    """Medians of the samples of ``rank`` (None: of every rank)."""
    def mine(rows: list[Any]) -> list[Any]:
        return [r[1:] for r in rows if rank is None or r[0] == rank]

    out = MeasuredCosts()
    by: dict[Any, list[float]] = {}
    for key, value in mine(comp):
        by.setdefault(key, []).append(value)
    for k, v in by.items():
        out.compute[k] = statistics.median(v)
        out.samples[f"{k[0]}{k[1]}"] = len(v)
    by = {}
    for key, value in mine(comm):
        by.setdefault(key, []).append(value)
    for k, v in by.items():
        out.comm[k] = statistics.median(v)
        out.samples[k] = len(v)
    g = [x for (x,) in mine(gaps)]
    out.gap_s = statistics.median(g) if g else 0.0
    counts: dict[Any, list[int]] = {}
    spans: dict[Any, list[float]] = {}
    regions: dict[Any, list[list[float]]] = {}
    for key, n, sp, reg in mine(a2a):
        counts.setdefault(key, []).append(n)
        spans.setdefault(key, []).extend(sp)
        regions.setdefault((key, n), []).append(reg)
    for k, ns in counts.items():
        n = round(statistics.median(ns))
        if n and spans[k]:
            out.a2a[k] = (n, statistics.fmean(spans[k]))
            rows = regions.get((k, n), [])
            if rows:
                med = [statistics.median(r[j] for r in rows) for j in range(n + 1)]
                total = sum(med)
                if total > 0:
                    out.regions[k] = [x / total for x in med]
    return out


def _deliveries(events: list[Any]) -> list[tuple[int, str, float]]:
    """``(rank, 'p2p_delivery', seconds)`` per pipeline receive that waited (its wait began
    before its producer, ``{s-1}F{m}`` or ``{s+1}B|I{m}``, ended): wait end - producer end."""
    ends: dict[str, int] = {}
    for e in events:
        if e.cat == "compute":
            ends[e.name] = min(ends.get(e.name, e.end_ns), e.end_ns)
    out = []
    for e in events:
        if e.cat != "comm" or not e.name.startswith("wait ") or "RECV_" not in e.name:
            continue
        text = e.name[5:]
        at = text.index("RECV_")
        try:
            stage, kind, mb = int(text[:at]), text[at + 5], int(text[at + 6:])
        except ValueError:
            continue
        names = [f"{stage - 1}F{mb}"] if kind == "F" else [f"{stage + 1}B{mb}", f"{stage + 1}I{mb}"]
        producer = next((ends[n] for n in names if n in ends), None)
        if producer is not None and e.start_ns < producer <= e.end_ns:
            out.append((e.rank, "p2p_delivery", (e.end_ns - producer) / 1e9))
    return out


def _gaps(events: list[Any]) -> list[tuple[int, float]]:
    """Per rank: seconds between its first and last event that no event of any thread covers,
    divided by its program steps (compute actions outside OVERLAP steps, and OVERLAP steps)."""
    out = []
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank]
        cover = union((e.start_ns, e.end_ns) for e in mine if e.end_ns > e.start_ns)
        if not cover:
            continue
        free = total_length(minus([(cover[0][0], cover[-1][1])], cover))
        compound = [(e.start_ns, e.end_ns) for e in mine if e.cat == "compound"]
        steps = len(compound) + sum(
            1 for e in mine if e.cat == "compute" and parse_compute_action(e.name) is not None
            and not any(a <= e.start_ns and e.end_ns <= b for a, b in compound))
        if steps:
            out.append((rank, free / 1e9 / steps))
    return out


def _nested_a2a(events: list[Any]) -> Iterable[tuple[int, tuple[int, str, bool], int,
                                                      list[float], list[float]]]:
    """Per compute action: ``(rank, (stage, kind, inside an OVERLAP step), number of all-to-all spans
    of its thread inside it, their seconds, the action's busy seconds in each of the n + 1
    compute regions around them)``."""
    by_thread: dict[tuple[int, str], list[Any]] = {}
    waits: dict[tuple[int, str], list[tuple[int, int]]] = {}
    compound: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        if e.cat == "a2a":
            by_thread.setdefault((e.rank, e.thread), []).append(e)
        if e.cat in WAIT_CATEGORIES:
            waits.setdefault((e.rank, e.thread), []).append((e.start_ns, e.end_ns))
        elif e.cat == "compound":
            compound.setdefault(e.rank, []).append((e.start_ns, e.end_ns))
    for e in events:
        if e.cat != "compute" or e.end_ns <= e.start_ns:
            continue
        parsed = parse_compute_action(e.name)
        if parsed is None:
            continue
        paired = any(a <= e.start_ns and e.end_ns <= b for a, b in compound.get(e.rank, ()))
        inside = sorted((a.start_ns, a.end_ns) for a in by_thread.get((e.rank, e.thread), ())
                        if e.start_ns <= a.start_ns and a.end_ns <= e.end_ns)
        busy = minus([(e.start_ns, e.end_ns)], union(waits.get((e.rank, e.thread), [])))
        edges = [e.start_ns] + [x for a, b in inside for x in (a, b)] + [e.end_ns]
        regions = []
        for lo, hi in zip(edges[::2], edges[1::2]):
            regions.append(sum(max(0, min(b, hi) - max(a, lo)) for a, b in busy) / 1e9)
        yield (e.rank, (parsed[0], parsed[1], paired), len(inside),
               [(b - a) / 1e9 for a, b in inside], regions)
