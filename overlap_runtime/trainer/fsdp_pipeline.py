"""FSDP2 around a pipeline step: gather once, accumulate every microbatch, reduce once.

A pipeline step runs a stage's forward and backward once per microbatch, and with
``overlap_b_f`` the forward of one microbatch and the backward of another run on two threads
at once, often through the *same* FSDP unit (1F1B pairs microbatches of one stage). FSDP2's
hooks keep a per-unit state machine (``FORWARD`` / ``PRE_BACKWARD`` / ``POST_BACKWARD``) that
is not made for that: a forward's post-hook that finds the unit in a backward state reshards
it (frees the parameters) under the other thread's feet. And if FSDP gathered and reduced in
each microbatch, the two threads would issue collectives on one group in an order that depends
on timing, which can differ between ranks.

So :class:`GatheredStep` (used around
:meth:`~overlap_runtime.pipeline.PipelineSchedule.step`) takes FSDP out of the step itself:

on enter
    every FSDP unit of the rank's stages: gradient sync and resharding off, ``unshard()`` - the
    all-gathers run here, on the calling thread, in stage order, the same on every rank of the
    group - and its forward hooks are suspended (taken out of the module's hook dicts, so no
    FSDP state changes during the step). The stages then run on the gathered parameters like
    plain modules; autograd accumulates every microbatch's gradient on them.
on a normal exit
    the hooks are put back in their original order, then FSDP's post-backward of every
    parameter group (the reduce-scatter of the accumulated gradients into the sharded ones) and
    its end-of-backward callback run on the calling thread in stage order, and the units
    reshard. On an exception the hooks are put back and nothing is reduced.

Mixed precision: the stages compute in the unsharded parameters' dtype (``param_dtype``);
the gradients of the microbatches accumulate in that dtype too (FSDP's hooks would have
accumulated in ``reduce_dtype``), before the reduce-scatter in ``reduce_dtype``.

This reaches into FSDP2's state the way ``torch.distributed.pipelining``'s
``PipelineStage.perform_reduce_grad`` does (there is no public "reduce now" nor "suspend hooks"
API). :func:`check_fsdp_internals` verifies the members exist and fails naming the torch version
otherwise, before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _fsdp_units(modules: Sequence[nn.Module]) -> list[Any]:
    """The FSDP2 modules (``FSDPModule``) inside ``modules``, outermost first per module."""
    from torch.distributed.fsdp import FSDPModule

    out: list[Any] = []
    for m in modules:
        out.extend(x for x in m.modules() if isinstance(x, FSDPModule))
    return out


def _state(root: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(root)  # type: ignore[attr-defined]


def check_fsdp_internals(modules: Sequence[nn.Module]) -> None:
    """Raise RuntimeError naming the torch version if FSDP2's internals moved."""
    for root in _roots(modules):
        state = _state(root)
        ctx = getattr(state, "_state_ctx", None)
        ok = (ctx is not None and hasattr(ctx, "all_states")
              and callable(getattr(state, "_root_post_backward_final_callback", None))
              and callable(getattr(state, "_lazy_init", None)))
        for unit in _fsdp_units([root]):
            s = _state(unit)
            for name, hooks in (("_pre_forward_hook_handle", unit._forward_pre_hooks),
                                ("_post_forward_hook_handle", unit._forward_hooks)):
                handle = getattr(s, name, None)
                ok = ok and handle is not None and getattr(handle, "id", None) in hooks
        if ok:
            for s in ctx.all_states:
                for group in _param_groups(s):
                    ok = ok and callable(getattr(group, "post_backward", None))
        if not ok:
            raise RuntimeError(
                f"torch {torch.__version__}: FSDP2's state no longer has _state_ctx.all_states / "
                f"_fsdp_param_groups[].post_backward / _root_post_backward_final_callback / "
                f"_lazy_init / _pre_forward_hook_handle / _post_forward_hook_handle, which the "
                f"pipeline trainer uses to gather once, suspend FSDP's hooks and reduce once per "
                f"step (trainer/fsdp_pipeline.py); tested with torch 2.13")


def _param_groups(state: Any) -> list[Any]:
    """FSDP param groups of one state (``_fsdp_param_groups`` in newer torch, one
    ``_fsdp_param_group`` before)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _roots(modules: Sequence[nn.Module]) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in modules if isinstance(m, FSDPModule)]


class GatheredStep:
    """Context manager of one pipeline step over FSDP units (see the module docstring).

    Args:
        modules: the rank's stage modules (FSDP roots), in stage order.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.roots = _roots(modules)
        self.units = _fsdp_units(self.roots)
        self._saved: list[tuple[dict[int, Any], dict[int, Any]]] = []

    def __enter__(self) -> "GatheredStep":
        for root in self.roots:
            _state(root)._lazy_init()  # what the root's first forward hook would do
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_is_last_backward(False)
        for unit in self.units:
            unit.unshard()
        for unit in self.units:
            state = _state(unit)
            for hooks, handle in ((unit._forward_pre_hooks, state._pre_forward_hook_handle),
                                  (unit._forward_hooks, state._post_forward_hook_handle)):
                self._saved.append((hooks, dict(hooks)))
                hooks.pop(handle.id)
        return self

    def _restore_hooks(self) -> None:
        for hooks, snapshot in reversed(self._saved):
            hooks.clear()
            hooks.update(snapshot)
        self._saved.clear()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore_hooks()
        if exc_type is not None:
            return
        for root in self.roots:
            for unit in _fsdp_units([root]):
                unit.set_requires_gradient_sync(True, recurse=False)
                unit.set_reshard_after_backward(True, recurse=False)
                unit.set_reshard_after_forward(True, recurse=False)
            root.set_is_last_backward(True)
            state = _state(root)
            for s in state._state_ctx.all_states:
                for group in _param_groups(s):
                    group.post_backward()
            state._root_post_backward_final_callback()
            root.reshard()
