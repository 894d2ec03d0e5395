"""Micro-benchmark of the GDN layer's elementwise parts on one GPU (issue #29): the causal
depthwise conv + SiLU, the gated RMSNorm and the decoder RMSNorm, eager vs torch.compile, and
the conv as F.conv1d vs a sum of shifted products.

    python -m benchmarks.gdn_prologue --tokens 32768
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


from overlap_runtime.layers.norm import RMSNorm, RMSNormGated  # noqa: E402


def conv_cudnn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B, T, C], w [C, 1, K] -> SiLU(causal depthwise conv) [B, T, C] (the layer's today)."""
    k = w.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), w, None, 1, 0, 1, w.shape[0])
    return F.silu(y).transpose(1, 2)


def conv_shifted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same as a sum of K shifted products in the [B, T, C] layout (fp32 accumulation)."""
    k, t = w.shape[-1], x.shape[1]
    xp = F.pad(x, (0, 0, k - 1, 0))
    wf = w.squeeze(1).float()  # [C, K]
    acc = xp[:, 0:t].float() * wf[:, 0]
    for j in range(1, k):
        acc = acc + xp[:, j:j + t].float() * wf[:, j]
    return F.silu(acc).to(x.dtype)


def bench(fn, *args: torch.Tensor, reps: int = 10) -> float:
    """Median ms of forward + backward."""
    times = []
    for i in range(reps + 3):
        for a in args:
            a.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        out = fn(*args)
        out.backward(torch.ones_like(out))
        e.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    t, c, hidden, hv, v = args.tokens, 8192, 2048, 32, 128
    x = torch.randn(1, t, c, device=dev, dtype=bf, requires_grad=True)
    w = (torch.randn(c, 1, 4, device=dev) * 0.5).to(bf).requires_grad_()
    ref = conv_cudnn(x, w).float()
    got = conv_shifted(x, w).float()
    print(f"conv shifted vs cudnn rel-L2 {(got - ref).norm() / ref.norm():.2e}")
    rows = [("conv cudnn eager", bench(conv_cudnn, x, w)),
            ("conv shifted eager", bench(conv_shifted, x, w)),
            ("conv cudnn compiled", bench(torch.compile(conv_cudnn), x, w)),
            ("conv shifted compiled", bench(torch.compile(conv_shifted), x, w))]
    o = torch.randn(1, t, hv, v, device=dev, dtype=bf, requires_grad=True)
    z = torch.randn(1, t, hv, v, device=dev, dtype=bf, requires_grad=True)
    ng = RMSNormGated(v).to(dev)
    rows += [("gated norm eager", bench(ng, o, z)),
             ("gated norm compiled", bench(torch.compile(ng), o, z))]
    h = torch.randn(1, t, hidden, device=dev, dtype=bf, requires_grad=True)
    n = RMSNorm(hidden).to(dev)
    rows += [("rmsnorm eager", bench(n, h)), ("rmsnorm compiled", bench(torch.compile(n), h))]
    for name, ms in rows:
        print(f"| {name:<24} | {ms:8.2f} ms |")


if __name__ == "__main__":
    main()
