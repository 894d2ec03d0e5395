"""The harness every distributed test uses: real gloo ranks, no mocks.

``run_ranks(fn, world_size)`` spawns ``world_size`` CPU ranks on gloo, runs
``fn(rank, world_size, *args)`` on each and returns their results in rank order. A rank that
raises fails the test with its traceback; a hang fails it at ``timeout_s`` naming the ranks still
running (with their Python stacks); every child is killed either way. ``failure_grace_s`` lets
the other ranks end on their own for that long after the first failure, so a test can read every
rank's error in ``RankFailedError.failures``.

``rel_l2(a, b)`` is the project's accuracy measure, ``||a - b|| / ||b||`` in float64.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from overlap_runtime.launch import RankFailedError, RankFailure, RanksTimeoutError, spawn

DEFAULT_TEST_TIMEOUT_S = 120.0

__all__ = ["run_ranks", "rel_l2", "assert_close_rel", "RankFailedError", "RankFailure",
           "RanksTimeoutError"]


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
