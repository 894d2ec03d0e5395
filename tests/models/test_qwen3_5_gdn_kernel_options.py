"""``model.gdn_kernel_options``: parsed from the YAML, checked at load, reaching every GDN op call.

The options change speed and memory only, so the model with ``block_chunks=2`` must train like
the default (eager, rel-L2 <= 1e-6) and a recording wrapper around the op in the layer's module
shows that the options really arrived (dense and packed calls alike).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import overlap_runtime.layers.gated_deltanet as gdn_layer_module
from overlap_runtime.layers import GatedDeltaNet
from overlap_runtime.models import Qwen3_5Config, Qwen3_5ForCausalLM
from overlap_runtime.ops.gdn import GDNKernelOptions
from overlap_runtime.testing import rel_l2
from overlap_runtime.trainer import ConfigError, config_from_dict
from overlap_runtime.config.train import apply_overrides

TINY = dict(hidden_size=16, num_hidden_layers=2, full_attention_interval=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            intermediate_size=32, vocab_size=64, gdn_chunk_size=4)


def _model(data: dict[str, Any]) -> dict[str, Any]:
    return {"model": data}


def test_yaml_options_reach_every_gdn_layer() -> None:
    cfg = config_from_dict(_model({"gdn_kernel_options": {"block_chunks": 2}}))
    assert cfg.model.gdn_kernel_options.to_options() == GDNKernelOptions(block_chunks=2)
    model = Qwen3_5ForCausalLM(cfg.model)
    gdn = [layer.linear_attn for layer in model.layers if layer.linear_attn is not None]
    assert len(gdn) == 3
    assert all(m.kernel_options == GDNKernelOptions(block_chunks=2) for m in gdn)
    # unset (or null): no options, the backend's defaults
    for data in ({}, {"gdn_kernel_options": None}, {"gdn_kernel_options": {}}):
        assert config_from_dict(_model(data)).model.gdn_kernel_options.to_options() is None
    # the section always exists, so `--set` reaches its fields
    tuned = apply_overrides(cfg, ["model.gdn_backend=triton",
                                  "model.gdn_kernel_options.block_chunks=null",
                                  "model.gdn_kernel_options.recompute_w=true",
                                  "model.gdn_kernel_options.num_segments=4",
                                  "model.gdn_kernel_options.fused_forward=true"])
    assert tuned.model.gdn_kernel_options.to_options() == GDNKernelOptions(
        num_segments=4, recompute_w=True, fused_forward=True)


@pytest.mark.parametrize("backend, options, needle", [
    ("eager", {"recompute_w": True}, "recompute_w=True applies to backend='triton' only"),
    ("eager", {"num_segments": 2}, "num_segments=2 applies to backend='triton' only"),
    ("eager", {"fused_forward": True}, "fused_forward=True applies to backend='triton' only"),
    ("triton", {"block_chunks": 2}, "block_chunks=2 applies to backend='eager' only"),
])
def test_an_option_of_the_other_backend_names_field_and_backend(
        backend: str, options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_model({"gdn_backend": backend, "gdn_kernel_options": options}))
    msg = str(info.value)
    assert f"model.gdn_kernel_options does not fit model.gdn_backend={backend!r}" in msg, msg
    assert needle in msg, msg
    # the layer refuses them too (the model config is one way to build it)
    with pytest.raises(ValueError, match=needle):
        GatedDeltaNet(16, 1, 2, 8, 8, backend=backend,
                      kernel_options=GDNKernelOptions(**options))


@pytest.mark.parametrize("options, needle", [
    ({"block_chunks": 0}, "model.gdn_kernel_options: GDNKernelOptions.block_chunks=0 must be >= 1"),
    ({"num_segment": 2}, "gdn_kernel_options.num_segment: Extra inputs are not permitted"),
    ({"recompute_w": 1}, "gdn_kernel_options.recompute_w: Input should be a valid boolean"),
    ({"fused_forward": "yes"},
     "gdn_kernel_options.fused_forward: Input should be a valid boolean"),
    ({"block_chunks": "2"}, "gdn_kernel_options.block_chunks: Input should be a valid integer"),
])
def test_invalid_values_name_the_field(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict(_model({"gdn_kernel_options": options}))
    assert needle in str(info.value), str(info.value)


def test_layer_takes_only_the_options_dataclass() -> None:
    with pytest.raises(TypeError, match="kernel_options must be a GDNKernelOptions or None, "
                                        "got dict"):
        GatedDeltaNet(16, 1, 2, 8, 8, kernel_options={"block_chunks": 2})  # type: ignore[arg-type]


def _loss_and_grads(model: Qwen3_5ForCausalLM, ids: torch.Tensor, cu_seqlens: torch.Tensor | None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1], cu_seqlens=cu_seqlens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_block_chunks_2_trains_like_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """2-layer tiny model (GDN + attention), chunk 4, 40 tokens: 10 chunks, so the default (4
    chunks per block) and block_chunks=2 cut the recompute differently. Dense rows and packed
    documents (one varlen op call)."""
    seen: list[Any] = []
    op = gdn_layer_module.chunk_gated_delta_rule

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("options"))
        return op(*args, **kwargs)

    monkeypatch.setattr(gdn_layer_module, "chunk_gated_delta_rule", recording)
    torch.manual_seed(0)
    default = Qwen3_5ForCausalLM(Qwen3_5Config(**TINY))
    tuned = Qwen3_5ForCausalLM(Qwen3_5Config(**TINY, gdn_kernel_options={"block_chunks": 2}))
    tuned.load_state_dict(default.state_dict())
    ids = torch.randint(0, TINY["vocab_size"], (2, 41), generator=torch.Generator().manual_seed(1))
    for cu in (None, torch.tensor([0, 13, 40, 57, 80])):  # packed: 4 documents over 2 x 40
        seen.clear()
        loss_ref, grads_ref = _loss_and_grads(default, ids, cu)
        assert seen == [None], seen  # the default model passes no options
        seen.clear()
        loss, grads = _loss_and_grads(tuned, ids, cu)
        assert seen == [GDNKernelOptions(block_chunks=2)], seen
        what = "dense" if cu is None else "packed"
        assert rel_l2(loss, loss_ref) <= 1e-6, what
        for name, g in grads_ref.items():
            assert rel_l2(grads[name], g) <= 1e-6, f"{what}: grad of {name}"


def test_checkpoint_identity_leaves_out_the_tuning() -> None:
    """A checkpoint records ``Qwen3_5Config.identity()``: options must not refuse a resume."""
    plain = Qwen3_5Config(**TINY)
    tuned = Qwen3_5Config(**TINY, gdn_kernel_options={"block_chunks": 2})
    assert "gdn_kernel_options" not in tuned.identity()
    assert tuned.identity() == plain.identity()
    assert Qwen3_5Config(**{**TINY, "hidden_size": 8}).identity() != plain.identity()
