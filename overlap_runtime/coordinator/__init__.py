"""Coordinated comm/compute overlap of a forward and a backward chunk (seed 001, direction B).

See docs/coordinator.md for the timeline, the state machine and the failure semantics.
"""

from overlap_runtime.coordinator.coordinator import (
    BACKWARD_ROLES,
    FORWARD_ROLES,
    HOOK_LETTERS,
    HookCoordinator,
    HookEvent,
    Role,
    Side,
)
from overlap_runtime.coordinator.errors import (
    CoordinatorAborted,
    CoordinatorError,
    CoordinatorProtocolError,
    CoordinatorTimeout,
    LaunchOrderMismatch,
    WaitSite,
)
from overlap_runtime.coordinator.hooks import sync_hook
from overlap_runtime.coordinator.overlap import CommComputeOverlap
from overlap_runtime.coordinator.serializer import (
    CommSerializer,
    LaunchRecord,
    SerializedHandle,
    compare_launch_logs,
)

__all__ = [
    "BACKWARD_ROLES",
    "FORWARD_ROLES",
    "HOOK_LETTERS",
    "CommComputeOverlap",
    "CommSerializer",
    "CoordinatorAborted",
    "CoordinatorError",
    "CoordinatorProtocolError",
    "CoordinatorTimeout",
    "HookCoordinator",
    "HookEvent",
    "LaunchOrderMismatch",
    "LaunchRecord",
    "Role",
    "SerializedHandle",
    "Side",
    "WaitSite",
    "compare_launch_logs",
    "sync_hook",
]
