"""Launch-ahead: the host launches step n+1's forward and backward before it waits for step n.

Without it every step ends with the host waiting for the device (the step's loss and gradient
norm are read as numbers) and the next step starts on an idle device: everything the host does
before the device has work again (the next batch's copies, FSDP's pre-forward casts, the first
launches of compiled graphs, the optimizer's host-bound tail) is device idle time in every step.

With it (``train.launch_ahead``, the default) the loop of step ``n`` is::

    launch forward + backward of n         the device is still busy with n-1's tail
    finish n-1                             wait for n-1's end marker (polled, bounded), read its
                                           loss and grad norm from host memory, metrics,
                                           finiteness check, checkpoint
    launch grad norm + clip + optimizer of n; copy n's loss and norm to host memory behind
                                           them, record n's end marker

so no optimizer update is launched before the step before it was checked finite, and the
device always has the next step's work queued while the host reads numbers. A step is
*drained* (finished before the next launch) where the next launches would change what its
callbacks see: a checkpoint save (the RNG and data state of the save), the profiler window's
edges, the last step. The caller turns launch-ahead off where the step's observers read state
that the next forward writes (the execution trace, MoE load counters).

Step time: host wall time between the finishes of two consecutive steps (the device's steady
period once it never waits); a step launched on a drained device counts from the drain, its
launch latency included. On the CPU every op is synchronous and the result is the same as
without launch-ahead, step for step (what the gloo tests check).

The batch's host-to-device copies must not wait for the device (a copy from pageable memory
waits for the stream, which then holds the previous step's work): :func:`to_device` pins the
source and copies asynchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from overlap_runtime import platform

_POLL_S = 5e-5


@dataclass
class LaunchedStep:
    """A step whose work is queued and whose numbers are not read yet.

    Attributes:
        step: 1-based step.  lr: its learning rate.  tokens: labelled tokens of its global batch.
        scalars: ``[2]`` float32 ``(loss, grad norm)``, host memory (pinned on an accelerator),
            valid once ``done`` has completed.
        done: event recorded after the copy of ``scalars`` (a null event on the CPU).
    """

    step: int
    lr: float
    tokens: int
    scalars: torch.Tensor
    done: Any


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device`` without the host waiting for the device's queued work.

    A CPU tensor goes through pinned memory with a non-blocking copy (the caching host allocator
    keeps the pinned block until the copy has run); for a CPU ``device``, ``x`` itself; a tensor
    already on an accelerator is moved with a plain non-blocking ``to``.
    """
    if x.device.type != "cpu":
        return x.to(device, non_blocking=True)
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def _dense(x: torch.Tensor) -> torch.Tensor:
    full = getattr(x, "full_tensor", None)  # a DTensor norm: its global value
    return full() if full is not None else x


def queue_scalars(loss: torch.Tensor, norm: torch.Tensor, device: torch.device
                  ) -> tuple[torch.Tensor, Any]:
    """Queue the copy of ``(loss, grad norm)`` (one-element device tensors, any float dtype) to
    host memory behind the work launched so far; returns ``(host [2] float32, event)``."""
    both = torch.stack([loss.detach().reshape(()).float(),
                        _dense(norm).detach().reshape(()).float()])
    event = platform.new_event(device)
    if device.type == "cpu":
        return both, event
    host = torch.empty(2, dtype=torch.float32, pin_memory=True)
    host.copy_(both, non_blocking=True)
    event.record()
    return host, event


def wait_for(event: Any, timeout_s: float, what: str) -> None:
    """Poll ``event`` until it has completed; raise :class:`TimeoutError` naming ``what`` after
    ``timeout_s`` seconds (never an unbounded wait)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what} to finish on the device")
        time.sleep(_POLL_S)
