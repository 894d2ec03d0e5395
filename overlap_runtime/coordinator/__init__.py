"""Coordinated comm/compute overlap of a forward and a backward chunk on one rank: their
all-to-alls take turns, each hidden behind the other chunk's compute.

What a user needs: :class:`HookCoordinator` (the comm-token state machine; owns a
:class:`CommSerializer`), :func:`sync_hook` (the A/B/C/D/D_LAST markers a layer places around
its all-to-alls), :class:`CommComputeOverlap` (runs the forward in the calling thread and the
backward in a worker), :class:`Side` (which of the two a hook or a failure belongs to) and the
errors, all :class:`CoordinatorError`. Internals (the role tables ``FORWARD_ROLES`` /
``BACKWARD_ROLES`` / ``HOOK_LETTERS``, ``Role``, ``HookEvent``, ``WaitSite``, ``LaunchRecord``,
``SerializedHandle``, ``compare_launch_logs``) are imported from their modules. See
docs/coordinator.md for the timeline, the state machine and the failure semantics.

May import: the standard library, torch, ``overlap_runtime.platform`` and
``overlap_runtime.ops`` (the all-to-all it serialises). Never ``graph``, ``schedules``,
``pipeline``, ``moe`` or anything above (``moe`` imports this).
"""

from overlap_runtime.coordinator.coordinator import HookCoordinator, Side
from overlap_runtime.coordinator.errors import (
    CoordinatorAborted,
    CoordinatorError,
    CoordinatorProtocolError,
    CoordinatorTimeout,
    LaunchOrderMismatch,
)
from overlap_runtime.coordinator.hooks import sync_hook
from overlap_runtime.coordinator.overlap import CommComputeOverlap
from overlap_runtime.coordinator.serializer import CommSerializer

__all__ = [
    "CommComputeOverlap",
    "CommSerializer",
    "CoordinatorAborted",
    "CoordinatorError",
    "CoordinatorProtocolError",
    "CoordinatorTimeout",
    "HookCoordinator",
    "LaunchOrderMismatch",
    "Side",
    "sync_hook",
]
