"""Full-attention context parallelism, ring and Ulysses, zigzag sharding, against full attention.

What it shows:
  * zigzag sharding (``shard_sequence(..., load_balance="zigzag")``): the sequence is cut into
    2P chunks and rank r holds chunks r and 2P-1-r, so every rank does the same causal work;
  * the functions ``ring_attention`` (K/V go round the ring, online softmax) and
    ``ulysses_attention`` (sequence <-> head all-to-all) on q/k/v shards ``[B, S/P, H, D]``
    with grouped K/V heads, against ``torch.nn.functional.scaled_dot_product_attention`` over
    the whole sequence in float64 (output, dq, dk, dv);
  * the module path: ``ContextParallel(mode, load_balance="zigzag").apply(attn, cp_mesh)`` swaps
    the core of an attention layer (``overlap_runtime.layers.ReferenceAttention``: projections,
    RoPE, core); the tokens and the position ids are sharded by the same rule
    (``plan.shard``, ``plan.position_ids``); checked against the unmodified layer on the whole
    sequence (output and every parameter gradient, summed over the CP ranks); a ``CommStats`` passed
    to the call counts the communication it issued;
  * the check: every figure must be <= 1e-5 (rel-L2, fp32).

Run (CPU, gloo; 2 ranks, or 4: heads 4 and K/V heads 2 suit both):
  torchrun --nproc-per-node 2 examples/attention_context_parallel.py

Prints (rank 0; numbers vary in the last digits):
  ring (function): out 1.2e-07  dq 1.9e-07  dk 1.8e-07  dv 1.5e-07
  ulysses (function): out 1.3e-07  dq 2.7e-07  dk 2.6e-07  dv 2.3e-07
  ring (layer): out 1.4e-07  worst parameter gradient 3.3e-07
    comm of rank 0: {'backward/recv': 2, 'backward/send': 2, 'forward/recv': 1, 'forward/send': 1}
  ulysses (layer): out 0.0e+00  worst parameter gradient 2.5e-07
    comm of rank 0: {'backward/all_to_all': 2, 'forward/all_to_all': 2}
  CHECK attention_context_parallel: max rel-L2 3.3e-07 <= 1e-05 (ring, ulysses): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from overlap_runtime.context_parallel import (CommStats, ContextParallel, gather_sequence,
                                              ring_attention, shard_sequence, ulysses_attention)
from overlap_runtime.launch import init_from_env
from overlap_runtime.layers import ReferenceAttention

BATCH, SEQ_LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 4, 2, 8  # SEQ_LEN % (2 * ranks) == 0
HIDDEN = HEADS * HEAD_DIM
TOL = 1e-5


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over the whole sequence; q ``[B, S, Hq, D]``, k/v ``[B, S, Hkv, D]``."""
    rep = q.shape[2] // k.shape[2]  # grouped K/V heads: query head h reads K/V head h // rep
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
        v.repeat_interleave(rep, 2).transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def check_functions(rank: int, world: int, group: dist.ProcessGroup) -> tuple[float, list[str]]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, SEQ_LEN, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, SEQ_LEN, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, SEQ_LEN, KV_HEADS, HEAD_DIM, generator=g)
    dout = torch.randn(BATCH, SEQ_LEN, HEADS, HEAD_DIM, generator=g)
    full = [t.double().requires_grad_(True) for t in (q, k, v)]
    out_ref = full_attention(*full)
    out_ref.backward(dout.double())

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, world, rank, seq_dim=1, load_balance="zigzag")

    worst, lines = 0.0, []
    for name, attention in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        local = [shard(t).clone().requires_grad_(True) for t in (q, k, v)]  # [B, S/P, H, D]
        out = attention(*local, group=group, causal=True, load_balance="zigzag")
        out.backward(shard(dout))
        errs = {"out": rel_l2(out.detach(), shard(out_ref.detach()))}
        for label, t, ref in zip(("dq", "dk", "dv"), local, full):
            errs[label] = rel_l2(t.grad, shard(ref.grad))
        worst = max(worst, *errs.values())
        lines.append(f"{name} (function): " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    return worst, lines


def check_layer(rank: int, world: int) -> tuple[float, list[str]]:
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    torch.manual_seed(0)
    reference = ReferenceAttention(HIDDEN, HEADS, KV_HEADS)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SEQ_LEN, HIDDEN, generator=g)
    w = torch.randn(BATCH, SEQ_LEN, HIDDEN, generator=g)  # loss = sum(out * w)
    out_ref = reference(x, torch.arange(SEQ_LEN))
    (out_ref * w).sum().backward()

    worst, lines = 0.0, []
    for mode in ("ring", "ulysses"):
        plan = ContextParallel(mode=mode, load_balance="zigzag")
        attn = plan.apply(copy.deepcopy(reference), cp_mesh)
        attn.zero_grad(set_to_none=True)
        x_local = plan.shard(x, cp_mesh)  # [B, S/P, hidden], zigzag
        positions = plan.position_ids(SEQ_LEN, cp_mesh)  # [S/P], same rule as the tokens
        stats = CommStats()  # optional: what this call sent, forward and backward
        out = attn(x_local, positions, stats=stats)
        (out * plan.shard(w, cp_mesh)).sum().backward()
        full_out = gather_sequence(out.detach(), cp_mesh.get_group(), seq_dim=1,
                                   load_balance="zigzag")  # back in true sequence order
        errs = {"out": rel_l2(full_out, out_ref.detach())}
        param_errs = []
        for p, q in zip(attn.parameters(), reference.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # each rank holds the gradient of its own tokens
            param_errs.append(rel_l2(grad, q.grad))
        errs["worst parameter gradient"] = max(param_errs)
        worst = max(worst, *errs.values())
        lines.append(f"{mode} (layer): " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items())
                     + f"\n  comm of rank {rank}: {stats.as_dict()}")
    return worst, lines


def main() -> int:
    rc = init_from_env("cpu")
    rank, world = rc.rank, rc.world_size
    if SEQ_LEN % (2 * world) or HEADS % world or KV_HEADS % world:
        raise ValueError(f"{world} ranks: zigzag needs SEQ_LEN={SEQ_LEN} % {2 * world} == 0, "
                         f"Ulysses HEADS={HEADS} and KV_HEADS={KV_HEADS} multiples of {world}")
    group = dist.new_group(list(range(world)))  # the CP group: every rank here
    worst_fn, lines_fn = check_functions(rank, world, group)
    worst_layer, lines_layer = check_layer(rank, world)
    worst = torch.tensor(max(worst_fn, worst_layer), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = float(worst) <= TOL
    if rank == 0:
        print("\n".join(lines_fn + lines_layer))
        print(f"CHECK attention_context_parallel: max rel-L2 {float(worst):.1e} <= {TOL:g} "
              f"(ring, ulysses): {'OK' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
