"""Who is who in a process group, and which tensors its backend carries.

The one place where a rank inside a group becomes a global rank (:func:`global_rank`):
``torch.distributed``'s point-to-point calls take global ranks, while every caller here thinks
in ranks of its own group (CP rank, PP rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap_runtime.platform import BACKEND_FOR_KIND


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group`` (the default group when None)."""
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the default group when None)."""
    return dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """The global rank of rank ``rank_in_group`` of ``group`` (None: the default group).

    Raises ValueError when ``rank_in_group`` is not in ``[0, group size)``.
    """
    size = group_size(group)
    if not 0 <= rank_in_group < size:
        raise ValueError(f"rank {rank_in_group} is not a rank of a group of {size} ranks "
                         f"(expected 0 <= rank < {size})")
    if group is None or group is dist.GroupMember.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def check_device_backend(x: torch.Tensor, group: dist.ProcessGroup | None, op: str) -> None:
    """Raise ValueError, naming ``op``, when ``group``'s backend cannot carry ``x``'s device.

    gloo carries cpu tensors here; nccl cuda and hccl npu tensors.
    """
    backend = str(dist.get_backend(group))
    expected = BACKEND_FOR_KIND.get(x.device.type)
    if backend == "gloo" and x.device.type != "cpu":
        raise ValueError(f"{op}: tensor on {x.device} but the group's backend is gloo, which "
                         f"this runtime only uses for cpu tensors")
    if backend in ("nccl", "hccl") and expected != backend:
        raise ValueError(f"{op}: tensor on {x.device} but the group's backend is {backend}, "
                         f"which needs {'cuda' if backend == 'nccl' else 'npu'} tensors")
