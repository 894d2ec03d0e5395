"""ASCII renderings: the rank x step grid of programs and the simulated timeline.

``format_grid`` prints steps as rows and ranks as columns (like torch's
``_format_pipeline_order``) and marks offending cells with ``*``; long programs are cut to a
window around the marks. ``format_timeline`` draws one row per rank, one character per time
slot::

    rank 0 |FFFFFFFF......BBBBBBBB|
    rank 1 |.FFFFFFFF....BBBBBBBB.|
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from .simulate import SimulationResult


def format_grid(
    programs: Mapping[int, Sequence[str]],
    marks: set[tuple[int, int]] | None = None,
    *,
    max_rows: int = 48,
    max_ranks: int = 16,
) -> str:
    """Steps x ranks table of the cell texts; ``marks`` are ``(rank, step)`` cells to flag.

    With more than ``max_rows`` steps only a window around the first marked step is printed;
    with more than ``max_ranks`` ranks only ranks near the marked ones are.
    """
    marks = marks or set()
    ranks = sorted(programs)
    if not ranks:
        return "(empty schedule)"
    if len(ranks) > max_ranks:
        keep = set(ranks[:2]) | set(ranks[-2:])
        for r, _ in marks:
            keep |= {r - 1, r, r + 1}
        ranks = [r for r in ranks if r in keep][: max_ranks * 2]
    n_steps = max((len(programs[r]) for r in ranks), default=0)
    marked_steps = sorted({s for _, s in marks})
    if n_steps <= max_rows:
        lo, hi = 0, n_steps
    else:
        center = marked_steps[0] if marked_steps else 0
        lo = max(0, center - max_rows // 2)
        hi = min(n_steps, lo + max_rows)
        lo = max(0, hi - max_rows)

    def cell(rank: int, step: int) -> str:
        prog = programs[rank]
        text = prog[step] if step < len(prog) else ""
        if (rank, step) in marks:
            return f"*{text}*"
        return text

    label_w = len(f"step {max(n_steps - 1, 0)}")
    widths = {
        r: max([len(f"rank {r}")] + [len(cell(r, s)) for s in range(lo, hi)]) for r in ranks
    }
    lines = [" " * (label_w + 2) + " ".join(f"{'rank ' + str(r):<{widths[r]}}" for r in ranks)]
    if lo > 0:
        lines.append(f"... {lo} earlier steps")
    for s in range(lo, hi):
        row = f"{'step ' + str(s):<{label_w}}: " + " ".join(
            f"{cell(r, s):<{widths[r]}}" for r in ranks
        )
        if s in marked_steps:
            row = row.rstrip() + "   <-- here"
        lines.append(row.rstrip())
    if hi < n_steps:
        lines.append(f"... {n_steps - hi} later steps")
    if len(ranks) < len(programs):
        lines.append(f"({len(programs) - len(ranks)} ranks not shown)")
    return "\n".join(lines)


def format_timeline(result: "SimulationResult", *, width: int = 100, comm: bool = False) -> str:
    """One row per rank: the letter of the compute kind running in each time slot.

    A slot shows the task that covers most of it (``.`` when the device is idle); compute kinds
    print their first letter (``F``, ``B``, ``I``, ``W``). With ``comm=True`` a second row per
    rank shows communication (``s`` send, ``r`` receive, ``c`` collective).
    """
    span = result.makespan
    if span <= 0:
        return "(empty timeline)"
    slots = max(1, width)
    dt = span / slots
    lines = []
    for rank in sorted(result.ranks):
        rows = [("", False)] + ([(" comm", True)] if comm else [])
        for suffix, want_comm in rows:
            cover = [0.0] * slots
            chars = ["."] * slots
            for e in result.entries_by_rank.get(rank, ()):
                if e.is_comm != want_comm or e.end <= e.start:
                    continue
                ch = _char(e.kind, e.comm_op)
                first = int(e.start / dt)
                last = min(slots - 1, int((e.end - 1e-12) / dt))
                for k in range(first, last + 1):
                    ov = min(e.end, (k + 1) * dt) - max(e.start, k * dt)
                    if ov > cover[k]:
                        cover[k], chars[k] = ov, ch
            lines.append(f"rank {rank:<3}{suffix:<5}|{''.join(chars)}|")
    lines.append(f"{'':<13} 0{'':>{max(0, slots - len(f'{span:g}') - 1)}}{span:g}")
    return "\n".join(lines)


def _char(kind: str, comm_op: str | None) -> str:
    if comm_op == "send":
        return "s"
    if comm_op == "recv":
        return "r"
    if comm_op == "collective":
        return "c"
    return kind[:1].upper() if kind else "?"
