"""Where each context-parallel mode wins: one layer's predicted forward + backward per mode, CP
size and local length, and the CP sizes at which the fastest mode changes.

A layer is a one-layer model of the base configuration (its GDN or attention geometry, a 1-wide
MLP so the mixer dominates), ``cp`` ranks of ``local_len`` tokens each (weak scaling: the global
sequence is ``cp * local_len``), simulated by :func:`~overlap_runtime.stepgraph.scale.
predict_at_scale` on a machine profile (``pipeline_s``: the layer's forward + backward; FSDP and
the optimizer are left out, they do not depend on the mode). Modes:

* GDN (``linear_attention_cp_mode``): ``p2p`` (the state chain, ``cp - 1`` hops), ``prefix_scan``
  (the tree: ``ceil(log2 cp)`` rounds), ``all_gather`` (of the summaries), ``ulysses``;
* attention (``full_attention_cp_mode``): ``ring``, ``ulysses``, ``hierarchical`` (every split
  ``a2a x ring`` the configuration accepts with ``a2a`` at most one node; the fastest is kept).

A mode the configuration refuses (Ulysses needs the heads to divide by ``cp``) is a row with
``refused`` set to the configuration's own message, never silently dropped: the tables show
it as ``n/a``. Pure Python over the config; no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal

from overlap_runtime.config.cp_modes import (ATTN_HIERARCHICAL, ATTN_RING, ATTN_ULYSSES,
                                             GDN_ALL_GATHER, GDN_P2P, GDN_PREFIX_SCAN,
                                             GDN_ULYSSES, cp_mode_names)
from overlap_runtime.config.train import config_from_dict

from .costs import MachineProfile
from .scale import predict_at_scale

if TYPE_CHECKING:
    from overlap_runtime.config.train import TrainConfig

LayerKind = Literal["gdn", "attention"]
#: the built-in modes in table order; a GDN mode registered in ``config.cp_modes`` joins the
#: table after them (:func:`modes_of`)
GDN_MODES = tuple(m.name for m in (GDN_P2P, GDN_PREFIX_SCAN, GDN_ALL_GATHER, GDN_ULYSSES))
ATTENTION_MODES = tuple(m.name for m in (ATTN_RING, ATTN_ULYSSES, ATTN_HIERARCHICAL))
_LAYER_TYPE = {"gdn": "linear_attention", "attention": "full_attention"}


def modes_of(kind: LayerKind) -> tuple[str, ...]:
    """The modes the crossover table compares for ``kind``: the built-ins, then every other
    registered GDN mode (attention: the built-ins)."""
    if kind not in _LAYER_TYPE:
        raise ValueError(f"kind={kind!r}: one of {sorted(_LAYER_TYPE)}")
    if kind == "attention":
        return ATTENTION_MODES
    return GDN_MODES + tuple(m for m in cp_mode_names(_LAYER_TYPE[kind]) if m not in GDN_MODES)


@dataclass(frozen=True)
class ModePrediction:
    """One layer, one mode: ``ms`` its predicted forward + backward (None when ``refused``),
    ``split`` the hierarchical ``(a2a, ring)`` that gave it."""

    kind: LayerKind
    mode: str
    cp: int
    local_len: int
    ms: float | None
    split: tuple[int, int] | None = None
    refused: str | None = None


def layer_config(base: "TrainConfig", kind: LayerKind, mode: str, cp: int, local_len: int,
                 a2a: int | None = None) -> "TrainConfig":
    """The one-layer model of ``base`` running ``mode`` on ``cp`` ranks of ``local_len`` tokens
    (validated like ``train``: a refused combination raises the configuration's ValueError)."""
    if mode not in modes_of(kind):
        raise ValueError(f"mode={mode!r} is not a {kind} mode of the crossover; "
                         f"known: {list(modes_of(kind))}")
    if (mode == ATTN_HIERARCHICAL.name) != (a2a is not None):
        raise ValueError(f"mode={mode!r} with a2a={a2a}: a2a is given for hierarchical only")
    sets = {"model.num_hidden_layers": 1, "model.intermediate_size": 1, "model.mlp": "swiglu",
            "model.full_attention_interval": 1 if kind == "attention" else 1000,
            "data.seq_len": cp * local_len, "data.batch_size": 1, "data.packing": "concat",
            "train.accelerator.cp": cp, "train.accelerator.world_size": cp,
            "train.accelerator.pp": 1, "train.accelerator.ep": 1,
            "train.accelerator.dp_shard": 1, "train.activation_checkpoint": False}
    field = "full_attention_cp_mode" if kind == "attention" else "linear_attention_cp_mode"
    sets[f"train.accelerator.{field}"] = mode
    if a2a is not None:
        sets["train.accelerator.hierarchical_cp"] = {"a2a": a2a, "ring": cp // a2a}
    cfg = base.model_dump()
    for key in ("full_attention_cp_modes", "linear_attention_cp_modes", "hierarchical_cp"):
        cfg["train"]["accelerator"][key] = None
    for dotted, value in sets.items():
        node = cfg
        *path, last = dotted.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return config_from_dict(cfg, f"crossover {kind} {mode} cp={cp} local={local_len}")


def _splits(cp: int, gpus_per_node: int) -> list[int]:
    """Hierarchical ``a2a`` degrees: divisors of ``cp`` with ``a2a >= 2``, ``ring >= 2`` and the
    all-to-all inside one node."""
    return [a for a in range(2, min(cp // 2, gpus_per_node) + 1) if cp % a == 0]


def predict_mode(base: "TrainConfig", kind: LayerKind, mode: str, cp: int, local_len: int,
                 profile: MachineProfile) -> ModePrediction:
    """One layer's predicted forward + backward (module doc); a refused mode is a row with
    ``refused`` set to the configuration's message."""
    splits: list[int | None] = _splits(cp, profile.gpus_per_node) \
        if mode == ATTN_HIERARCHICAL.name \
        else [None]
    if not splits:
        return ModePrediction(kind, mode, cp, local_len, None, refused=(
            f"hierarchical needs a2a >= 2 and ring >= 2 with a2a <= {profile.gpus_per_node} "
            f"GPUs per node; cp={cp} has no such split"))
    best: ModePrediction | None = None
    refused = ""
    for a2a in splits:
        try:
            cfg = layer_config(base, kind, mode, cp, local_len, a2a)
        except ValueError as exc:
            refused = " ".join(str(exc).split())
            continue
        ms = predict_at_scale(cfg, profile).pipeline_s * 1e3
        if best is None or ms < best.ms:  # type: ignore[operator]
            best = ModePrediction(kind, mode, cp, local_len, ms,
                                  None if a2a is None else (a2a, cp // a2a))
    return best if best is not None else ModePrediction(kind, mode, cp, local_len, None,
                                                        refused=refused)


def predict_grid(base: "TrainConfig", kind: LayerKind, cps: Iterable[int],
                 local_lens: Iterable[int], profile: MachineProfile,
                 modes: Iterable[str] | None = None) -> list[ModePrediction]:
    """:func:`predict_mode` for every mode x CP size x local length."""
    modes = tuple(modes) if modes is not None else modes_of(kind)
    return [predict_mode(base, kind, m, cp, n, profile)
            for n in local_lens for cp in cps for m in modes]


def winner(rows: Iterable[ModePrediction], local_len: int, cp: int) -> ModePrediction:
    """The fastest mode at ``(local_len, cp)`` among ``rows`` (refused modes excluded)."""
    here = [r for r in rows if r.local_len == local_len and r.cp == cp and r.ms is not None]
    if not here:
        raise ValueError(f"no mode ran at local_len={local_len}, cp={cp}")
    return min(here, key=lambda r: r.ms)  # type: ignore[arg-type,return-value]


def crossover_cp(rows: Iterable[ModePrediction], local_len: int, a: str, b: str,
                 margin: float = 0.0) -> int | None:
    """The smallest CP size of the grid from which mode ``b`` is faster than mode ``a`` by more
    than ``margin`` (a share of ``a``'s time) at every larger CP size of the grid (a refused
    ``a`` counts as beaten, a refused ``b`` as not faster); None when ``b`` is not faster at
    the largest CP size."""
    rows = [r for r in rows if r.local_len == local_len]
    by = {(r.mode, r.cp): r.ms for r in rows}
    cps = sorted({r.cp for r in rows})
    for m in (a, b):
        if not any(r.mode == m for r in rows):
            raise ValueError(f"mode {m!r} has no row at local_len={local_len}")
    out: int | None = None
    for cp in reversed(cps):
        ma, mb = by.get((a, cp)), by.get((b, cp))
        if mb is None or (ma is not None and mb >= ma * (1.0 - margin)):
            break
        out = cp
    return out
