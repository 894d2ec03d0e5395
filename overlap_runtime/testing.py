"""The harness every distributed test uses: real gloo ranks, no mocks.

``run_ranks(fn, world_size)`` spawns ``world_size`` CPU ranks on gloo, runs
``fn(rank, world_size, *args)`` on each and returns their results in rank order. A rank that
raises fails the test with its traceback; a hang fails it at ``timeout_s`` naming the ranks still
running (with their Python stacks); every child is killed either way. ``failure_grace_s`` lets
the other ranks end on their own for that long after the first failure, so a test can read every
rank's error in ``RankFailedError.failures``.

``Concurrently({name: scenario})`` starts independent scenarios in background threads at once, a
few at a time, and hands each test its own scenario's result (or exception): scenarios that
mostly wait (a peer running into its timeout, a sleeping rank, a torchrun launcher) then wait
together instead of one after another.

``rel_l2(a, b)`` is the project's accuracy measure, ``||a - b|| / ||b||`` in float64.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait
from typing import Any, Callable, Sequence

import torch

from overlap_runtime.launch import RankFailedError, RankFailure, RanksTimeoutError, spawn

DEFAULT_TEST_TIMEOUT_S = 120.0

__all__ = ["run_ranks", "Concurrently", "rel_l2", "assert_close_rel", "RankFailedError",
           "RankFailure", "RanksTimeoutError"]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    failure_grace_s: float = 0.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo CPU ranks; see module doc."""
    return spawn(fn, world_size, args=args, backend="gloo", device="cpu", timeout_s=timeout_s,
                 env=env, failure_grace_s=failure_grace_s)


class Concurrently:
    """Scenarios started at once in ``max_workers`` background threads; ``result(name)`` waits
    for one (at most ``timeout_s``) and returns its value or raises its exception.

    For a module-scoped fixture: each test asserts on its own scenario, so a failure still
    names that test, while the scenarios' waits overlap. Every scenario must bound its own
    waits (``run_ranks`` and ``subprocess.run(timeout=...)`` do); ``close()`` (or leaving a
    ``with`` block) cancels the ones not started and waits for the running ones, at most
    ``timeout_s`` (a ``TimeoutError`` naming those still running otherwise).
    """

    def __init__(self, scenarios: dict[str, Callable[[], Any]], max_workers: int = 2,
                 timeout_s: float = 600.0) -> None:
        if max_workers < 1:
            raise ValueError(f"Concurrently: max_workers must be >= 1, got {max_workers}")
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="overlap_runtime-scenario")
        self._futures: dict[str, Future[Any]] = {n: self._pool.submit(f)
                                                  for n, f in scenarios.items()}

    def result(self, name: str) -> Any:
        """The value ``scenarios[name]()`` returned; its exception is raised here."""
        if name not in self._futures:
            raise KeyError(f"Concurrently: no scenario {name!r} (have {sorted(self._futures)})")
        try:
            return self._futures[name].result(timeout=self.timeout_s)
        except FutureTimeoutError:
            raise TimeoutError(f"Concurrently: scenario {name!r} still running after "
                               f"{self.timeout_s:.0f}s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        _, pending = wait(list(self._futures.values()), timeout=self.timeout_s)
        if pending:
            names = sorted(n for n, f in self._futures.items() if f in pending)
            raise TimeoutError(f"Concurrently: scenarios {names} still running at close after "
                               f"{self.timeout_s:.0f}s")

    def __enter__(self) -> Concurrently:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_2 / ||b||_2`` in float64; 0 when both are zero, inf when only ``b`` is."""
    if a.shape != b.shape:
        raise ValueError(f"rel_l2: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64 = a.detach().to(torch.float64).cpu()
    b64 = b.detach().to(torch.float64).cpu()
    num = torch.linalg.vector_norm(a64 - b64).item()
    den = torch.linalg.vector_norm(b64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, tol: float, what: str = "tensor") -> float:
    """Assert ``rel_l2(a, b) <= tol`` and return it; the message names ``what`` and the figure."""
    err = rel_l2(a, b)
    if not err <= tol:
        raise AssertionError(f"{what}: rel-L2 {err:.3e} > {tol:.1e}")
    return err
