"""Interpreter children that each run a GROUP of a test module's cases, each test still asserting
its own case's result. A child is forked (:class:`tests.support.forked_child.ForkedChild`:
torch and triton imported once per test process, not per child).

A cases module (``python -m tests.support.<script> CASE [CASE ...]``) ends with
``run_cases(sys.argv[1:], run)``: every case runs in turn and prints one line
``RESULT <case> <json>``; a case that raises prints its traceback to stderr and
``FAILED <case> <json traceback>`` and the others still run (the child then exits 1).

:class:`GroupedCases` is the parent side (``start``, ``result``, ``close``; use it with
``gdn.children_fixture``): ``start``
splits the selected cases into one group per worker (one group under pytest-xdist, where the
worker process already holds a core; two otherwise: ``gdn._default_workers``), balanced by an
estimated cost per case, and starts their children at once; ``result(case)`` returns that
case's dict as soon as its line is printed (the group's later cases run on meanwhile).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

from tests.support.forked_child import ForkedChild
from tests.support.gdn import _default_workers


def run_cases(cases: list[str], run: Callable[[str], dict]) -> None:
    """The child's main: ``run(case)`` for each case, one ``RESULT <case> <json>`` line each
    (``FAILED <case> <json traceback>`` for a case that raises, the traceback on stderr too);
    exits 1 if any failed."""
    failed = []
    for case in cases:
        started = time.process_time()
        try:
            result = run(case)
        except Exception:  # noqa: BLE001 - reported, and the remaining cases still run
            error = traceback.format_exc()
            print(f"--- case {case} failed:\n{error}", file=sys.stderr, flush=True)
            print(f"FAILED {case} {json.dumps(error)}", flush=True)
            failed.append(case)
            continue
        print(f"RESULT {case} {json.dumps(result)}", flush=True)
        print(f"case {case}: {time.process_time() - started:.2f} s CPU", file=sys.stderr,
              flush=True)
    sys.exit(1 if failed else 0)


class _Child:
    """One ``python -m tests.support.<script> *cases`` child (forked) whose output is read as it
    comes (two reader threads), so that each case's result is available once printed."""

    def __init__(self, script: str, cases: list[str], timeout_s: float) -> None:
        self.script, self.cases = script, cases
        self.proc = ForkedChild(script, *cases)
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.timed_out = False
        self._cond = threading.Condition()
        self._results: dict[str, str] = {}
        self._failed: dict[str, str] = {}
        self._out: list[str] = []
        self._err: list[str] = []
        self._open = 2  # streams not yet at their end
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self._out), (self.proc.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:  # noqa: ANN001
        for line in stream:
            with self._cond:
                lines.append(line)
                if lines is self._out:
                    head, _, rest = line.rstrip("\n").partition(" ")
                    if head == "RESULT":
                        case, _, payload = rest.partition(" ")
                        self._results[case] = payload
                    elif head == "FAILED":
                        case, _, payload = rest.partition(" ")
                        self._failed[case] = payload
                self._cond.notify_all()
        with self._cond:
            self._open -= 1
            self._cond.notify_all()

    def _wait(self, done: Callable[[], bool]) -> bool:
        """Wait (holding the lock on return) until ``done()`` or both streams ended or the
        deadline; True when ``done()``."""
        while not done() and self._open:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
        return done()

    def _output(self) -> str:
        return f"stdout:\n{''.join(self._out)[-3000:]}\nstderr:\n{''.join(self._err)[-6000:]}"

    def result(self, case: str) -> dict:
        with self._cond:
            self._wait(lambda: case in self._results or case in self._failed)
            found, error = case in self._results, self._failed.get(case)
        if error is not None:  # the case raised; the group's other cases run on
            raise AssertionError(f"{self.script} {case} (group {' '.join(self.cases)}) raised:\n"
                                 f"{json.loads(error)}")
        if not found:
            if self.proc.poll() is None and time.monotonic() >= self.deadline:
                self.timed_out = True
            self.kill()
            with self._cond:
                why = (f"no result within {self.timeout_s:.0f} s (the group's limit; killed)"
                       if self.timed_out else f"no result (exit code {self.proc.returncode})")
                raise AssertionError(f"{self.script} {case} (group {' '.join(self.cases)}): "
                                     f"{why}\n{self._output()}")
        if case == self.cases[-1]:  # the last case: the child must also exit cleanly
            with self._cond:
                self._wait(lambda: False)
            try:
                code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
                self.kill()
            with self._cond:
                assert code == 0 or self._failed, (
                    f"{self.script} {' '.join(self.cases)}: every case printed its result but "
                    f"the child exited with {code}\n{self._output()}")
        with self._cond:
            return json.loads(self._results[case])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for reader in self._readers:
            reader.join(timeout=30)


def _partition(cases: list[str], groups: int, cost: dict[str, float]) -> list[list[str]]:
    """``cases`` into at most ``groups`` lists of about equal total cost (the costliest case
    first into the lightest group), each list in the given order."""
    loads = [[0.0, []] for _ in range(max(1, min(groups, len(cases))))]
    for case in sorted(cases, key=lambda c: -cost.get(c, 1.0)):
        lightest = min(loads, key=lambda load: load[0])
        lightest[0] += cost.get(case, 1.0)
        lightest[1].append(case)
    order = {c: i for i, c in enumerate(cases)}
    return [sorted(members, key=order.__getitem__) for _, members in loads if members]


class GroupedCases:
    """The interpreter children of one test module's cases, a group of cases per child.

    ``timeout_s`` bounds each case (a group's child may run ``timeout_s`` times its number of
    cases, then it is killed and its unfinished cases fail); ``cost``: estimated seconds per
    case for balancing the groups (1 for a case not named)."""

    def __init__(self, script: str, timeout_s: float = 300, workers: int | None = None,
                 cost: dict[str, float] | None = None) -> None:
        self.script, self.timeout_s = script, timeout_s
        self.workers = _default_workers() if workers is None else workers
        self.cost = dict(cost or {})
        self._child_of: dict[str, _Child] = {}

    def start(self, cases: list[str]) -> None:
        new = [c for c in dict.fromkeys(cases) if c not in self._child_of]
        for group in _partition(new, self.workers, self.cost) if new else []:
            child = _Child(self.script, group, self.timeout_s * len(group))
            self._child_of.update(dict.fromkeys(group, child))

    def result(self, case: str) -> dict:
        if case not in self._child_of:  # not started with the module's selection: run it now
            self.start([case])
        return self._child_of[case].result(case)

    def close(self) -> None:
        """Kill what still runs (a module whose tests were deselected or failed early)."""
        for child in set(self._child_of.values()):
            child.kill()
        self._child_of.clear()
