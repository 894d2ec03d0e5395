"""Node costs of the Triton p2p GDN chain on one GPU, and the simulator's CP predictions.

Used by ``benchmarks/gdn_cp_gpu.py --predict`` (GPU only). For a local length ``L``:

1. :func:`measure_node_costs` runs the Triton op's forward and backward cores
   (``ops/gdn/triton/function.py``: ``gdn_forward`` / ``gdn_backward``) on the layer's shapes
   with a :class:`~overlap_runtime.ops.gdn.state_link.StateLink` that only records CUDA events at
   the chain's hook points (it hands in zero states, so the chain does a middle rank's work), and
   splits the op's time into the six GDN node kinds of the Triton chain
   (``context_parallel/gdn/step_costs.py``: how they price the compiled step's ops); the layer
   outside the GDN core is the plain layer's forward (and forward + backward) time minus the
   op's phases.
2. :func:`measure_state_message` times one fp32 state message ``[B, HV, K, V]`` from rank 0 to
   rank 1 (NCCL send/recv, device-synchronised, median).
3. :func:`predict` prices the compiled step of one GDN layer on each CP size with those costs
   and simulates it (``benchmarks/gdn_chain_step.py``; weak scaling: every rank holds ``L``
   tokens), and reports the makespan and ``eff = T_1(L) / T_P``.

The prediction knows the chain, not the machine's side effects (NCCL kernels sharing SMs,
host launch gaps, the halo): the measured CP2 row next to its prediction says how far that
goes.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.gdn_chain_step import predict_chain
from overlap_runtime.context_parallel.gdn.step_costs import GDN_P2P_FUSED_NODE_KINDS
from overlap_runtime.ops.gdn.state_link import StateLink

__all__ = ["measure_node_costs", "measure_state_message", "predict"]


class _Clock(StateLink):
    """Records a CUDA event at each hook; hands in zero states (a middle rank's chain)."""

    min_segments = 2

    def __init__(self, zeros: torch.Tensor) -> None:
        self.zeros = zeros
        self.events: dict[str, torch.cuda.Event] = {}

    def mark(self, name: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events[name] = event

    def entering_state(self) -> torch.Tensor:
        self.mark("fwd_pre")
        return self.zeros

    def leaving_state(self, h_out: torch.Tensor) -> None:
        self.mark("fwd_chain")

    def leaving_state_grad(self) -> torch.Tensor:
        self.mark("bwd_pre")
        return self.zeros

    def entering_state_grad(self, dh_in: torch.Tensor) -> None:
        self.mark("bwd_chain")


def _median_ms(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def measure_node_costs(layer_fwd_ms: float, layer_fwd_bwd_ms: float, local_len: int,
                       key_heads: int, value_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device, iters: int = 10) -> dict[str, float]:
    """Median ms of every kind of :data:`GDN_P2P_FUSED_NODE_KINDS` at local length ``L``.

    Args:
        layer_fwd_ms, layer_fwd_bwd_ms: the plain layer's forward and forward + backward on one
            device over ``L`` tokens (the ``layer_*`` kinds are these minus the op's phases).
    """
    from overlap_runtime.ops.gdn.triton.function import gdn_backward, gdn_forward

    gen = torch.Generator(device=device).manual_seed(7)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = randn(1, local_len, key_heads, head_dim).to(dtype)
    k = randn(1, local_len, key_heads, head_dim).to(dtype)
    v = randn(1, local_len, value_heads, head_dim).to(dtype)
    g = F.logsigmoid(randn(1, local_len, value_heads) + 4.0)
    beta = torch.sigmoid(randn(1, local_len, value_heads)).to(dtype)
    do = randn(1, local_len, value_heads, head_dim).to(dtype)
    zeros = torch.zeros(1, value_heads, head_dim, head_dim, device=device)
    scale = head_dim ** -0.5

    samples = []
    for i in range(iters + 2):
        clock = _Clock(zeros)
        torch.cuda.synchronize(device)
        clock.mark("start")
        _, _, saved, meta = gdn_forward(q, k, v, g, beta, None, scale, True, None, link=clock)
        clock.mark("fwd_end")
        gdn_backward(saved, meta, do, None, link=clock)
        clock.mark("bwd_end")
        torch.cuda.synchronize(device)
        del saved
        if i < 2:  # compile / autotune
            continue
        ev = clock.events

        def span(a: str, b: str) -> float:
            return ev[a].elapsed_time(ev[b])
        samples.append({
            "gdn_fwd_pre": span("start", "fwd_pre"),
            "gdn_fwd_chain": span("fwd_pre", "fwd_chain"),
            "gdn_fwd_post": span("fwd_chain", "fwd_end"),
            "gdn_bwd_pre": span("fwd_end", "bwd_pre"),
            "gdn_bwd_chain": span("bwd_pre", "bwd_chain"),
            "gdn_bwd_post": span("bwd_chain", "bwd_end"),
        })
    costs = _median_ms(samples)
    gdn_fwd = costs["gdn_fwd_pre"] + costs["gdn_fwd_chain"] + costs["gdn_fwd_post"]
    gdn_bwd = costs["gdn_bwd_pre"] + costs["gdn_bwd_chain"] + costs["gdn_bwd_post"]
    costs["layer_fwd"] = max(layer_fwd_ms - gdn_fwd, 0.0)
    costs["layer_bwd"] = max(layer_fwd_bwd_ms - layer_fwd_ms - gdn_bwd, 0.0)
    assert set(costs) == set(GDN_P2P_FUSED_NODE_KINDS)
    return costs


def measure_state_message(value_heads: int, head_dim: int, device: torch.device,
                          iters: int = 20) -> float:
    """Median ms of one fp32 ``[1, HV, K, V]`` message rank 0 -> rank 1 (every rank calls)."""
    rank = dist.get_rank()
    buf = torch.randn(1, value_heads, head_dim, head_dim, device=device)
    samples = []
    for i in range(iters + 3):
        torch.cuda.synchronize(device)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
        end.record()
        end.synchronize()
        ms = torch.tensor([start.elapsed_time(end)], device=device)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if i >= 3:
            samples.append(ms.item())
    return statistics.median(samples)


def predict(costs: dict[str, float], message_ms: float, cp_sizes: list[int],
            local_len: int) -> list[dict[str, Any]]:
    """Simulated makespan (ms) and weak-scaling efficiency of the Triton chain per CP size:
    the compiled step of one GDN layer on ``local_len`` tokens per rank, priced with
    ``costs`` and one state message of ``message_ms``."""
    one = sum(costs.values())
    rows = []
    for p in cp_sizes:
        makespan = predict_chain(costs, message_ms, p, local_len).step_s
        rows.append({"cp": p, "makespan_ms": makespan, "eff": one / makespan,
                     "one_device_ms": one})
    return rows
