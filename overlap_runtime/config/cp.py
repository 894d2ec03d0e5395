"""Context-parallel comm choice of the trainer: per layer, and the hierarchical attention split.

::

    train:
      accelerator:
        cp: 4
        full_attention_cp_mode: ring          # every attention layer, unless the list is set
        linear_attention_cp_mode: p2p         # every GDN layer, unless the list is set
        full_attention_cp_modes: [hierarchical, ring]   # one per full_attention layer, in order
        linear_attention_cp_modes: [p2p, all_gather, p2p, p2p, all_gather, p2p]  # one per GDN layer
        hierarchical_cp: {a2a: 2, ring: 2}    # needed when an attention layer is hierarchical

A per-layer list (as Megatron's ``cp_comm_type`` list) has one entry per layer **of its kind**
(``model.layer_types``), in layer order: entry ``i`` of ``full_attention_cp_modes`` is the
``i``-th ``full_attention`` layer. Its names are the ones the scalar field accepts: the modes
of that layer type registered in ``config.cp_modes``, so a mode registered there is accepted
here with no other change. A list and its scalar field set together is an
error (two answers for one layer). ``hierarchical_cp``: ``a2a x ring == cp``, both ``>= 2``
(:func:`check_hierarchical_degrees`); set without a hierarchical
layer it is an error too (it would be silently unused).

Every rule is checked at load (:func:`cp_mode_problems`, called by ``TrainConfig``) and the
messages name the fields; with cp > 1 that includes ``model.gdn_kernel_options`` against each
GDN layer's mode and ``linear_attention_gdn_backend`` (``config.cp_modes.
kernel_option_problems``: the rules ``LinearAttentionContextParallel.apply`` checks). :func:`layer_cp_modes` is what the model
build and the step graph read: each decoder layer's own mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from overlap_runtime.config.cp_modes import (ATTN_HIERARCHICAL, ATTN_ULYSSES, cp_mode_names,
                                             get_cp_mode, kernel_option_problems)
from overlap_runtime.config.run import _Strict

if TYPE_CHECKING:
    from overlap_runtime.config.train import AcceleratorConfig, TrainConfig

_ACC = "train.accelerator."
#: layer type -> (scalar field, per-layer list field)
_FIELDS = {"full_attention": ("full_attention_cp_mode", "full_attention_cp_modes"),
           "linear_attention": ("linear_attention_cp_mode", "linear_attention_cp_modes")}


class HierarchicalCPConfig(_Strict):
    """``train.accelerator.hierarchical_cp``: the 2-D split of the CP group for
    ``full_attention_cp_mode: hierarchical``: ``a2a`` (inner: Ulysses, the ranks of one node)
    x ``ring`` (outer: zigzag ring across nodes) = ``cp``; CP rank ``j * a2a + a``."""

    a2a: int = Field(description="Ulysses (all-to-all) degree, the inner CP dimension")
    ring: int = Field(description="ring degree, the outer CP dimension")


def allowed_modes(acc: "AcceleratorConfig | type[AcceleratorConfig] | None", layer_type: str
                  ) -> tuple[str, ...]:
    """The mode names ``layer_type``'s fields accept: the registered modes of that layer type
    (``config.cp_modes``; ``acc`` is not read)."""
    return cp_mode_names(layer_type)


def check_hierarchical_degrees(cp: int, a2a: int, ring: int, prefix: str = "") -> list[str]:
    """Every rule the degrees break (empty: valid): ``a2a, ring >= 2`` and ``a2a x ring = cp``.

    A degree of 1 is a flat mode (``a2a = 1``: ring, ``ring = 1``: ulysses): the message says
    which to use instead. ``prefix`` names the fields (``"train.accelerator.hierarchical_cp."``).
    """
    out = []
    for name, value, flat in (("a2a", a2a, "ring"), ("ring", ring, "ulysses")):
        if not isinstance(value, int) or value < 2:
            out.append(f"{prefix}{name}={value!r} must be an integer >= 2 (a degree of 1 is flat "
                       f"{flat}: use full_attention_cp_mode {flat!r})")
    if not out and a2a * ring != cp:
        out.append(f"{prefix}a2a={a2a} x {prefix}ring={ring} = {a2a * ring} must equal the cp "
                   f"size {cp}")
    return out


def modes_of_kind(acc: "AcceleratorConfig", layer_type: str) -> set[str]:
    """The modes the layers of ``layer_type`` use (the list's entries, or the scalar); safe on
    a list of the wrong length, so rules checked before :func:`cp_mode_problems` can use it."""
    scalar, listed = _FIELDS[layer_type]
    modes = getattr(acc, listed)
    return set(modes) if modes is not None else {getattr(acc, scalar)}


def layer_cp_modes(acc: "AcceleratorConfig", layer_types: list[str] | tuple[str, ...]
                   ) -> list[str]:
    """Each decoder layer's CP mode: its kind's per-layer list entry, or the scalar field.
    Raises ValueError naming the field when a list does not match the layer pattern."""
    for kind, (_, listed) in _FIELDS.items():
        modes = getattr(acc, listed)
        if modes is not None and len(modes) != sum(t == kind for t in layer_types):
            raise ValueError(_list_problems(acc, list(layer_types), kind)[0])
    out: list[str] = []
    seen = {kind: 0 for kind in _FIELDS}
    for kind in layer_types:
        scalar, listed = _FIELDS[kind]
        modes = getattr(acc, listed)
        out.append(modes[seen[kind]] if modes is not None else getattr(acc, scalar))
        seen[kind] += 1
    return out


def _list_problems(acc: "AcceleratorConfig", layer_types: list[str], kind: str) -> list[str]:
    scalar, listed = _FIELDS[kind]
    modes = getattr(acc, listed)
    if modes is None:
        return []
    out = []
    where = [i for i, t in enumerate(layer_types) if t == kind]
    if len(modes) != len(where):
        out.append(f"{_ACC}{listed} has {len(modes)} entries but model.layer_types has "
                   f"{len(where)} {kind} layers (layers {where}): one entry per {kind} layer, "
                   f"in layer order")
    allowed = allowed_modes(acc, kind)
    for i, mode in enumerate(modes):
        if mode not in allowed:
            out.append(f"{_ACC}{listed}[{i}]={mode!r} is not a {kind} CP mode; allowed: "
                       f"{list(allowed)}")
    if scalar in acc.model_fields_set:
        out.append(f"{_ACC}{scalar} and {_ACC}{listed} are both set: give the per-layer list "
                   f"or the one mode for every {kind} layer, not both")
    return out


def cp_mode_problems(config: "TrainConfig") -> list[str]:
    """Every rule the CP modes break against the model and the layout (empty: valid)."""
    acc, m = config.train.accelerator, config.model
    out = _list_problems(acc, m.layer_types, "full_attention")
    out += _list_problems(acc, m.layer_types, "linear_attention")
    if out:
        return out
    modes = layer_cp_modes(acc, m.layer_types)
    attn = {mode for mode, t in zip(modes, m.layer_types) if t == "full_attention"}
    gdn = {mode for mode, t in zip(modes, m.layer_types) if t == "linear_attention"}
    h, kv = m.num_attention_heads, m.num_key_value_heads
    if ATTN_HIERARCHICAL.name in attn:
        hc = acc.hierarchical_cp
        if hc is None:
            out.append(f"{_ACC}full_attention_cp_mode 'hierarchical' needs {_ACC}hierarchical_cp: "
                       f"{{a2a: ..., ring: ...}} with a2a x ring = cp={acc.cp}")
        else:
            out += check_hierarchical_degrees(acc.cp, hc.a2a, hc.ring, f"{_ACC}hierarchical_cp.")
            if hc.a2a >= 2 and (h % hc.a2a or (kv % hc.a2a and hc.a2a % kv)):
                out.append(f"{_ACC}hierarchical_cp.a2a={hc.a2a} needs model.num_attention_heads "
                           f"% a2a == 0 and model.num_key_value_heads dividing or divisible by "
                           f"a2a; got {h} / {kv}")
    elif acc.hierarchical_cp is not None:
        out.append(f"{_ACC}hierarchical_cp is set but no full_attention layer uses "
                   f"full_attention_cp_mode 'hierarchical' (it would be unused)")
    if acc.cp > 1 and ATTN_ULYSSES.name in attn and (h % acc.cp or (kv % acc.cp and acc.cp % kv)):
        out.append(f"{_ACC}full_attention_cp_mode='ulysses' with cp={acc.cp} needs "
                   f"model.num_attention_heads % cp == 0 and model.num_key_value_heads dividing "
                   f"or divisible by cp; got {h} / {kv} (use full_attention_cp_mode: ring)")
    hv, hk = m.linear_num_value_heads, m.linear_num_key_heads
    split = sorted(mode for mode in gdn if get_cp_mode("linear_attention", mode).head_split)
    if acc.cp > 1 and split and (hv % acc.cp or (hk % acc.cp and acc.cp % hk)):
        out.append(f"{_ACC}linear_attention_cp_mode={split[0]!r} with cp={acc.cp} needs "
                   f"model.linear_num_value_heads % cp == 0 and model.linear_num_key_heads "
                   f"dividing or divisible by cp; got {hv} / {hk} (use p2p or all_gather)")
    if acc.cp > 1:
        out += _kernel_option_problems(config, sorted(gdn))
    return out


def _kernel_option_problems(config: "TrainConfig", gdn_modes: list[str]) -> list[str]:
    """``model.gdn_kernel_options`` against each GDN CP mode in use and the CP backend
    (``LinearAttentionContextParallel.kernel_option_problems``: the rules ``apply`` checks);
    ``Qwen3_5Config`` already checked them against ``model.gdn_backend``."""
    options = config.model.gdn_kernel_options.to_options()
    backend = config.train.accelerator.linear_attention_gdn_backend
    out: list[str] = []
    for mode in gdn_modes:
        for problem in kernel_option_problems(mode, backend, options):
            out.append(f"model.gdn_kernel_options with GDN CP mode {mode!r} and "
                       f"{_ACC}linear_attention_gdn_backend={backend!r}: {problem}")
    return out


def describe_cp_modes(acc: Any, layer_types: list[str]) -> str:
    """``p2p/ring`` (one mode per kind) or the per-layer modes ``p2p,ring,p2p,ulysses``."""
    if acc.full_attention_cp_modes is None and acc.linear_attention_cp_modes is None:
        return f"{acc.linear_attention_cp_mode}/{acc.full_attention_cp_mode}"
    return ",".join(layer_cp_modes(acc, layer_types))
