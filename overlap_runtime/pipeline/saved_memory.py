"""SavedTensorMeter: bytes of activations held for the backward, measured on any device.

Activation memory of a pipeline schedule is what autograd saves between a microbatch's forward
and its backward, plus what pending deferred-W tasks hold. The meter sees the first through
``torch.autograd.graph.saved_tensors_hooks`` (every tensor packed by autograd, each storage
counted once while any graph still holds it; parameters and views of them are excluded, they
are not activations)
and the second through :meth:`DeferredWQueue.held_storages`. ``sample()`` takes the current
total and keeps the peak; call it between actions (the schedule's custom functions are a good
place), so the peak is over the states the schedule holds between steps of its program.

Limits: transient buffers inside one op (the gradient being computed) are not seen; tensors
kept outside autograd (a stage's received input buffer once consumed) are not counted.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import torch
from torch import nn

from .deferred_w import DeferredWQueue


class _Held:
    """A saved tensor packed by the meter; un-counts itself when autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, meter: "SavedTensorMeter", tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.meter = meter
        s = tensor.untyped_storage()
        self.key = (str(tensor.device), s.data_ptr())
        meter._add(self.key, s.nbytes())

    def __del__(self) -> None:
        self.meter._remove(self.key)


class SavedTensorMeter:
    """Context manager: ``with SavedTensorMeter(queues=[q]) as meter: ... meter.sample()``.

    ``current`` / ``peak`` are bytes. Thread-safe counting; the hooks apply to autograd work
    of the thread that entered the context (torch keeps them thread-local).
    """

    def __init__(self, queues: Iterable[DeferredWQueue] = ()) -> None:
        self.queues = list(queues)
        self.peak = 0
        self._refs: dict[tuple[str, int], list[int]] = {}  # key -> [count, nbytes]
        self._lock = threading.Lock()
        self._hooks: Any = None

    def _add(self, key: tuple[str, int], nbytes: int) -> None:
        with self._lock:
            entry = self._refs.setdefault(key, [0, nbytes])
            entry[0] += 1
            entry[1] = max(entry[1], nbytes)

    def _remove(self, key: tuple[str, int]) -> None:
        with self._lock:
            entry = self._refs.get(key)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._refs[key]

    def _pack(self, t: torch.Tensor) -> Any:
        # parameters and views of them (``weight.t()`` saved by addmm) are not activations
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        return _Held(self, t)

    @staticmethod
    def _unpack(h: Any) -> torch.Tensor:
        return h.tensor if isinstance(h, _Held) else h

    @property
    def current(self) -> int:
        """Bytes held now: saved by autograd or by pending W tasks, each storage once."""
        with self._lock:
            storages = {k: v[1] for k, v in self._refs.items()}
        for q in self.queues:
            storages.update(q.held_storages())
        return sum(storages.values())

    def sample(self) -> int:
        """Record the current total; returns it."""
        now = self.current
        self.peak = max(self.peak, now)
        return now

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
