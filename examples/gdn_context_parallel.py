"""A Gated DeltaNet layer under context parallelism (ulysses and p2p) against one process.

What it shows:
  * ``overlap_runtime.layers.GatedDeltaNet`` (the Qwen3.5 linear-attention layer) built once,
    then copied and made context parallel with
    ``LinearAttentionContextParallel(mode, backend="eager").apply(layer, cp_mesh)`` for
    ``mode="ulysses"`` (sequence <-> head all-to-all) and ``mode="p2p"`` (causal-conv halo and the
    recurrent state passed rank to rank as affine summaries);
  * the input at the CP boundary: each rank holds a contiguous shard ``[B, S/P, hidden]`` of the
    sequence (rank r: tokens ``[r S/P, (r+1) S/P)``), and gets its shard of the output back;
  * the check: the gathered output, the input gradient and every parameter gradient (summed over
    the CP ranks, as FSDP/DDP would) against the unmodified layer on the whole sequence in one
    process (rel-L2, fp32, must be <= 1e-5).

Run (CPU, gloo; 2 or 4 ranks: ulysses needs the 2 key and 4 value heads to divide by them):
  torchrun --nproc-per-node 2 examples/gdn_context_parallel.py

Prints (rank 0; numbers vary in the last digits):
  ulysses: out 2.4e-07  dx 4.3e-07  worst parameter gradient 1.3e-06
  p2p: out 2.4e-07  dx 3.9e-07  worst parameter gradient 1.4e-06
  CHECK gdn_context_parallel: max rel-L2 1.4e-06 <= 1e-05 (ulysses, p2p): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.launch import init_from_env
from overlap_runtime.layers import GatedDeltaNet

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 32, 2, 4, 8
BATCH, SEQ_LEN = 2, 96  # global sequence; each of P ranks holds SEQ_LEN / P tokens
TOL = 1e-5


def build_layer() -> GatedDeltaNet:
    """A tiny Qwen3.5-shaped GDN layer, fp32, eager backend, identical on every rank."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, backend="eager")
    with torch.no_grad():
        # Slow decay: the state entering a rank still matters at its end, so a broken state
        # chain would show in the check (the default init forgets within a few tokens).
        layer.A_log.uniform_(-5.0, -3.0)
        layer.dt_bias.uniform_(-2.0, 0.0)
    return layer


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def gather_seq(x: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate every rank's contiguous shard ``[B, S/P, C]`` -> ``[B, S, C]``."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def main() -> int:
    rc = init_from_env("cpu")
    rank, world = rc.rank, rc.world_size
    if SEQ_LEN % world:
        raise ValueError(f"SEQ_LEN={SEQ_LEN} is not a multiple of the {world} ranks")
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ_LEN, HIDDEN, generator=g)  # the same global batch everywhere
    w = torch.randn(BATCH, SEQ_LEN, HIDDEN, generator=g)  # loss weights: loss = sum(out * w)

    # Reference: the plain layer on the whole sequence, one process.
    reference = build_layer()
    x_ref = x.clone().requires_grad_(True)
    out_ref = reference(x_ref)
    (out_ref * w).sum().backward()

    local = SEQ_LEN // world
    mine = slice(rank * local, (rank + 1) * local)
    worst = 0.0
    lines = []
    for mode in ("ulysses", "p2p"):
        layer = LinearAttentionContextParallel(mode=mode, backend="eager").apply(
            copy.deepcopy(reference), cp_mesh["cp"])
        layer.zero_grad(set_to_none=True)
        x_local = x[:, mine].clone().requires_grad_(True)  # [B, S/P, hidden]
        out_local = layer(x_local)  # [B, S/P, hidden]
        (out_local * w[:, mine]).sum().backward()
        errs = {"out": rel_l2(gather_seq(out_local.detach(), world), out_ref.detach()),
                "dx": rel_l2(gather_seq(x_local.grad, world), x_ref.grad)}
        param_errs = []
        for (name, p), (_, q) in zip(layer.named_parameters(), reference.named_parameters()):
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)  # each rank holds the gradient of its own tokens
            param_errs.append(rel_l2(grad, q.grad))
        errs["param"] = max(param_errs)
        worst = max(worst, *errs.values())
        lines.append(f"{mode}: out {errs['out']:.1e}  dx {errs['dx']:.1e}  "
                     f"worst parameter gradient {errs['param']:.1e}")

    worst_t = torch.tensor(worst, dtype=torch.float64)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    ok = float(worst_t) <= TOL
    if rank == 0:
        print("\n".join(lines))
        print(f"CHECK gdn_context_parallel: max rel-L2 {float(worst_t):.1e} <= {TOL:g} "
              f"(ulysses, p2p): {'OK' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
