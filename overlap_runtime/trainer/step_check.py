"""The step graph in the trainer: validated before the first step, conformance after it.

``train.validate_step_graph`` (default true): every rank compiles the step graph of its
configuration (``stepgraph.compile_step``: pure Python, the same on every rank) and proves it
deadlock-free before the first step; rank 0 logs the task count. A layout whose graph would hold
more than ``train.step_graph_max_tasks`` tasks (``stepgraph.compose.estimate_tasks``; 500K
take about 12 s to build on one CPU core) is an error naming both fields, not a silent skip. ``train.check_conformance``
(default false; the multi-rank trainer tests turn it on): the first step runs with a
``StepRecorder`` active, then the ranks all-gather their records (bounded, JSON bytes) and every
rank checks them against the graph (``stepgraph.conformance``), raising the same
``ConformanceError`` everywhere on a mismatch.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator

import torch

from overlap_runtime.config.train import ConfigError
from overlap_runtime.ops import comm
from overlap_runtime.ops.step_record import StepRecorder, recording
from overlap_runtime.stepgraph.compose import compile_step, estimate_tasks
from overlap_runtime.stepgraph.conformance import check_conformance


class StepCheck:
    """Step-graph validation and the first step's conformance check of one rank.

    Args:
        config: the run's TrainConfig; dims: its built ParallelDims (meshes known).
        log: rank 0's log (None elsewhere).
    """

    def __init__(self, config: Any, dims: Any, log: Callable[[str], None] | None) -> None:
        self.config, self.dims, self._log = config, dims, log
        self.graph = None
        t = config.train
        if t.validate_step_graph or t.check_conformance:
            n = estimate_tasks(config)
            if n > t.step_graph_max_tasks:
                raise ConfigError(
                    f"train.validate_step_graph: the step graph of this layout has about {n:,} "
                    f"tasks, more than train.step_graph_max_tasks={t.step_graph_max_tasks:,} "
                    f"(every rank would build it before step 1). Set "
                    f"train.validate_step_graph: false (and check_conformance: false) and "
                    f"validate the layout offline with `overlap-runtime simulate`, or raise "
                    f"train.step_graph_max_tasks")
            self.graph = compile_step(config, validate=True, dims=dims)
            if log is not None:
                log(self.graph.summary())
        self._recorder: StepRecorder | None = None
        self._done = not t.check_conformance

    @contextlib.contextmanager
    def first_step(self) -> Iterator[None]:
        """Record the launches of the block when conformance is on and not yet checked."""
        if self._done:
            yield
            return
        names: dict[Any, str] = {}  # one group may serve two roles (cp == ep on 2 ranks)
        for n in ("cp", "ep", "pp") + (("cp_a2a", "cp_ring") if self.dims.cp_a2a else ()):
            g = self.dims.mesh(n).get_group()
            names[g] = f"{names[g]}|{n}" if g in names else n
        self._recorder = StepRecorder(names)
        with recording(self._recorder):
            yield

    def check(self, device: torch.device, timeout_s: float | None) -> None:
        """After the recorded step: gather every rank's record and check it (all ranks)."""
        if self._done or self._recorder is None:
            return
        self._done = True

        mine = json.dumps([e.to_dict() for e in self._recorder.entries]).encode()
        lengths = comm.all_gather(torch.tensor([len(mine)], dtype=torch.int64), 0, None,
                                  timeout_s)
        longest = int(lengths.max())
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        rows = comm.all_gather(buf, 0, None, timeout_s).view(-1, longest)
        records = {r: json.loads(bytes(rows[r, :int(lengths[r])].tolist()).decode())
                   for r in range(rows.shape[0])}
        assert self.graph is not None
        check_conformance(self.graph, records)
        if self._log is not None:
            launches = sum(e.get("op") != "task" for r in records.values() for e in r)
            self._log(f"step graph: step 1 conforms ({launches} launches recorded on "
                      f"{len(records)} ranks)")
