"""``overlap-runtime demo``: the main job on CPU ranks this process spawns (gloo).

Until the MoE pipeline demo lands, the demo runs the most complete real job available: on 4
spawned ranks, a small sequence-parallel block built from the differentiable collectives —

1. a causal depthwise convolution over a sequence split across ranks (halo exchange of the
   previous rank's last ``kernel-1`` positions),
2. a linear recurrence carried from rank to rank (state chain: receive, compute, send early),
3. an expert-style all-to-all with uneven splits, overlapped with local compute (async),
4. an all-gather of per-rank summaries,

forward and backward, then checks the output and every input and weight gradient against the
same function computed in one process on the gathered sequence, and prints the rel-L2 of each.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks to spawn (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="global sequence length")
    parser.add_argument("--hidden", type=int, default=16, help="channels")
    parser.add_argument("--steps", type=int, default=3, help="forward/backward repetitions")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")


def _params(hidden: int, kernel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "conv": torch.randn(hidden, 1, kernel, generator=g) * 0.5,
        "decay": torch.rand(hidden, generator=g) * 0.5 + 0.4,
        "expert": torch.randn(hidden, hidden, generator=g) / hidden**0.5,
    }


def _tokens(seq: int, hidden: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(1, seq, hidden, generator=g)


def _routes(n_tokens: int, world: int, step: int) -> torch.Tensor:
    """Destination rank of every global token (uneven on purpose)."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, world, (n_tokens,), generator=g) ** 2 % world


def _block_single(x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole function on one process: [1, S, C] -> scalar loss."""
    k = p["conv"].shape[-1]
    h = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), p["conv"], groups=x.shape[-1]).transpose(1, 2)
    h = F.silu(h)
    state = torch.zeros(x.shape[-1])
    outs = []
    for t in range(x.shape[1]):  # linear recurrence s_t = d * s_{t-1} + h_t
        state = p["decay"] * state + h[0, t]
        outs.append(state)
    r = torch.stack(outs)[None]
    y = torch.tanh(r @ p["expert"])  # the "expert" is position-wise: routing does not change it
    summary = y.mean(dim=1)  # [1, C] per sequence
    return (y.pow(2).mean() + summary.pow(2).sum()) * 1.0


def _rank_main(rank: int, world: int, seq: int, hidden: int, steps: int) -> dict[str, Any]:
    from overlap_runtime.ops import comm

    kernel = 4
    local = seq // world
    report: dict[str, Any] = {}
    errs: dict[str, float] = {}
    for step in range(steps):
        params = {n: t.clone().requires_grad_(True) for n, t in _params(hidden, kernel).items()}
        x_full = _tokens(seq, hidden, step)
        x = x_full[:, rank * local:(rank + 1) * local].clone().requires_grad_(True)

        # 1. causal depthwise conv: halo from the previous rank
        halo = comm.halo_exchange(x, kernel - 1, dim=1)
        xc = torch.cat([halo, x], dim=1).transpose(1, 2)
        h = F.silu(F.conv1d(xc, params["conv"], groups=hidden).transpose(1, 2))

        # 2. linear recurrence carried across ranks
        s_in = comm.recv_prev((hidden,), x.dtype)
        state = torch.zeros(hidden) if s_in is None else s_in
        outs = []
        for t in range(local):
            state = params["decay"] * state + h[0, t]
            outs.append(state)
        r = torch.stack(outs)[None]
        send_handle, token = comm.send_next(state)

        # 3. tokens to "expert" ranks: async all-to-all, overlapped with local work
        routes = _routes(seq, world, step)
        mine = routes[rank * local:(rank + 1) * local]
        order = torch.argsort(mine, stable=True)
        in_splits = torch.bincount(mine, minlength=world).tolist()
        out_splits = [int((routes[j * local:(j + 1) * local] == rank).sum()) for j in range(world)]
        handle, received = comm.all_to_all_single(r[0][order], out_splits, in_splits, async_op=True)
        overlap_work = torch.randn(128, 128) @ torch.randn(128, 128)  # hides the all-to-all
        handle.wait()
        del overlap_work
        expert_out = torch.tanh(received @ params["expert"])
        back = comm.all_to_all_single(expert_out, in_splits, out_splits)
        y = torch.empty_like(back)
        y[order] = back
        y = y[None]

        # 4. gather per-rank partial means into the sequence summary
        partial = y.sum(dim=1) / seq  # [1, C]
        summary = comm.all_gather(partial, dim=0).sum(dim=0, keepdim=True)
        loss = y.pow(2).sum() / (seq * hidden) + summary.pow(2).sum() / world
        loss = comm.attach(loss, token)
        loss.backward()
        send_handle.wait()

        # the reference: the same function on one process
        ref_params = {n: t.clone().requires_grad_(True) for n, t in _params(hidden, kernel).items()}
        x_ref = x_full.clone().requires_grad_(True)
        ref_loss = _block_single(x_ref, ref_params)
        ref_loss.backward()
        from overlap_runtime.testing import rel_l2

        loss_sum = comm.all_gather(loss.detach().reshape(1), dim=0).sum()
        grads = {n: comm.all_gather(p.grad[None], dim=0).sum(0) for n, p in params.items()}
        errs_step = {
            "loss": rel_l2(loss_sum, ref_loss.detach()),
            "dx": rel_l2(x.grad, x_ref.grad[:, rank * local:(rank + 1) * local]),
            **{f"d{n}": rel_l2(grads[n], ref_params[n].grad) for n in params},
        }
        for k, v in errs_step.items():
            errs[k] = max(errs.get(k, 0.0), v)
        report["loss"] = float(loss_sum)
    report["errs"] = errs
    return report


def run(args: argparse.Namespace) -> int:
    from overlap_runtime.launch import spawn

    if args.seq % args.ranks:
        raise SystemExit(f"--seq {args.seq} must be a multiple of --ranks {args.ranks}")
    print(f"overlap-runtime demo: {args.ranks} CPU ranks (gloo), sequence {args.seq} split "
          f"{args.seq // args.ranks} per rank, hidden {args.hidden}, {args.steps} steps")
    t0 = time.perf_counter()
    reports = spawn(_rank_main, args.ranks, args=(args.seq, args.hidden, args.steps),
                    timeout_s=args.timeout)
    wall = time.perf_counter() - t0
    worst: dict[str, float] = {}
    for rep in reports:
        for k, v in rep["errs"].items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("checked against one process computing the same function (rel-L2, worst rank/step):")
    tol = 1e-5
    ok = True
    for k, v in worst.items():
        flag = "ok" if v <= tol else "FAIL"
        ok &= v <= tol
        print(f"  {k:>8}: {v:.2e}  {flag}")
    print("ops exercised: halo_exchange (conv halo), recv_prev/send_next (state chain), "
          "async all_to_all_single (uneven splits), all_gather; forward and backward")
    print(f"final loss {reports[0]['loss']:.6f}; wall {wall:.2f}s")
    if not ok:
        print(f"demo FAILED: some rel-L2 above {tol}")
        return 1
    print("demo OK")
    return 0
