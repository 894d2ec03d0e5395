"""``overlap-runtime schedule``: build, check and simulate a pipeline schedule.

Example::

    overlap-runtime schedule --kind interleaved_1f1b --pp 4 --microbatches 8 --virtual 2 \\
        --overlap-b-f --trace trace.json --plot timeline.png

prints the steps x ranks grid of the lowered schedule, the simulated timeline and its bubble, then
which figure that is and the published formula's figure beside it, with why the two differ when
they do (:func:`_bubble_notes`), and writes a Chrome/Perfetto trace.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from ..graph import CostModel, format_grid, format_timeline, write_chrome_trace
from .bubbles import simulate_compute_only
from .compile import compile_spec
from .ir import dump_csv
from .registry import get_schedule_kind, schedule_kinds
from .spec import ScheduleSpec
from .torch_csv import to_torch_csv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the ``schedule`` subcommand (keep imports light: nothing heavy here; the
    registry is plain Python)."""

    parser.add_argument("--kind", default="1f1b",
                        help=f"schedule kind: {', '.join(schedule_kinds())} (default 1f1b)")
    parser.add_argument("--placement", choices=["loop", "v"], default=None,
                        help="stage placement (default: loop; dualpipev needs v)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=8,
                        help="microbatches per step (default 8)")
    parser.add_argument("--virtual", "-v", type=int, default=1,
                        help="stages (model chunks) per rank (default 1)")
    parser.add_argument("--overlap-b-f", action="store_true",
                        help="pair steady-state B_i with the next F into OVERLAP_B_F steps")
    parser.add_argument("--no-overlap-p2p", action="store_true",
                        help="SEND/RECV block the compute lane instead of using a comm lane")
    parser.add_argument("--split-backward", action="store_true",
                        help="run each backward as I (input grad) then W (weight grad)")
    parser.add_argument("--spec", metavar="FILE",
                        help="read the ScheduleSpec from YAML/JSON (overrides the flags above)")
    parser.add_argument("--cost-f", type=float, default=1.0, help="cost of F (default 1)")
    parser.add_argument("--cost-b", type=float, default=2.0, help="cost of B (default 2)")
    parser.add_argument("--cost-i", type=float, default=1.0, help="cost of I (default 1)")
    parser.add_argument("--cost-w", type=float, default=1.0, help="cost of W (default 1)")
    parser.add_argument("--comm-latency", type=float, default=0.0,
                        help="latency of one SEND (default 0)")
    parser.add_argument("--trace", default="trace.json", metavar="PATH",
                        help="Chrome/Perfetto trace to write (default trace.json; '' to skip)")
    parser.add_argument("--csv", metavar="PATH",
                        help="also write the compute-only schedule as torch-format CSV")
    parser.add_argument("--csv-format", choices=["ours", "torch"], default="ours",
                        help="'torch': write OVERLAP_B_F pairs as torch's (F;B)OVERLAP_F_B, the "
                             "form _PipelineScheduleRuntime._load_csv loads (default ours)")
    parser.add_argument("--plot", metavar="PNG", help="draw the timeline (needs matplotlib)")
    parser.add_argument("--no-grid", action="store_true", help="do not print the action grid")
    parser.add_argument("--width", type=int, default=100, help="timeline width in characters")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    for flag in ("--cost-f", "--cost-b", "--cost-i", "--cost-w", "--comm-latency"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(value) and value >= 0):
            print(f"error: {flag}={value} must be a finite number >= 0", file=sys.stderr)
            return 2
    try:
        if args.spec:
            spec = ScheduleSpec.from_file(args.spec)
        else:
            spec = ScheduleSpec(
                kind=args.kind, pp_size=args.pp, num_microbatches=args.microbatches,
                virtual_stages=args.virtual, overlap_b_f=args.overlap_b_f,
                overlap_p2p=not args.no_overlap_p2p, split_backward=args.split_backward,
                placement=args.placement or ("v" if args.kind == "dualpipev" else "loop"),
            )
        costs = CostModel(F=args.cost_f, B=args.cost_b, I=args.cost_i, W=args.cost_w,
                          comm_latency=args.comm_latency)
    except (ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing or unreadable --spec file
        print(f"error: cannot read --spec {args.spec}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # yaml.YAMLError: not a ValueError
        if type(exc).__module__.split(".")[0] != "yaml":
            raise
        print(f"error: --spec {args.spec} is not valid YAML: {exc}", file=sys.stderr)
        return 2
    for flag in ("--plot", "--csv", "--trace"):
        problem = _output_problem(getattr(args, flag[2:], None))
        if problem:
            print(f"error: {flag} {getattr(args, flag[2:])}: {problem}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib; install the viz extra: "
                  "pip install 'overlap_runtime[viz]'", file=sys.stderr)
            return 2

    compiled = compile_spec(spec)
    result = compiled.simulate(costs)
    p, m, v = spec.pp_size, spec.num_microbatches, spec.virtual_stages
    print(f"schedule {spec.kind}: pp={p} microbatches={m} virtual={v} "
          f"overlap_b_f={spec.overlap_b_f} overlap_p2p={spec.overlap_p2p} "
          f"split_backward={spec.split_backward}")
    if not args.no_grid:
        print(format_grid(compiled.graph.programs, max_rows=10**9, max_ranks=10**9))
        print()
    print(format_timeline(result, width=args.width, comm=costs.comm_latency > 0))
    print()
    print(f"makespan {result.makespan:g}  bubble {result.bubble_ratio:.4f}  "
          f"exposed comm {result.exposed_comm:g}")
    for line in _bubble_notes(spec, costs, result):
        print(line)
    if args.trace:
        write_chrome_trace(result, args.trace, pairs=compiled.comm_pairs)
        print(f"wrote {args.trace}")
    if args.csv:
        if args.csv_format == "torch":
            to_torch_csv(compiled.compute, args.csv)
        else:
            dump_csv(compiled.compute, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        _plot(result, args.plot, title=f"{spec.kind} pp={p} m={m} v={v}")
        print(f"wrote {args.plot}")
    return 0


_SAME = 5e-5  # ratios printed with 4 decimals: closer than this reads as equal


def _bubble_notes(spec: Any, costs: Any, result: Any) -> list[str]:
    """Two lines under the makespan: which bubble figure is printed (the simulated timeline, and
    under which costs), then the kind's published bubble (``ScheduleKind.published_bubble``)
    and, when the two differ, why.

    Args:
        spec: the ``ScheduleSpec``.  costs: the ``CostModel`` simulated.  result: the
        ``SimulationResult`` of the lowered schedule under ``costs``.
    """
    c = costs
    lane = "a comm lane" if spec.overlap_p2p else "the compute lane"
    lines = [f"bubble = idle / (ranks x makespan) of the simulated timeline above (the lowered "
             f"schedule, SEND/RECV on {lane} per rank; F={c.F:g} B={c.B:g} I={c.I:g} W={c.W:g}, "
             f"SEND latency {c.comm_latency:g}); the published formulas take free communication"]
    kind = get_schedule_kind(spec.kind)
    if kind.published_bubble is None:
        return lines + [f"no published bubble formula for kind {spec.kind!r}"]
    pub = kind.published_bubble(
        spec, c, lambda unit: simulate_compute_only(spec, c, overlapped_as_unit=unit).bubble_ratio)
    why = list(pub.why_different)
    if c.comm_latency > 0:
        why.insert(0, f"each SEND takes {c.comm_latency:g} here ({result.exposed_comm:g} exposed "
                      f"on the worst rank)")
    head = f"published {kind.published or kind.name}: {pub.ratio:.4f} = {pub.formula}"
    if abs(result.bubble_ratio - pub.ratio) < _SAME:
        return lines + [f"{head}; the simulation gives it"]
    if not why:
        why.append("with these costs the schedule's order is not the one the formula counts")
    where = f" (docs/schedules.md section {kind.docs_section})" if kind.docs_section else ""
    return lines + [f"{head}; the simulated {result.bubble_ratio:.4f} differs: " + "; ".join(why)
                    + where]


def _output_problem(path: str | None) -> str | None:
    """Why ``path`` cannot be written (checked before any work), or None."""
    if not path:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"its directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"its directory {parent} is not writable"
    if os.path.isdir(path):
        return "is a directory"
    return None


def _plot(result, path: str, title: str) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8172b3"}
    ranks = result.ranks
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * len(ranks)))
    for e in result.entries:
        if e.end <= e.start:
            continue
        y = ranks.index(e.rank)
        if e.is_comm:
            ax.broken_barh([(e.start, e.end - e.start)], (y + 0.3, 0.35), color="#999999")
            continue
        ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.7),
                       color=colors.get(e.kind, "#55a868"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{title}: bubble {result.bubble_ratio:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
