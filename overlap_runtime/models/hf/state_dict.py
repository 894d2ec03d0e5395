"""Parameter names and layouts: ours <-> Hugging Face's Qwen3.5 safetensors.

Our parameter names (``Qwen3_5ForCausalLM.named_parameters()``; a pipeline stage or an FSDP2
shard keeps them) map to the keys ``transformers`` writes, under the text model's prefix
``model.`` (``Qwen3_5ForCausalLM``) or ``model.language_model.`` (the multimodal
``Qwen3_5ForConditionalGeneration``); ``lm_head.weight`` has no prefix::

    ours                                         Hugging Face (after the prefix)
    embed_tokens.weight / norm.weight            same
    layers.{i}.<anything else>                   same (attention, GDN, norms, dense MLP)
    layers.{i}.mlp.router.gate.weight            layers.{i}.mlp.gate.weight
    layers.{i}.mlp.shared_expert.w1/w3/w2.weight layers.{i}.mlp.shared_expert.gate_proj/up_proj/down_proj.weight
    layers.{i}.mlp.experts.w1  [E, H, F]         layers.{i}.mlp.experts.{e}.gate_proj.weight [F, H]  (transposed)
    layers.{i}.mlp.experts.w3  [E, H, F]         layers.{i}.mlp.experts.{e}.up_proj.weight   [F, H]  (transposed)
    layers.{i}.mlp.experts.w2  [E, F, H]         layers.{i}.mlp.experts.{e}.down_proj.weight [H, F]  (transposed)

Every other tensor has the same shape and layout on both sides, so a rank's share of a
parameter (a row range of an FSDP2 shard, an EP rank's experts) is read as the same region of
the stored tensor (:meth:`Source.read`). A model whose norms are not zero-centred stores
``scale`` where Hugging Face stores ``scale - 1``: export subtracts 1 there (an imported model is
always zero-centred and converts nothing, so export of an import is bitwise the input).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

#: our stacked expert weight -> Hugging Face's per-expert projection
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_SHARED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERTS_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w[123])$")
_SHARED_RE = re.compile(r"^(layers\.\d+\.mlp\.shared_expert)\.(w[123])\.weight$")
_ROUTER_RE = re.compile(r"^(layers\.\d+\.mlp)\.router\.gate\.weight$")
#: our names of the norms Hugging Face stores zero-centred (the GDN output norm is not one)
ZERO_CENTERED_NORM_RE = re.compile(
    r"^(norm|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))"
    r"\.weight$")
_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def hf_prefix(keys: list[str] | set[str]) -> str:
    """The text model's key prefix in a checkpoint: ``model.language_model.`` or ``model.``."""
    if any(k.startswith("model.language_model.") for k in keys):
        return "model.language_model."
    return "model."


def skipped_prefixes(keys: list[str] | set[str]) -> dict[str, int]:
    """``{prefix: count}`` of the stored tensors an import skips (vision tower, MTP head)."""
    out: dict[str, int] = {}
    for k in keys:
        for p in _SKIPPED:
            if k.startswith(p):
                out[p] = out.get(p, 0) + 1
                break
    return out


@dataclass(frozen=True)
class Source:
    """Where one of our parameters lives in a Hugging Face checkpoint.

    Attributes:
        keys: the stored key (one), or for routed experts one key per global expert.
        transpose: each stored tensor is the transpose of our per-expert matrix.
    """

    keys: tuple[str, ...]
    transpose: bool = False

    @property
    def stacked(self) -> bool:
        return self.transpose

    def read(self, get_slice: Callable[[str, tuple[slice, ...]], torch.Tensor],
             offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Our tensor's region ``[offset : offset + shape]`` (global coordinates), read with
        ``get_slice(key, slices)`` so only that region of the stored tensors is touched."""
        sl = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        if not self.stacked:
            return get_slice(self.keys[0], sl)
        rows = [get_slice(self.keys[e], (sl[2], sl[1])).t() for e in
                range(sl[0].start, sl[0].stop)]
        if not rows:
            return torch.empty(shape)
        return torch.stack(rows)


def hf_source(name: str, prefix: str, num_experts: int) -> Source:
    """The :class:`Source` of our parameter ``name`` (module docstring's table)."""
    if name == "lm_head.weight":
        return Source(("lm_head.weight",))
    m = _EXPERTS_RE.match(name)
    if m:
        layer, w = m.groups()
        proj = EXPERT_PROJECTIONS[w]
        return Source(tuple(f"{prefix}layers.{layer}.mlp.experts.{e}.{proj}.weight"
                            for e in range(num_experts)), transpose=True)
    m = _SHARED_RE.match(name)
    if m:
        return Source((f"{prefix}{m.group(1)}.{_SHARED[m.group(2)]}.weight",))
    m = _ROUTER_RE.match(name)
    if m:
        return Source((f"{prefix}{m.group(1)}.gate.weight",))
    return Source((prefix + name,))


def export_tensors(name: str, value: torch.Tensor, zero_centered: bool,
                   expert: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """``[(Hugging Face key, tensor)]`` for our parameter ``name`` (prefix ``model.``).

    ``expert``: ``value`` is row ``expert`` of a stacked expert weight (``[H, F]`` or
    ``[F, H]``), as our checkpoints store routed experts.
    """
    if expert is not None:
        m = _EXPERTS_RE.match(name)
        if not m:
            raise ValueError(f"{name}: an expert row of a parameter that is not a routed "
                             f"expert weight")
        layer, w = m.groups()
        key = f"model.layers.{layer}.mlp.experts.{expert}.{EXPERT_PROJECTIONS[w]}.weight"
        return [(key, value.t().contiguous())]
    if not zero_centered and ZERO_CENTERED_NORM_RE.match(name):
        value = value - 1.0
    src = hf_source(name, "model.", 0)
    return [(src.keys[0], value)]
