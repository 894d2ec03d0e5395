"""benchmarks/activation_memory.py: every saved tensor is counted once and lands in exactly one
category, and known modules save what a hand count says (CPU, fp32, a tiny hybrid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks import activation_memory as am

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "gpu_cp2_16k.yaml")
TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, intermediate_size=48, gdn_backend="eager",
            attention_backend="math", gdn_chunk_size=16)
T, HIDDEN, INTER, LAYERS = 64, 32, 48, 4
F32 = 4


def _run(checkpoint: bool) -> dict[str, Any]:
    return am.run(CONFIG, T, False, checkpoint, "cpu", torch.float32, TINY)


def test_categories_add_up_and_hand_counts() -> None:
    r = _run(checkpoint=False)
    ledger = r["ledger"]
    by_cat = ledger.bytes_by("category")
    assert sum(by_cat.values()) == r["saved_bytes"] == sum(
        x.nbytes for x in ledger.records.values())
    assert "other" not in by_cat and am.UNHOOKED not in by_cat, by_cat
    for cat in ("gdn proj", "gdn conv", "gdn gates", "gdn core", "gdn norm", "attention proj",
                "attention core", "mlp", "norms", "lm_head", "loss"):
        assert by_cat.get((cat,), 0) > 0, f"nothing saved under {cat!r}: {by_cat}"
    # SwiGLU keeps its input x (the post-attention norm's output, not saved by the eager fp32
    # norm, whose output is a fresh product), gate(x) and up(x): B*T*(hidden + 2*I) fp32 bytes
    mlp = ledger.bytes_by("category", "layer_type")
    per_layer = {lt: mlp.get(("mlp", lt), 0) / n for lt, n in
                 (("linear_attention", 3), ("full_attention", 1))}
    assert per_layer == {lt: T * (HIDDEN + 2 * INTER) * F32 for lt in per_layer}, per_layer
    # the LM head (one nn.Linear) saves its input: the final norm's output, B*T*hidden fp32
    assert ledger.bytes_by("category").get(("lm_head",)) == T * HIDDEN * F32
    # the loss keeps log_softmax's output [T, vocab] fp32 (and the 0-d target-free scalars)
    assert ledger.bytes_by("category")[("loss",)] >= T * 260 * F32
    # weight, grad, exp_avg, exp_avg_sq (fp32 each) and AdamW's 0-d step counters
    assert 0 <= r["params_grads_optimizer_bytes"] - r["params"] * F32 * 4 <= 64 * F32


def test_checkpointed_layers_keep_only_their_inputs() -> None:
    r = _run(checkpoint=True)
    by_cat = r["ledger"].bytes_by("category")
    # each layer's input [T, hidden] fp32, and the position ids [T] int64 once (shared storage)
    assert by_cat[("residual",)] == LAYERS * T * HIDDEN * F32 + T * 8, by_cat
    assert not any(c[0].startswith(("gdn", "attention", "mlp")) for c in by_cat), by_cat


class _Hooked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class _Unhooked(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.kept = x.detach() * 3  # outside save_for_backward: invisible to the hooks
        return x * 3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3


def test_custom_function_saves_are_seen() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Unhooked.apply(_Hooked.apply(self.mlp(x)))

    net = Net()
    ledger = am.SavedTensorLedger(net)
    x = torch.randn(5, 8)
    with ledger.watch():
        out = net(x).sum()
    # the Linear's input x inside the tagged module, _Hooked's y outside any tagged region
    assert ledger.bytes_by("category") == {("mlp",): 5 * 8 * F32, ("other",): 5 * 8 * F32}
    assert ledger.add_unhooked(out) == 1
    assert ledger.bytes_by("category")[(am.UNHOOKED,)] == 5 * 8 * F32
