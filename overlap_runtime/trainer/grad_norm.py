"""Global gradient norm and clipping over every parallel dimension of the trainer.

``torch.nn.utils.clip_grad_norm_`` sees the parameters of one rank. Under the trainer's layout a
rank holds

* FSDP2 shards (DTensors placed ``Shard(0)`` over ``dp_shard x cp``, ``(Replicate, Shard(0))``
  under HSDP) of the parameters of its pipeline stages only, and
* of the routed experts only those of its EP rank (``num_experts / ep`` of them), themselves
  FSDP shards over ``efsdp``.

The squared norm of the whole model is therefore the sum of squares of the local shards,
all-reduced over each parameter's *sharded* mesh dimensions (never a replicated one: that
would count a replica twice), plus, for the routed experts, over the EP group (each EP rank
holds other experts), plus over the pipeline group (each pipeline rank holds other layers).
Clipping then multiplies every local gradient by ``min(1, max_norm / (norm + 1e-6))``, the
coefficient ``torch.nn.utils.clip_grad_norm_`` uses, so a single device and the parallel run
clip identically.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _sq_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares (fp32, 0-dim, on ``device``) of ``tensors``: one multi-tensor norm
    kernel (``torch._foreach_norm``, fp32 accumulation) instead of two kernels per tensor."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float32)
    return torch.stack(norms).to(device).square().sum()


def _local_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares (fp32, on ``device``) of the local pieces of ``grads``, reduced over sharded
    mesh dims. Stays on the device: no host round trip (the loop reads the norm once, after the
    optimizer step has been queued)."""
    plain: list[torch.Tensor] = []
    by_mesh: dict[tuple[int, tuple[int, ...]], tuple[object, list[torch.Tensor]]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            sharded = tuple(i for i, p in enumerate(g.placements) if isinstance(p, Shard))
            key = (id(g.device_mesh), sharded)
            by_mesh.setdefault(key, (g.device_mesh, []))[1].append(g.to_local())
        else:
            plain.append(g)
    total = _sq_sum(plain, device)
    for (_, sharded), (mesh, locals_) in by_mesh.items():
        sq = _sq_sum(locals_, device)
        for dim in sharded:
            dist.all_reduce(sq, group=mesh.get_group(dim))  # type: ignore[attr-defined]
        total = total + sq
    return total


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None,
                   expert_params: Iterable[torch.nn.Parameter] = (),
                   ep_group: dist.ProcessGroup | None = None,
                   pp_group: dist.ProcessGroup | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Global L2 norm of every gradient of the model (before clipping); clips in place.

    Args:
        params: this rank's parameters except the routed experts' (plain tensors or DTensors).
        max_norm: clip threshold; None: measure only.
        expert_params: this rank's routed-expert parameters (summed over ``ep_group`` too).
        ep_group, pp_group: the EP and pipeline groups (None: not used / size 1).
        device: where the collectives run (the rank's device).

    Returns:
        The norm, a 0-dim fp32 tensor on ``device``, identical on every rank. Nothing here waits
        for the device: the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` (1 when the
        norm is not finite: no clipping, the loop's finiteness check then stops the run) is a
        device tensor, applied in one ``_foreach_mul_`` over the local gradient pieces.
    """
    params = [p for p in params if p.grad is not None]
    expert_params = [p for p in expert_params if p.grad is not None]
    dev = torch.device(device)
    sq = _local_sq([p.grad for p in params], dev)  # type: ignore[misc]
    esq = _local_sq([p.grad for p in expert_params], dev)  # type: ignore[misc]
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(esq, group=ep_group)
    sq = sq + esq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in (*params, *expert_params)]
        if grads:
            torch._foreach_mul_([g.detach() for g in grads], coef)  # type: ignore[union-attr]
    return norm
