"""MoE all-to-all overlap, measured: serial vs overlapped, and the share of all-to-all hidden.

Two overlaps of seed 001, on EP ranks (every rank holds ``experts / world`` experts):

* **A, shared expert**: one MoE layer, forward + backward, with the shared expert run while the
  combine all-to-all is in flight (``overlap_shared_expert=True``) vs after it;
* **B, OVERLAP_B_F pairing**: a chunk of ``--layers`` blocks (mixer + MoE with shared expert);
  the forward of microbatch k+1 (caller thread) beside the backward of microbatch k (worker
  thread) through ``CommComputeOverlap`` and the sync hooks, vs the same two run one after the
  other (coordinator disabled).

The all-to-all time is measured alone: ``comm.all_to_all_single`` with the splits of a real
dispatch of the same batch, timed over the same iterations. A layer moves that payload four
times (dispatch, combine and their backwards) and a pairing ``4 * layers`` times. Reported:
serial and overlapped times (median), all-to-all time, its share of the serial time, and the
share hidden = ``(serial - overlapped) / all-to-all time`` (clamped to [0, 1]).

GPU (NCCL, bf16; grouped GEMMs where ``torch._grouped_mm`` is supported)::

    torchrun --nproc-per-node 2 -m benchmarks.moe_overlap
    OUT=/tmp/res torchrun --nproc-per-node 2 -m benchmarks.moe_overlap --tokens 16384

CPU smoke test (spawns 2 gloo ranks, fp32, tiny sizes)::

    .venv/bin/python -m benchmarks.moe_overlap --device cpu

Default sizes aim for all-to-all >= 30% of a serial step on one NVLink node; the script prints
the measured share and warns when it is below 30% (raise ``--tokens``, lower ``--ffn``).
Results: a table on stdout; JSON at ``--json`` or ``$OUT/moe_overlap.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank per microbatch")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None, help="routed expert FFN width")
    p.add_argument("--shared-ffn", type=int, default=None, help="shared expert FFN width")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--expert-backend", choices=["loop", "grouped_mm"], default=None,
                   help="default: grouped_mm on cuda, loop on cpu (printed with the results)")
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="MoE layers per chunk (pairing)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--ranks", type=int, default=2, help="CPU mode: ranks to spawn")
    p.add_argument("--json", default=None, help="result file (default $OUT/moe_overlap.json)")
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    defaults = dict(tokens=8192 if gpu else 64, hidden=4096 if gpu else 32,
                    ffn=1024 if gpu else 32, shared_ffn=2048 if gpu else 32,
                    warmup=5 if gpu else 2, iters=20 if gpu else 5)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


class _Block(nn.Module):
    def __init__(self, a: argparse.Namespace, moe_cls: Any) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(a.hidden)
        self.mixer = nn.Linear(a.hidden, a.hidden, bias=False)
        self.moe = moe_cls(a.hidden, a.ffn, a.experts, a.top_k, shared_ffn_hidden=a.shared_ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.silu(self.mixer(self.norm(x)))
        return x + self.moe(x)


def _median_time(fn: Callable[[], Any], warmup: int, iters: int, device: torch.device,
                 group: Any) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _bench(rank: int, world: int, a: argparse.Namespace) -> dict[str, Any]:
    from overlap_runtime.coordinator import CommComputeOverlap, HookCoordinator
    from overlap_runtime.moe import ExpertParallel, MoE, OverlapExpertParallel
    from overlap_runtime.ops import comm

    device = torch.device(f"cuda:{torch.cuda.current_device()}" if a.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    group = dist.group.WORLD
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)

    def batch(seed: int) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(seed * 97 + rank)
        return torch.randn(a.tokens, a.hidden, generator=g).to(device, dtype)

    # --- A: one MoE layer, shared expert beside the combine or after it
    torch.manual_seed(0)
    backend = a.expert_backend or ("grouped_mm" if a.device == "cuda" else "loop")
    layer = MoE(a.hidden, a.ffn, a.experts, a.top_k, shared_ffn_hidden=a.shared_ffn,
                expert_backend=backend)
    layer = ExpertParallel().apply(layer.to(device, dtype), group)
    xa = batch(0).requires_grad_(True)
    gy = torch.randn(a.tokens, a.hidden, generator=gen).to(device, dtype)

    def layer_step() -> None:
        layer(xa).backward(gy)

    res: dict[str, Any] = {"backend": layer.experts.resolved_backend(xa)}
    times = {}
    for overlap in (False, True):
        layer.overlap_shared_expert = overlap
        times[overlap] = _median_time(layer_step, a.warmup, a.iters, device, group)
    # all-to-all alone, with the splits of this batch's dispatch
    with torch.no_grad():
        routing = layer.router(xa)
        _, _, meta = layer.dispatcher.dispatch(xa, routing)
    payload = torch.randn(sum(meta.input_splits), a.hidden, generator=gen).to(device, dtype)

    def a2a() -> None:
        comm.all_to_all_single(payload, list(meta.output_splits), list(meta.input_splits), group)

    t_a2a = _median_time(a2a, a.warmup, a.iters, device, group)
    res["A_shared_expert"] = _row(times[False], times[True], 4 * t_a2a, t_combine=t_a2a)

    # --- B: forward chunk k+1 beside backward chunk k
    coord = HookCoordinator(timeout_s=300)
    torch.manual_seed(1)
    chunk = nn.Sequential(*[_Block(a, MoE) for _ in range(a.layers)]).to(device, dtype)
    OverlapExpertParallel(coord).apply(chunk, group)
    overlap = CommComputeOverlap(coord, device)
    xs = [batch(1 + i) for i in range(2)]
    state: dict[str, Any] = {"out": chunk(xs[0])}

    def pair() -> None:
        prev = state["out"]
        out, _ = overlap.run(lambda: chunk(xs[1]), lambda: prev.backward(torch.ones_like(prev)))
        state["out"] = out

    pair_times = {}
    for overlapped in (False, True):
        if overlapped:
            coord.enable()
        else:
            coord.disable()
        pair_times[overlapped] = _median_time(pair, a.warmup, a.iters, device, group)
    state["out"].backward(torch.ones_like(state["out"]))
    overlap.close()
    res["B_overlap_b_f_pair"] = _row(pair_times[False], pair_times[True], 4 * a.layers * t_a2a)
    res["a2a_ms"] = t_a2a * 1e3
    res["a2a_rows_sent"] = sum(meta.input_splits)
    return res


def _row(serial: float, overlapped: float, a2a: float, t_combine: float | None = None) -> dict:
    row = {"serial_ms": serial * 1e3, "overlapped_ms": overlapped * 1e3,
           "speedup": serial / overlapped if overlapped > 0 else float("nan"),
           "a2a_ms": a2a * 1e3, "a2a_share_of_serial": a2a / serial if serial > 0 else 0.0,
           "hidden_share_of_a2a": min(1.0, max(0.0, (serial - overlapped) / a2a)) if a2a else 0.0}
    if t_combine is not None:  # direction A can hide at most the forward combine
        row["hidden_share_of_combine"] = min(1.0, max(0.0, (serial - overlapped) / t_combine))
    return row


def _report(results: list[dict[str, Any]], a: argparse.Namespace, world: int) -> None:
    worst = {}  # the slowest rank decides the step
    for key in ("A_shared_expert", "B_overlap_b_f_pair"):
        worst[key] = max((r[key] for r in results), key=lambda row: row["overlapped_ms"])
    dtype = "bf16" if a.device == "cuda" else "fp32"
    print(f"MoE overlap, EP={world} on {a.device} ({dtype}, experts backend "
          f"{results[0]['backend']}): tokens/rank {a.tokens}, hidden {a.hidden}, ffn {a.ffn}, "
          f"shared ffn {a.shared_ffn}, {a.experts} experts top-{a.top_k}, {a.layers} layers/chunk")
    print(f"all-to-all of one dispatch payload ({results[0]['a2a_rows_sent']} rows): "
          f"{results[0]['a2a_ms']:.3f} ms (rank 0, median)")
    print("| overlap | serial ms | overlapped ms | speedup | a2a ms | a2a / serial | "
          "a2a hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, row in worst.items():
        print(f"| {key} | {row['serial_ms']:.3f} | {row['overlapped_ms']:.3f} | "
              f"{row['speedup']:.3f} | {row['a2a_ms']:.3f} | {row['a2a_share_of_serial']:.1%} | "
              f"{row['hidden_share_of_a2a']:.1%} |")
        if row["a2a_share_of_serial"] < 0.30:
            print(f"  note: all-to-all is {row['a2a_share_of_serial']:.0%} of the serial time in "
                  f"{key} (< 30%); raise --tokens or lower --ffn for a comm-bound setting")
    path = a.json or (os.path.join(os.environ["OUT"], "moe_overlap.json") if os.environ.get("OUT")
                      else None)
    if path:
        with open(path, "w") as fh:
            json.dump({"config": vars(a), "world": world, "per_rank": results, "worst": worst},
                      fh, indent=1)
        print(f"JSON: {path}")


def _spawned(rank: int, world: int, a: argparse.Namespace) -> dict[str, Any]:
    return _bench(rank, world, a)


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    if a.device == "cpu" and "RANK" not in os.environ:
        from overlap_runtime.launch import spawn

        results = spawn(_spawned, a.ranks, args=(a,), timeout_s=600)
        _report(results, a, a.ranks)
        return 0
    from overlap_runtime.launch import init_from_env
    from overlap_runtime.ops.comm import all_gather

    init_from_env(a.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    res = _bench(rank, world, a)
    dev = torch.device(f"cuda:{torch.cuda.current_device()}") if a.device == "cuda" else "cpu"
    blob = torch.tensor(list(json.dumps(res).encode()), dtype=torch.uint8)
    n = all_gather(torch.tensor([blob.numel()], device=dev), 0).cpu()
    padded = torch.zeros(int(n.max()), dtype=torch.uint8)
    padded[: blob.numel()] = blob
    rows = all_gather(padded[None].to(dev), 0).cpu()
    results = [json.loads(bytes(rows[r, : int(n[r])].tolist()).decode()) for r in range(world)]
    if rank == 0:
        _report(results, a, world)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
