"""Conformance: is what each rank really ran a linearisation of its part of the step graph?

Input: the :class:`~.compose.StepGraph` and, per global rank, the entries a
``ops.step_record.StepRecorder`` collected during one step (task starts and communication
launches). Checks, per rank:

1. every launch belongs to a task of the graph: a pipeline message (label ``0SEND_F1``) is
   that task; any other launch is the next communication op of the action in whose scope it
   ran (``1F3``), and must agree with it: op (send/recv/collective), group, peer (global
   rank), bytes (for routing-dependent MoE sizes: the group's total), and the runtime's label
   where the graph names one (the MoE dispatcher's ``S0.L1.dispatch``);
2. each task exactly once: every pipeline action started once, every op launched once;
3. the order respects the graph's edges between tasks of the rank (a compute op not recorded
   itself sits right after the launch before it in its action);

and across ranks: the two ends of each message agree (bytes, peers), and collectives on one
group instance are issued in the same order, with the same labels, on every member.

A launch recorded at the ``torch.distributed`` boundary (``direct``: issued with
``torch.distributed`` itself, not through ``ops.comm``) is rejected wherever it ran: the graph
carries only what ``ops.comm`` launches, so such a collective would run every step unchecked.

A mismatch raises :class:`ConformanceError` naming the rank, the task and what the graph
expected. :func:`ideal_records` gives the records of a run that follows the graph exactly
(tests mutate them). The pipeline's one-time metadata exchange (label ``metadata ...``) is not
a task of the step graph and is skipped.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Mapping

from overlap_runtime.graph import Task

from .compose import StepGraph
from .expand import group_key


class ConformanceError(RuntimeError):
    """A recorded step that is not a run of its step graph."""


def _entry(e: Any) -> Mapping[str, Any]:
    return e if isinstance(e, Mapping) else e.to_dict()


def _base_label(label: str) -> str:
    return label.removesuffix(" (reverse)")


def _expect(t: Task) -> str:
    op = t.meta.get("op")
    c = t.comm
    assert c is not None
    size = c.nbytes if op is None or op.exact else f"~{c.nbytes} (routing-dependent)"
    peer = "" if c.peer is None else f" to/from rank {c.peer}"
    label = f" labelled {op.label!r}" if op is not None and op.label else ""
    return f"{c.op} {t.kind if c.op == 'collective' else ''} on {c.key if c.op == 'collective' else t.lane}{peer}, {size} bytes{label}".replace("  ", " ")


def _got(e: Mapping[str, Any]) -> str:
    peer = "" if e.get("peer") is None else f" peer rank {e['peer']}"
    return (f"{e['op']} on {group_key(e['group'], e['group_ranks'])}{peer}, {e['nbytes']} bytes "
            f"labelled {e.get('label')!r} (thread {e.get('thread')})")


def _is_message(g: Any, ids: list[Hashable]) -> bool:
    """Whether the action of ``ids`` is a pipeline SEND/RECV (one communication task, no layer
    op) rather than a compute action, whose first op may be a communication too."""
    t = g.task(ids[0])
    return len(ids) == 1 and t.comm is not None and t.meta.get("op") is None


def check_conformance(sg: StepGraph, records: Mapping[int, Iterable[Any]]) -> None:
    """Raise :class:`ConformanceError` unless ``records`` (global rank -> entries) is a run of
    ``sg`` (module doc). ``records`` must hold every rank of the layout."""
    g = sg.graph
    missing = [r for r in range(sg.dims.world_size) if r not in records]
    if missing:
        raise ConformanceError(f"conformance: no record for ranks {missing}")
    assigned: dict[Hashable, tuple[int, Mapping[str, Any]]] = {}
    coll_seq: dict[str, dict[int, list[tuple[str, int, bool]]]] = {}
    for rank in range(sg.dims.world_size):
        entries = [_entry(e) for e in records[rank]]
        acts = sg.actions[rank]
        pos: dict[Hashable, float] = {}
        cursor: dict[str, int] = {}
        started: dict[str, int] = {}
        comm_of = {a: [i for i in ids if g.task(i).comm is not None] for a, ids in acts.items()}
        for n, e in enumerate(entries):
            where = f"rank {rank}, record #{n}"
            if e.get("direct"):
                raise ConformanceError(
                    f"{where}: {_got(e)} was issued with torch.distributed directly in task "
                    f"{e.get('task')!r}, outside ops.comm; the step graph cannot check it. "
                    f"Rule: every communication of a step goes through ops.comm")
            if e["op"] == "task":
                name = e["task"]
                if name in acts and not _is_message(g, acts[name]):
                    started[name] = started.get(name, 0) + 1
                    if started[name] > 1:
                        raise ConformanceError(f"{where}: task {name} ran twice; the graph has "
                                               f"it once")
                    pos[("start", name)] = n
                continue
            label = e.get("label") or ""
            is_pp = "pp" in str(e["group"]).split("|") and e.get("task") is None
            if is_pp and label.startswith("metadata"):
                continue
            if is_pp:
                tid = (rank, label)
                if tid not in g or g.task(tid).comm is None:
                    raise ConformanceError(f"{where}: pipeline message {label!r} is not a task of "
                                           f"the step graph on this rank (its program: "
                                           f"{sg.graph.programs.get(rank)})")
            else:
                action = e.get("task")
                if action is None or action not in acts:
                    raise ConformanceError(f"{where}: {_got(e)} launched outside any task of the "
                                           f"graph (scope {action!r})")
                k = cursor.get(action, 0)
                cursor[action] = k + 1
                if k >= len(comm_of[action]):
                    raise ConformanceError(f"{where}: task {action} launched a communication "
                                           f"the graph does not have: {_got(e)}; the graph "
                                           f"expects only {len(comm_of[action])} in {action}")
                tid = comm_of[action][k]
            t = g.task(tid)
            if tid in assigned:
                raise ConformanceError(f"{where}: task {t.text} launched twice")
            _compare(rank, n, t, e)
            assigned[tid] = (rank, e)
            pos[tid] = n
            if t.comm is not None and t.comm.op == "collective":
                op = t.meta.get("op")
                coll_seq.setdefault(str(t.comm.key), {}).setdefault(rank, []).append(
                    (_base_label(label) if op is not None and op.label else t.kind,
                     int(e["nbytes"]), op is None or op.exact))
        _check_complete(sg, rank, acts, comm_of, cursor, started, assigned)
        _check_order(sg, rank, acts, pos)
    _check_pairs(sg, assigned)
    _check_collective_order(coll_seq)


def _compare(rank: int, n: int, t: Task, e: Mapping[str, Any]) -> None:
    c = t.comm
    assert c is not None
    op = t.meta.get("op")
    bad = []
    if e["op"] != c.op:
        bad.append(f"op {e['op']}")
    if c.op == "collective":
        name = str(c.key).split("[")[0]
        if (name not in str(e["group"]).split("|")
                or group_key(name, e["group_ranks"]) != c.key):
            bad.append("group")
    elif e.get("peer") != c.peer:
        bad.append(f"peer rank {e.get('peer')}")
    if (op is None or op.exact) and c.nbytes is not None and int(e["nbytes"]) != c.nbytes:
        bad.append(f"{e['nbytes']} bytes")
    if op is not None and op.label and _base_label(e.get("label") or "") != op.label:
        bad.append(f"label {e.get('label')!r}")
    if bad:
        raise ConformanceError(
            f"rank {rank}, record #{n}, task {t.text}: got {', '.join(bad)} ({_got(e)}); the "
            f"graph expects {_expect(t)}")


def _check_complete(sg: StepGraph, rank: int, acts: dict[str, list[Hashable]],
                    comm_of: dict[str, list[Hashable]], cursor: dict[str, int],
                    started: dict[str, int], assigned: dict[Hashable, Any]) -> None:
    g = sg.graph
    for action, ids in acts.items():
        if _is_message(g, ids):
            if ids[0] not in assigned:
                raise ConformanceError(f"rank {rank}: pipeline message {action} never launched; "
                                       f"the graph expects {_expect(g.task(ids[0]))}")
            continue
        if action not in started:
            raise ConformanceError(f"rank {rank}: task {action} never ran (the graph has it at "
                                   f"step {g.task(ids[0]).step})")
        k = cursor.get(action, 0)
        if k < len(comm_of[action]):
            t = g.task(comm_of[action][k])
            raise ConformanceError(f"rank {rank}, task {t.text}: never launched ({k} of the "
                                   f"{len(comm_of[action])} communications of {action} ran); "
                                   f"the graph expects {_expect(t)}")


def _check_order(sg: StepGraph, rank: int, acts: dict[str, list[Hashable]],
                 pos: dict[Hashable, float]) -> None:
    """Positions for every task of the rank, then every edge inside the rank must go forward."""
    g = sg.graph
    for action, ids in acts.items():
        base = pos.get(("start", action))
        for k, tid in enumerate(ids):
            if tid in pos:
                base = pos[tid]
            elif base is not None:
                pos[tid] = base + (k + 1) * 1e-6
    for u, v, kind in g.edges():
        if u not in pos or v not in pos:
            continue
        tu, tv = g.task(u), g.task(v)
        if tu.rank != rank or tv.rank != rank:
            continue
        if pos[u] >= pos[v]:
            raise ConformanceError(
                f"rank {rank}: task {tv.text} ran (record #{int(pos[v])}) before "
                f"{tu.text} (record #{int(pos[u])}); the graph orders {tu.text} first "
                f"({kind} edge)")


def _check_pairs(sg: StepGraph, assigned: dict[Hashable, tuple[int, Mapping[str, Any]]]) -> None:
    matching = sg.matching if sg.matching is not None else sg.validate()
    for s, r in matching.pairs:
        if s not in assigned or r not in assigned:
            continue
        (rs, es), (rr, er) = assigned[s], assigned[r]
        if es["nbytes"] != er["nbytes"] or es.get("peer") != rr or er.get("peer") != rs:
            raise ConformanceError(
                f"message {sg.graph.task(s).text} -> {sg.graph.task(r).text}: the ends disagree: "
                f"rank {rs} sent {es['nbytes']} bytes to rank {es.get('peer')}, rank {rr} "
                f"received {er['nbytes']} bytes from rank {er.get('peer')}")


def _check_collective_order(coll_seq: dict[str, dict[int, list[tuple[str, int, bool]]]]) -> None:
    for key, by_rank in coll_seq.items():
        ranks = sorted(by_rank)
        n = max(len(v) for v in by_rank.values())
        for k in range(n):
            calls = {r: (by_rank[r][k] if k < len(by_rank[r]) else None) for r in ranks}
            names = {r: c[0] if c else None for r, c in calls.items()}
            if len(set(names.values())) != 1:
                desc = ", ".join(f"rank {r}: {x}" for r, x in names.items())
                raise ConformanceError(f"collective #{k} on {key} differs between its members "
                                       f"({desc}); rule: one launch order on every member")


def ideal_records(sg: StepGraph) -> dict[int, list[dict[str, Any]]]:
    """The records of a run that follows ``sg`` exactly: per rank, each action's start, then
    its launches, actions in program order (an OVERLAP_B_F step: forward side first, its
    all-to-alls in the graph's launch order)."""
    g = sg.graph
    index = {t.id: i for i, t in enumerate(g.tasks())}  # insertion order = launch order
    out: dict[int, list[dict[str, Any]]] = {}
    for rank, acts in sg.actions.items():
        rows: list[tuple[Any, int, dict[str, Any]]] = []
        for action, ids in acts.items():
            if not _is_message(g, ids):
                rows.append((min(index[i] for i in ids) - 0.5, 0,
                             {"op": "task", "task": action}))
            for tid in ids:
                t = g.task(tid)
                c = t.comm
                if c is None:
                    continue
                op = t.meta.get("op")
                if c.op == "collective":
                    name, ranks = str(c.key).split("[")
                    members = tuple(int(x) for x in ranks.rstrip("]").split(","))
                else:
                    name = t.lane.split(":")[1]
                    members = ()
                rows.append((index[tid], 1, {
                    "op": c.op, "task": None if name == "pp" else action, "group": name,
                    "group_ranks": members, "peer": c.peer, "nbytes": int(c.nbytes or 0),
                    "label": action if name == "pp" else (op.label or op.name),
                    "collective": op.collective if op is not None else None, "thread": ""}))
        rows.sort(key=lambda x: x[0])
        out[rank] = [r for _, _, r in rows]
    return out
