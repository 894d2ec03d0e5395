"""parallelize_qwen3_5_cp on real gloo ranks: CP logits and summed gradients equal one device.

The model is float64 with mixer weights scaled up so that every layer matters; the tokens and the
position ids are split contiguously (the one rule of the hybrid model). Each rank's logits shard
must equal the matching slice of the single-device logits, and the all-reduced parameter
gradients the single-device gradients.
"""

from __future__ import annotations

import pytest
from tests.support.parallelize import (
    SEQ,
    cp1_and_errors_worker,
    cp_forward_backward_worker,
    single_device_reference,
)

from overlap_runtime.testing import rel_l2, run_ranks


@pytest.fixture(scope="module")
def reference():
    return single_device_reference()


@pytest.mark.parametrize("gdn_mode,attn_mode,world", [
    ("ulysses", "ulysses", 2),
    ("p2p", "ring", 2),
    ("all_gather", "all_gather_kv", 2),
])
def test_cp_logits_and_gradients_match_single_device(reference, gdn_mode: str, attn_mode: str,
                                                     world: int) -> None:
    ref_logits, ref_grads = reference
    results = run_ranks(cp_forward_backward_worker, world, args=(gdn_mode, attn_mode))
    local = SEQ // world
    for rank, (kinds, logits, default_pos_ok, grads) in enumerate(results):
        assert kinds == ("ContextParallelCoreAttention", attn_mode, None, gdn_mode)
        assert default_pos_ok, "default position ids must be the contiguous shard's"
        assert rel_l2(logits, ref_logits[:, rank * local:(rank + 1) * local]) <= 1e-6
        for name, g in grads.items():
            assert rel_l2(g, ref_grads[name]) <= 1e-5, (rank, name)


def test_cp1_untouched_and_errors() -> None:
    out = run_ranks(cp1_and_errors_worker, 2)[0]
    assert out["cp1_same_object"] and out["cp1_core_untouched"] and out["cp1_gdn_untouched"]
    assert out["cp1_forward_untouched"] and out["cp1_state_equal"]
    errors = out["errors"]
    assert errors["ulysses_degree"][0] == "NotImplementedError"
    assert "ulysses_degree=1" in errors["ulysses_degree"][1]
    assert errors["gdn_mode"][0] == "ValueError" and "'ring'" in errors["gdn_mode"][1]
    assert errors["backend"][0] == "ValueError" and "'auto'" in errors["backend"][1]
    assert errors["attn_mode"][0] == "ValueError"
    assert "full_attention_cp_mode" in errors["attn_mode"][1]
    assert errors["mesh_2d"][0] == "ValueError" and "mesh['cp']" in errors["mesh_2d"][1]
    kind, msg = errors["kernel_options"]
    assert kind == "ValueError" and msg.startswith("layer 0 (linear_attention): "), msg
    assert "mode='ulysses', backend='triton'" in msg, msg
    assert "block_chunks=2 applies to backend='eager'" in msg, msg
    for name in ("ulysses_degree", "gdn_mode", "backend", "attn_mode", "kernel_options"):
        assert errors[name + "_untouched"], name
