"""Splitting the Qwen3.5-style decoder into pipeline stages: the rule, names, and equivalence."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.models import Qwen3_5Config, Qwen3_5ForCausalLM
from overlap_runtime.models.pipeline_split import split_layers, split_qwen3_5


@pytest.mark.parametrize("layers, stages, counts", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (8, 3, [3, 3, 2]), (4, 4, [1, 1, 1, 1]), (7, 4, [2, 2, 2, 1]),
])
def test_even_split_gives_extra_layers_to_early_stages(layers: int, stages: int,
                                                       counts: list[int]) -> None:
    ranges = split_layers(layers, stages)
    assert [len(r) for r in ranges] == counts
    assert [i for r in ranges for i in r] == list(range(layers))


def test_split_rules_are_named() -> None:
    with pytest.raises(ValueError, match="5 pipeline stages for 4 decoder layers"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match=r"layers_per_stage=\[1, 2\] must have 2 entries"):
        split_layers(4, 2, [1, 2])
    assert [len(r) for r in split_layers(4, 2, [1, 3])] == [1, 3]


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_stages_in_sequence_equal_the_model(stages: int) -> None:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5Config(num_hidden_layers=4)).double()
    ids = torch.randint(0, 260, (2, 24))
    ref = model(ids)
    parts = split_qwen3_5(model, stages, range(stages))
    h = ids
    for s in range(stages):
        h = parts[s](h)
    assert torch.equal(h, ref)
    names = {n for part in parts.values() for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert parts[0].is_first and parts[stages - 1].is_last
