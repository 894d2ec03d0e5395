"""The context-parallel mode registry: one :class:`CPMode` entry per mode, pure data.

An entry says what configuration validation, the step graph and the crossover table need to know
of a mode without importing its runtime: the kind of layer it serves (``linear_attention``: the
GDN, ``full_attention``: attention), whether each rank passes the conv halo, whether the mode
splits heads over the CP ranks (then the head counts must divide), and the least number of
Triton scan segments its state link needs. A mode defined outside the built-in ones also brings
its layer strategy (``strategy``: a ``ContextParallelGDNMixer`` class, built from the layer's
``GDNCPPlan``) and its layer program (``program``: the ops one layer issues, with their message
bytes and FLOPs, i.e. its communication plan and cost; ``stepgraph.layer_program`` calls it).
Registering one entry (:func:`register_cp_mode`) is all a new mode needs: the YAML accepts its
name, ``LinearAttentionContextParallel`` installs its strategy, the step graph and the crossover
table price it.

The built-in modes' strategies and programs live with their runtime (``context_parallel.gdn``,
``context_parallel``) and ``stepgraph.layer_program``, keyed by these entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from overlap_runtime.ops.gdn.options import GDNKernelOptions

_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class CPMode:
    """One context-parallel mode.

    Attributes:
        name: the YAML name (``train.accelerator.linear_attention_cp_mode`` / ``...cp_modes``).
        layer_type: ``"linear_attention"`` (GDN) or ``"full_attention"``.
        halo: each rank receives the previous rank's conv halo (GDN modes).
        head_split: heads are split over the CP ranks (Ulysses): the head counts must divide.
        triton_min_segments: least Triton scan segments per rank its state link needs.
        passes_state: an fp32 state from the other ranks enters the local GDN op (the Triton
            capability check then includes an initial state).
        strategy: the layer strategy of a mode registered from outside the package: a callable
            ``(plan) -> mixer`` (a ``ContextParallelGDNMixer`` subclass); None for built-ins.
        program: its layer program: ``(config, shape, cp_rank, forward_ops | None) -> ops``,
            called with ``None`` for the forward and with the forward's ops for the backward;
            the ops carry the bytes and FLOPs (``stepgraph.layer_program.LayerOp``). None for
            built-ins.
    """

    name: str
    layer_type: str
    halo: bool = False
    head_split: bool = False
    triton_min_segments: int = 1
    passes_state: bool = False
    strategy: Callable[[Any], Any] | None = None
    program: Callable[..., list[Any]] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"CPMode.name={self.name!r} must be a non-empty identifier")
        if self.layer_type not in _LAYER_TYPES:
            raise ValueError(f"CPMode({self.name!r}).layer_type={self.layer_type!r} must be one "
                             f"of {_LAYER_TYPES}")
        if self.triton_min_segments < 1:
            raise ValueError(f"CPMode({self.name!r}).triton_min_segments="
                             f"{self.triton_min_segments} must be >= 1")


_REGISTRY: dict[tuple[str, str], CPMode] = {}


def register_cp_mode(mode: CPMode) -> CPMode:
    """Add ``mode`` (returned). A second entry of one name and layer type raises ValueError;
    a mode from outside the package must bring ``strategy`` and ``program``."""
    key = (mode.layer_type, mode.name)
    if key in _REGISTRY:
        raise ValueError(f"the {mode.layer_type} CP mode {mode.name!r} is registered already")
    if _BUILTINS_DONE and (mode.strategy is None or mode.program is None):
        raise ValueError(f"CPMode({mode.name!r}) needs strategy and program: the runtime and "
                         f"the step graph know only the built-in modes without them")
    _REGISTRY[key] = mode
    return mode


def unregister_cp_mode(layer_type: str, name: str) -> None:
    """Remove a mode registered with :func:`register_cp_mode` (a built-in raises ValueError)."""
    mode = get_cp_mode(layer_type, name)
    if mode.strategy is None:
        raise ValueError(f"the built-in {layer_type} CP mode {name!r} cannot be removed")
    del _REGISTRY[(layer_type, name)]


def get_cp_mode(layer_type: str, name: str) -> CPMode:
    """The entry of ``name`` for ``layer_type``; ValueError naming the known names."""
    try:
        return _REGISTRY[(layer_type, name)]
    except KeyError:
        raise ValueError(f"unknown {layer_type} CP mode {name!r}; known: "
                         f"{list(cp_mode_names(layer_type))}") from None


def cp_mode_names(layer_type: str) -> tuple[str, ...]:
    """The registered mode names of ``layer_type``, built-ins first."""
    return tuple(name for (kind, name) in _REGISTRY if kind == layer_type)


_BUILTINS_DONE = False
GDN_ULYSSES = register_cp_mode(CPMode("ulysses", "linear_attention", head_split=True))
GDN_P2P = register_cp_mode(CPMode("p2p", "linear_attention", halo=True, triton_min_segments=2,
                                  passes_state=True))
GDN_ALL_GATHER = register_cp_mode(CPMode("all_gather", "linear_attention", halo=True,
                                         passes_state=True))
GDN_PREFIX_SCAN = register_cp_mode(CPMode("prefix_scan", "linear_attention", halo=True,
                                          triton_min_segments=2, passes_state=True))
ATTN_ULYSSES = register_cp_mode(CPMode("ulysses", "full_attention", head_split=True))
ATTN_RING = register_cp_mode(CPMode("ring", "full_attention"))
ATTN_ALL_GATHER_KV = register_cp_mode(CPMode("all_gather_kv", "full_attention"))
ATTN_HIERARCHICAL = register_cp_mode(CPMode("hierarchical", "full_attention"))
_BUILTINS_DONE = True

# the defaults follow the crossover table (docs/benchmarks.md "Where each CP mode wins";
# docs/context_parallel.md "Default modes"): an explicit choice, never picked at run time
DEFAULT_GDN_CP_MODE = GDN_PREFIX_SCAN.name
DEFAULT_ATTENTION_CP_MODE = ATTN_RING.name


def kernel_option_problems(mode: str, backend: str, options: Any) -> list[str]:
    """Why GDN kernel ``options`` (``ops.gdn.GDNKernelOptions`` or None) cannot run in GDN CP
    ``mode`` on ``backend`` (empty: they can): an option of the other backend, or
    ``num_segments`` below the mode's ``triton_min_segments`` (it would be overridden)."""
    if options is None:
        return []
    if not isinstance(options, GDNKernelOptions):
        return [f"kernel_options must be a GDNKernelOptions or None, got "
                f"{type(options).__name__}"]
    where = f"mode={mode!r}, backend={backend!r}"
    try:
        options.check_backend(backend)
    except ValueError as exc:
        return [f"GDN context parallelism ({where}): {exc}"]
    least = get_cp_mode("linear_attention", mode).triton_min_segments
    n = options.num_segments
    if backend == "triton" and n is not None and n < least:
        return [f"num_segments={n} with {where}: the mode's state link composes the "
                f"op's segment summaries across ranks and runs at least {least} segments "
                f"per rank, so num_segments={n} would be overridden; set num_segments "
                f">= {least} or leave it unset"]
    return []
