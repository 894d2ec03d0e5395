"""``Qwen3_5Config.layer_parameters`` (the configuration floor's count, no module built) equals
the parameters of a decoder layer built on the meta device, for every layer kind and the
feed-forward variants (the simulator's memory model reads the count)."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.config.model import Qwen3_5Config
from overlap_runtime.models.qwen3_5 import Qwen3_5DecoderLayer


@pytest.mark.parametrize("fields", [
    {},
    {"attn_output_gate": False, "hidden_size": 48, "intermediate_size": 80},
    {"mlp": "moe", "num_experts": 6, "moe_intermediate_size": 24},
    {"mlp": "moe", "shared_expert_intermediate_size": 16, "shared_expert_gate": True,
     "linear_num_key_heads": 1, "linear_key_head_dim": 12, "linear_conv_kernel_dim": 3},
])
@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_layer_parameters_match_the_built_layer(fields: dict, kind: str) -> None:
    config = Qwen3_5Config(**fields)
    with torch.device("meta"):
        layer = Qwen3_5DecoderLayer(config, kind)
    dense = sum(p.numel() for n, p in layer.named_parameters() if ".experts." not in f".{n}")
    expert = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")
    assert config.layer_parameters(kind) == (dense, expert)
