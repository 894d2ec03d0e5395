"""Expert load counts of MoE layers over a training step, and the balance numbers made of them.

A :class:`ExpertLoadStats` is a sink the trainer gives to every MoE layer
(``MoE.count_load(stats, layer)``); each forward adds, for its layer:

* ``counts[e]``: token slots the router sent to expert ``e`` (``bincount(top_indices)``, ``[E]``
  int64, kept on the tokens' device so no forward synchronises),
* ``routed``: slots routed, ``N * k`` for ``N`` tokens,
* ``processed``: rows the experts of this rank received after the dispatch (the sum of the
  dispatcher's ``tokens_per_expert``; with EP these are rows sent by every EP rank).

Summed over all ranks (``ExpertLoadStats.reduce``: one all-reduce of ``[layers, E + 2]``), a
layer's ``routed - processed`` is the number of token slots dropped between the router and the
experts. The router has no capacity factor and the dispatcher sends every slot, so it is 0 by
construction; it is measured, not assumed, so a future capacity limit shows up.

Balance of a layer: ``max_e counts[e] / mean_e counts[e]`` (mean = routed / E): 1.0 is a perfectly
even load, ``E`` everything on one expert. :func:`balance_summary` gives the per-layer values, the
worst layer and the mean over layers.

Activation-checkpoint recompute replays the forward inside the backward; those replays are not
counted (``torch._C._current_graph_task_id() != -1`` while an autograd graph task runs in this
thread), so each token is counted once per step. Thread-safe: the two OVERLAP_B_F threads add
concurrently.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _in_recompute() -> bool:
    """True inside an autograd graph task of this thread (a checkpoint replay of the forward)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's load over the counted forwards (summed over ranks after ``reduce``).

    Attributes:
        counts: token slots per expert, ``E`` ints.  routed: slots the router assigned.
        processed: rows the experts received.
    """

    counts: tuple[int, ...]
    routed: int
    processed: int

    @property
    def dropped(self) -> int:
        """Slots routed but never processed (0 for this router and dispatcher)."""
        return self.routed - self.processed

    @property
    def balance(self) -> float | None:
        """``max(counts) / mean(counts)``; None when no token was routed."""
        total = sum(self.counts)
        if total == 0:
            return None
        return max(self.counts) * len(self.counts) / total


class ExpertLoadStats:
    """Per-layer expert load of the forwards since the last :meth:`reset` (module doc).

    Args:
        num_layers: layer indices ``add`` accepts are ``0 .. num_layers - 1`` (the model's
            decoder layer index, the same on every rank).
        num_experts: E, the global number of routed experts.
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self._lock = threading.Lock()
        self._counts: dict[int, torch.Tensor] = {}
        self._routed: dict[int, int] = {}
        self._processed: dict[int, int] = {}

    def add(self, layer: int, top_indices: torch.Tensor, processed: int) -> None:
        """Count one forward of ``layer``: ``top_indices`` ``[N, k]`` int64 global expert ids;
        ``processed``: rows its local experts received. Skipped during a recompute."""
        if _in_recompute():
            return
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"ExpertLoadStats.add: layer {layer} is not in [0, "
                             f"{self.num_layers})")
        counts = torch.bincount(top_indices.reshape(-1), minlength=self.num_experts)
        if counts.numel() != self.num_experts:
            raise ValueError(f"ExpertLoadStats.add: layer {layer} routed to expert "
                             f"{counts.numel() - 1}, but there are {self.num_experts} experts")
        with self._lock:
            prev = self._counts.get(layer)
            self._counts[layer] = counts if prev is None else prev + counts
            self._routed[layer] = self._routed.get(layer, 0) + top_indices.numel()
            self._processed[layer] = self._processed.get(layer, 0) + int(processed)

    def reset(self) -> None:
        """Forget everything counted so far (the start of a step)."""
        with self._lock:
            self._counts.clear()
            self._routed.clear()
            self._processed.clear()

    def local(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """This rank's counts as ``[num_layers, E + 2]`` int64 on ``device``: per layer the E
        expert counts, then routed, then processed (zeros for layers this rank does not hold)."""
        out = torch.zeros(self.num_layers, self.num_experts + 2, dtype=torch.int64,
                          device=device)
        with self._lock:
            for layer, c in self._counts.items():
                out[layer, : self.num_experts] = c.to(device)
                out[layer, self.num_experts] = self._routed[layer]
                out[layer, self.num_experts + 1] = self._processed[layer]
        return out

    def reduce(self, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None,
               *, across_ranks: bool = True) -> dict[int, LayerLoad]:
        """Every rank's counts summed (one all-reduce over ``group``; collective: every rank of
        it must call), as ``{layer: LayerLoad}`` for the layers that saw tokens.
        ``across_ranks=False``: this rank's own counts, no communication."""
        table = self.local(device)
        if across_ranks:
            dist.all_reduce(table, group=group)
        return _to_loads(table.cpu(), self.num_experts)


def _to_loads(table: torch.Tensor, num_experts: int) -> dict[int, LayerLoad]:
    out: dict[int, LayerLoad] = {}
    for layer, row in enumerate(table.tolist()):
        if row[num_experts] == 0:
            continue
        out[layer] = LayerLoad(tuple(row[:num_experts]), row[num_experts], row[num_experts + 1])
    return out


def balance_summary(loads: dict[int, LayerLoad]) -> dict[str, object] | None:
    """``{"per_layer": {layer: max/mean}, "worst": max over layers, "mean": mean over layers,
    "dropped": total dropped slots}``, or None when no MoE layer saw tokens."""
    per_layer = {layer: load.balance for layer, load in sorted(loads.items())
                 if load.balance is not None}
    if not per_layer:
        return None
    values = list(per_layer.values())
    return {"per_layer": per_layer, "worst": max(values), "mean": sum(values) / len(values),
            "dropped": sum(load.dropped for load in loads.values())}
