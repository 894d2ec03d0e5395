"""Hugging Face ``config.json`` of the Qwen3.5 family <-> :class:`Qwen3_5Config`.

:func:`config_from_hf` reads what ``transformers`` writes for ``qwen3_5_text`` /
``qwen3_5_moe_text`` (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``) and for the multimodal
``qwen3_5`` / ``qwen3_5_moe`` checkpoints (the text model nested under ``text_config``), and
returns the architecture fields of our config with the settings that make our decoder compute
what ``transformers`` computes:

=============================  ===========================================================
Hugging Face                   ours
=============================  ===========================================================
``x_hat * (1 + w)`` norms      ``zero_centered_norms: true`` (stored as HF stores them)
``shared_expert_gate``         ``shared_expert_gate: true``
router renormalises always     ``router_renormalize_top1: true``
``layer_types``                ``layer_types`` (else ``full_attention_interval``)
``rope_parameters``            ``rope_theta``, ``partial_rotary_factor`` (HF's defaults when
                               absent: 10000, 0.25)
``_init_weights``              ``init_style: hf``
``router_aux_loss_coef``       ``moe_aux_loss_coef`` (see docs: HF adds it only with
                               ``output_router_logits``, pooled over layers)
``dtype`` / ``torch_dtype``    ``hf_dtype`` (what export writes back)
=============================  ===========================================================

Every field is either read, checked against the one value we implement (``hidden_act: silu``,
``attention_bias: false``, ``rope_type: default`` ...), or known to concern inference or other
towers only (``use_cache``, token ids, ``vision_config``, ``mtp_*``); anything else is refused by
name, so a checkpoint of a variant we do not implement never loads as something else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HFConfigError(ValueError):
    """A Hugging Face config that cannot be represented; the message names the field."""


# transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults (used for absent fields)
_DENSE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "tie_word_embeddings": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}
_MOE_DEFAULTS: dict[str, Any] = {
    **_DENSE_DEFAULTS, "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8, "num_experts": 256, "router_aux_loss_coef": 0.001,
}
_COPIED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "initializer_range",
           "tie_word_embeddings", "linear_conv_kernel_dim", "linear_key_head_dim",
           "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")
_MOE_COPIED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
# fields that must hold the one value we implement
_REQUIRED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False,
                             "attention_dropout": 0.0, "decoder_sparse_step": 1,
                             "mlp_only_layers": [], "norm_topk_prob": True,
                             "attn_output_gate": True, "mamba_ssm_dtype": "float32"}
# fields about inference, bookkeeping or other towers: read past
_IGNORED = frozenset({
    "model_type", "architectures", "transformers_version", "max_position_embeddings",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "output_router_logits",
    "_name_or_path", "dtype", "torch_dtype", "rope_parameters", "rope_theta", "rope_scaling",
    "partial_rotary_factor", "layer_types", "full_attention_interval", "router_aux_loss_coef",
    "intermediate_size", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
    "keys_to_ignore_at_inference", "return_dict", "output_hidden_states",
    "output_attentions", "use_sliding_window", "sliding_window", "max_window_layers",
})
_TOP_LEVEL_IGNORED = frozenset({
    "model_type", "architectures", "transformers_version", "vision_config", "text_config",
    "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
    "tie_word_embeddings", "dtype", "torch_dtype", "_name_or_path", "use_cache",
    "pad_token_id", "bos_token_id", "eos_token_id", "vision_token_id",
    "position_id_per_seconds", "return_dict",
})
_MODEL_TYPES = {"qwen3_5_text": "swiglu", "qwen3_5_moe_text": "moe",
                "qwen3_5": "swiglu", "qwen3_5_moe": "moe"}
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: Our fields that :func:`config_from_hf` sets (the architecture); the rest of the model section
#: (backends, chunk size, kernel options, the aux-loss weight) stays the user's to choose.
ARCHITECTURE_FIELDS: frozenset[str] = frozenset({
    *_COPIED, *_MOE_COPIED, "intermediate_size", "mlp", "layer_types", "rope_theta",
    "partial_rotary_factor", "attn_output_gate", "zero_centered_norms", "shared_expert_gate",
    "router_renormalize_top1", "init_style", "hf_dtype", "full_attention_interval",
})


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The JSON of ``<directory>/config.json`` (``directory`` may also be the file itself).

    Raises:
        HFConfigError: a missing or unreadable file, or JSON that is not an object.
    """
    p = Path(directory)
    path = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFConfigError(f"cannot read the Hugging Face config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{path}: a Hugging Face config is a JSON object")
    return data


def _text_config(data: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    model_type = data.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise HFConfigError(f"{where}: model_type={model_type!r} is not a Qwen3.5 text or "
                            f"multimodal model (one of {sorted(_MODEL_TYPES)})")
    if "text_config" not in data:
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            raise HFConfigError(f"{where}: model_type={model_type!r} without a text_config")
        return data, model_type
    unknown = sorted(set(data) - _TOP_LEVEL_IGNORED)
    if unknown:
        raise HFConfigError(f"{where}: top-level field(s) {unknown} of a multimodal config are "
                            f"not understood (the text model is read from text_config)")
    text = dict(data["text_config"])
    text.setdefault("model_type", model_type + ("_text" if not model_type.endswith("_text")
                                                else ""))
    top_tie = data.get("tie_word_embeddings")
    if top_tie is not None:
        if "tie_word_embeddings" in text and text["tie_word_embeddings"] != top_tie:
            raise HFConfigError(f"{where}: tie_word_embeddings={top_tie} at the top level but "
                                f"{text['tie_word_embeddings']} in text_config")
        text["tie_word_embeddings"] = top_tie
    for key in ("dtype", "torch_dtype"):
        if key in data and key not in text:
            text[key] = data[key]
    return text, text["model_type"]


def config_from_hf(data: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """Our model fields (a dict for :class:`~overlap_runtime.models.Qwen3_5Config`) from a
    Hugging Face Qwen3.5 config (flat, or nested under ``text_config``).

    Raises:
        HFConfigError: an unsupported model type or field value, or an unknown field (named).
    """
    text, model_type = _text_config(data, where)
    mlp = _MODEL_TYPES[model_type]
    defaults = _MOE_DEFAULTS if mlp == "moe" else _DENSE_DEFAULTS
    known = set(_COPIED) | set(_MOE_COPIED) | set(_REQUIRED) | _IGNORED
    unknown = sorted(set(text) - known)
    if unknown:
        raise HFConfigError(f"{where}: field(s) {unknown} are not understood by this importer "
                            f"(refused rather than ignored: the model could differ)")
    for key, value in _REQUIRED.items():
        if key in text and text[key] != value and not (
                isinstance(value, float) and text[key] == 0):
            raise HFConfigError(f"{where}: {key}={text[key]!r} is not supported (only "
                                f"{value!r} is implemented)")
    out: dict[str, Any] = {k: text.get(k, defaults[k]) for k in _COPIED}
    out["mlp"] = mlp
    if mlp == "moe":
        for bad in ("intermediate_size",):
            if bad in text:
                raise HFConfigError(f"{where}: {bad} in a MoE config (every layer is MoE here)")
        out.update({k: text.get(k, defaults[k]) for k in _MOE_COPIED})
        if not out["shared_expert_intermediate_size"]:
            raise HFConfigError(f"{where}: shared_expert_intermediate_size="
                                f"{out['shared_expert_intermediate_size']!r}: Qwen3.5-MoE has a "
                                f"gated shared expert in every layer")
        out["shared_expert_gate"] = True
        out["router_renormalize_top1"] = True
        out["moe_aux_loss_coef"] = float(text.get("router_aux_loss_coef",
                                                  defaults["router_aux_loss_coef"]))
    else:
        out["intermediate_size"] = text.get("intermediate_size", defaults["intermediate_size"])
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFConfigError(f"{where}: rope_parameters.rope_type={rope_type!r} is not "
                            f"supported (only 'default' RoPE is implemented)")
    unknown_rope = sorted(set(rope) - {"rope_type", "type", "rope_theta",
                                       "partial_rotary_factor", "mrope_section",
                                       "mrope_interleaved"})
    if unknown_rope:
        raise HFConfigError(f"{where}: rope_parameters field(s) {unknown_rope} are not "
                            f"understood")
    out["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    out["partial_rotary_factor"] = float(rope.get("partial_rotary_factor",
                                                  text.get("partial_rotary_factor", 0.25)))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(out["num_hidden_layers"])]
    out["layer_types"] = list(layer_types)
    out["attn_output_gate"] = True
    out["zero_centered_norms"] = True
    out["init_style"] = "hf"
    dtype = text.get("dtype", text.get("torch_dtype"))
    if dtype is not None:
        if str(dtype) not in _DTYPES:
            raise HFConfigError(f"{where}: dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        out["hf_dtype"] = _DTYPES[str(dtype)]
    return out


def architecture_conflicts(imported: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """The YAML model fields that contradict the imported config: ``model.F=X in YAML, Y in
    config.json`` lines (an architecture field may be repeated only with the same value)."""
    out = []
    for key, value in given.items():
        if key in imported and key in ARCHITECTURE_FIELDS:
            a, b = imported[key], value
            if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
                a, b = list(a), list(b)
            if a != b:
                out.append(f"model.{key}={value!r} in the configuration but {imported[key]!r} "
                           f"in the imported config.json (drop it, or import another model)")
    return out


def hf_config_from(config: Any) -> dict[str, Any]:
    """The ``config.json`` of ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` for our
    :class:`~overlap_runtime.models.Qwen3_5Config` ``config``.

    Raises:
        HFConfigError: a model Hugging Face's classes cannot represent (named): no attention
            output gate; MoE without a gated shared expert; a top-1 router that does not
            renormalise.
    """
    c = config
    if not c.attn_output_gate:
        raise HFConfigError("model.attn_output_gate=false: transformers' Qwen3.5 attention "
                            "always gates its output")
    dtype = c.hf_dtype or "float32"
    out: dict[str, Any] = {k: getattr(c, k) for k in _COPIED}
    out.update({
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "layer_types": list(c.layer_types),
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor},
        "dtype": dtype, "use_cache": True,
    })
    if c.mlp == "moe":
        if not (c.shared_expert_intermediate_size and c.shared_expert_gate):
            raise HFConfigError("model.mlp='moe' without a gated shared expert "
                                "(shared_expert_intermediate_size and shared_expert_gate): "
                                "transformers' Qwen3.5-MoE block always has one")
        if c.num_experts_per_tok == 1 and not c.router_renormalize_top1:
            raise HFConfigError("model.num_experts_per_tok=1 with router_renormalize_top1="
                                "false: transformers' router renormalises the single score to 1")
        out.update({k: getattr(c, k) for k in _MOE_COPIED})
        out.update({"model_type": "qwen3_5_moe_text",
                    "architectures": ["Qwen3_5MoeForCausalLM"],
                    "router_aux_loss_coef": c.moe_aux_loss_coef,
                    "output_router_logits": False})
    else:
        out.update({"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
                    "intermediate_size": c.intermediate_size})
    return out
