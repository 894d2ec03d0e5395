"""Run under TRITON_INTERPRET=1 by test_layer_copies.py: the GDN layer with the Triton GDN op
(and the Triton or eager torch conv, chosen by the arguments: both by default) under
benchmarks/layer_copies.py's CopyCounter."""

from __future__ import annotations

import sys

import torch

from benchmarks import layer_copies
from tests.support.interpreter import require_interpreter

require_interpreter()

from overlap_runtime.layers.gated_deltanet import GatedDeltaNet  # noqa: E402

B, T, HIDDEN, H, HV, K = 1, 64, 32, 2, 4, 16
C, D = 2 * H * K + HV * K, HV * K


def run(conv_backend: str, parts: bool) -> tuple[list, list[torch.Tensor]]:
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, H, HV, K, K, backend="triton", conv_backend=conv_backend)
    layer = layer.to(torch.bfloat16)
    if not parts:
        layer.conv_parts_fn = None  # the code before issue #29's copies work: one conv, split
    x = torch.randn(B, T, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, HIDDEN, dtype=torch.bfloat16)
    counter = layer_copies.CopyCounter()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
        out = layer(x)
        counter.phase = "backward"
        out.backward(dy)
    return counter.records, [out, x.grad] + [p.grad for p in layer.parameters()]


def main(conv_backends: tuple[str, ...] = ("triton", "torch")) -> None:
    bf16 = 2
    # forward, what stays: the eager gated norm's fp32 casts of o and z and its bf16 result
    # (10 bytes per element of [B, T, HV*V]), the gates' fp32 cast of a and of the bf16
    # A_log / dt_bias, the norm weight's cast
    floor = 10 * B * T * D + 4 * B * T * HV + 2 * 4 * HV + 4 * K
    for conv_backend in conv_backends:
        rec_new, res_new = run(conv_backend, parts=True)
        rec_old, res_old = run(conv_backend, parts=False)
        for a, b in zip(res_new, res_old):
            assert torch.equal(a, b), (conv_backend, "results changed")
        fwd_new = layer_copies.totals(rec_new)["forward"]
        fwd_old = layer_copies.totals(rec_old)["forward"]
        clones = [r for r in rec_new if r.op == "clone"]
        if conv_backend == "triton":
            # q, k, v contiguous from the conv: the op's .contiguous() copies nothing
            assert not clones, clones
            assert fwd_new == floor, (fwd_new, floor)
            assert fwd_old == floor + B * T * C * bf16, (fwd_old, floor)
            cats = [r for r in rec_new if r.op == "cat"]
            # backward: the weight's [C, K] gradient alone (each group's kernels write their
            # dx into one [B, T, C] gradient: no concatenation of the groups' dx)
            assert sum(r.nbytes for r in cats) == C * 4 * bf16, cats
        else:
            # eager F.conv1d: unchanged (the padded transposed input, the op's copy of the
            # transposed output's q, k, v)
            assert fwd_new == fwd_old == floor + B * (T + 3) * C * bf16 + B * T * C * bf16, (
                fwd_new, fwd_old)
        print(conv_backend, "forward bytes", fwd_old, "->", fwd_new)
    print("ok")


if __name__ == "__main__":
    # ``python -m tests.support.layer_copies_cases [triton|torch ...]``: the conv backends to check (default
    # both; the test runs one child per backend, side by side)
    sys.exit(main(tuple(sys.argv[1:]) or ("triton", "torch")))
