"""Micro-benchmark of the GDN layer's causal depthwise conv + SiLU on one GPU (issue #29): the
Triton kernels (``conv_backend="triton"``, ``ops.causal_conv``) against cuDNN's depthwise
``F.conv1d`` (``layers.elementwise.causal_conv_silu``) and the compiled sum of shifted products
(``causal_conv_silu_shifted`` under ``torch.compile``, what ``train.compile`` runs with
``conv_backend="torch"``).

    python -m benchmarks.causal_conv --tokens 8192 16384 32768 --channels 8192
    python -m benchmarks.causal_conv --tokens 32768 --channels 2048 8192 --impls triton \
        --bwd-tiles 256x16x4 128x32x4 64x64x4   # the backward's tile sweep (rows x channels x warps)
    python -m benchmarks.causal_conv --tokens 32768 --channels 8192 --impls triton \
        --fwd-tiles 32x128x4 64x128x4 64x64x4 128x64x8   # the forward's (the backward's default)

For each size: median ms of the forward and of forward + backward (``triton.testing.do_bench``),
the memory floor (x read and y written once forward; x, dy read and dx written once more
backward, at ``--hbm-tbps``) and the rel-L2 of y, dx and dweight against a float64 reference
(``F.conv1d`` on the float64 inputs). Prints one markdown table.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch


from overlap_runtime.layers.elementwise import causal_conv_silu, causal_conv_silu_shifted  # noqa: E402
from overlap_runtime.ops.causal_conv import causal_conv_silu_triton, function  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def measure(name: str, fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor,
            dy: torch.Tensor, ref: tuple[torch.Tensor, ...], dilation: int) -> dict:
    """Time forward and forward + backward of ``fn``, and its errors against ``ref``."""
    from triton.testing import do_bench

    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def fwd() -> None:
        with torch.no_grad():
            fn(x, w, None, dilation)

    def fwd_bwd() -> None:
        y = fn(xg, wg, None, dilation)
        torch.autograd.grad(y, (xg, wg), dy)

    y = fn(xg, wg, None, dilation)
    dx, dw = torch.autograd.grad(y, (xg, wg), dy)
    errors = {"y": rel_l2(y, ref[0]), "dx": rel_l2(dx, ref[1]), "dw": rel_l2(dw, ref[2])}
    return {"name": name, "fwd": do_bench(fwd, warmup=25, rep=200),
            "fwd_bwd": do_bench(fwd_bwd, warmup=25, rep=200), **errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--channels", type=int, nargs="+", default=[8192])
    parser.add_argument("--kernel", type=int, default=4)
    parser.add_argument("--dilation", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the floor")
    parser.add_argument("--impls", nargs="+", default=["triton", "cudnn", "compiled"],
                        choices=["triton", "cudnn", "compiled"])
    parser.add_argument("--bwd-tiles", nargs="+", default=[],
                        help="Triton backward tiles to sweep, ROWSxCHANNELSxWARPS[xPROGRAM_ROWS] "
                             "(e.g. 32x64x4, 32x64x4x128: rows per program, "
                             "function.BACKWARD_ROWS); default: the module's")
    parser.add_argument("--fwd-tiles", nargs="+", default=[],
                        help="Triton forward tiles to sweep, ROWSxCHANNELSxWARPS (e.g. 32x128x4: "
                             "function.BLOCK_T, BLOCK_C, FORWARD_WARPS); each with the default "
                             "backward; default: the module's")
    args = parser.parse_args()
    if args.fwd_tiles and args.bwd_tiles:
        raise SystemExit("--fwd-tiles and --bwd-tiles: sweep one at a time")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/causal_conv.py needs a CUDA device")
    dtype, dev = DTYPES[args.dtype], torch.device("cuda")
    compiled_shifted = torch.compile(causal_conv_silu_shifted) if "compiled" in args.impls else None
    print(f"| tokens | C | impl | fwd ms | fwd+bwd ms | floor fwd / fwd+bwd ms | rel-L2 y | dx | dw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens, channels in [(t, c) for t in args.tokens for c in args.channels]:
        gen = torch.Generator(device=dev).manual_seed(tokens)
        x = torch.randn(1, tokens, channels, device=dev, dtype=dtype, generator=gen)
        # the weight in the activations' dtype, as FSDP2's bf16 parameter copy hands it over
        w = (torch.randn(channels, args.kernel, device=dev, generator=gen) * 0.5).to(dtype)
        dy = torch.randn(1, tokens, channels, device=dev, dtype=dtype, generator=gen)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        yd = causal_conv_silu(xd, wd, None, args.dilation)
        ref = (yd.detach(), *torch.autograd.grad(yd, (xd, wd), dy.double()))
        del xd, wd, yd
        elem = x.numel() * x.element_size()
        floor_fwd = 2 * elem / (args.hbm_tbps * 1e12) * 1e3
        floor_all = 5 * elem / (args.hbm_tbps * 1e12) * 1e3
        runs = []
        if "triton" in args.impls:
            default = (function.BACKWARD_BLOCK_T, function.BACKWARD_BLOCK_C,
                       function.BACKWARD_WARPS)
            fwd_default = (function.BLOCK_T, function.BLOCK_C, function.FORWARD_WARPS)
            for tile in args.fwd_tiles:
                fields = tuple(int(v) for v in tile.split("x"))
                if len(fields) != 3:
                    raise SystemExit(f"--fwd-tiles {tile}: ROWSxCHANNELSxWARPS")
                runs.append((f"triton fwd {tile}", causal_conv_silu_triton, ("fwd", *fields)))
            for tile in args.bwd_tiles or ([] if args.fwd_tiles else
                                           ["x".join(map(str, default))]):
                fields = [int(v) for v in tile.split("x")]
                fields += [function.BACKWARD_ROWS] * (4 - len(fields))
                runs.append((f"triton bwd {tile}", causal_conv_silu_triton, tuple(fields)))
        if "cudnn" in args.impls:
            runs.append(("F.conv1d (cuDNN)", causal_conv_silu, None))
        if "compiled" in args.impls:
            runs.append(("compiled shifted", compiled_shifted, None))
        for name, fn, tile in runs:
            if tile is not None and tile[0] == "fwd":
                function.BLOCK_T, function.BLOCK_C, function.FORWARD_WARPS = tile[1:]
            elif tile is not None:
                function.BLOCK_T, function.BLOCK_C, function.FORWARD_WARPS = fwd_default
                (function.BACKWARD_BLOCK_T, function.BACKWARD_BLOCK_C,
                 function.BACKWARD_WARPS, function.BACKWARD_ROWS) = tile
            r = measure(name, fn, x, w, dy, ref, args.dilation)
            print(f"| {tokens} | {channels} | {name} | {r['fwd']:.3f} | {r['fwd_bwd']:.3f} | "
                  f"{floor_fwd:.3f} / {floor_all:.3f} | {r['y']:.2e} | {r['dx']:.2e} | "
                  f"{r['dw']:.2e} |", flush=True)
        del ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
