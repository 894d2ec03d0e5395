"""The trainer on a 4D layout (FSDP2 x CP x PP x EP), compared step by step with one device.

What it shows:
  * a ``TrainConfig`` built in the script (``config_from_dict``; the same fields as a YAML file
    such as configs/tiny_4d_pp2_ep2_cp2.yaml): a tiny Qwen3.5-style hybrid MoE (3 Gated DeltaNet
    layers + 1 attention layer, 4 experts, shared expert) on 8 ranks laid out as
    pp 2 (Interleaved 1F1B, 2 chunks per rank) x dp_shard 2 x cp 2 (p2p GDN CP, ring attention),
    with EP 2 borrowed from dp_shard x cp and FSDP2 over the 4 ranks of each pipeline stage;
  * ``train_distributed(config)`` on the ranks torchrun started (``ParallelDims`` builds every
    mesh), then ``train_single(config)``: the same model, data and optimizer on one process;
  * the checks: the first step's communication, recorded on every rank, is the step graph's
    (``train.check_conformance``: every all-to-all, CP message and pipeline send in the order
    the graph says, or the run raises), and every step's loss and gradient norm agree with one
    device within 1e-5 relative (``compare_runs``). Every token goes to every expert (top-k =
    number of experts) so no routing tie can flip between the two runs.

Run (CPU, gloo; exactly 8 ranks):
  torchrun --nproc-per-node 8 examples/train_4d.py

Prints (rank 0; numbers vary in the last digits):
  step graph: 1952 tasks, 2640 edges on 8 ranks (built in 0.04s, validated in 0.00s)
  step graph: step 1 conforms (864 launches recorded on 8 ranks)
  step 1/5  loss 5.563675  grad_norm 1.184454e+00  lr 3.00e-03  tok/s 302  (1695.9 ms)
  step 2/5  loss 5.484763  grad_norm 1.680112e+00  lr 3.00e-03  tok/s 509  (1005.7 ms)
  step 3/5  loss 5.391442  grad_norm 1.200641e+00  lr 3.00e-03  tok/s 500  (1024.4 ms)
  step 4/5  loss 5.302928  grad_norm 1.294038e+00  lr 3.00e-03  tok/s 554  (924.9 ms)
  step 5/5  loss 5.184281  grad_norm 1.341931e+00  lr 3.00e-03  tok/s 580  (882.8 ms)
  layout: pp2(interleaved_1f1b,v2) x fsdp4 x cp2:p2p/ring x ep2
  step 1: loss 5.563675 vs 5.563675 (one device), grad norm 1.184454e+00 vs 1.184454e+00
  step 2: loss 5.484763 vs 5.484763 (one device), grad norm 1.680112e+00 vs 1.680113e+00
  step 3: loss 5.391442 vs 5.391443 (one device), grad norm 1.200641e+00 vs 1.200641e+00
  step 4: loss 5.302928 vs 5.302928 (one device), grad norm 1.294038e+00 vs 1.294038e+00
  step 5: loss 5.184281 vs 5.184282 (one device), grad norm 1.341931e+00 vs 1.341930e+00
  CHECK train_4d: max relative difference 4.4e-07 <= 1e-05 (loss and grad norm, 5 steps): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from overlap_runtime.launch import init_from_env
from overlap_runtime.trainer import compare_runs, config_from_dict, train_distributed, train_single

WORLD = 8
TOL = 1e-5

CONFIG = {
    "model": {
        "hidden_size": 32, "num_hidden_layers": 4, "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "mlp": "moe", "num_experts": 4, "num_experts_per_tok": 4,  # every token to every expert
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "moe_aux_loss_coef": 0.0,
    },
    "data": {"seq_len": 64, "batch_size": 4},  # global length; 4 sequences per dp rank
    "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
    "train": {
        "steps": 5, "seed": 0, "precision": "fp32", "check_conformance": True,
        "accelerator": {
            "device": "cpu", "world_size": WORLD, "pp": 2, "dp_shard": 2, "cp": 2, "ep": 2,
            "linear_attention_cp_mode": "p2p", "linear_attention_gdn_backend": "eager",
            "full_attention_cp_mode": "ring", "comm_timeout_s": 120,
        },
        "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4, "virtual_stages": 2,
                     "overlap_p2p": True},
    },
}


def main() -> int:
    rc = init_from_env("cpu")
    if rc.world_size != WORLD:
        raise ValueError(f"train_4d.py needs {WORLD} ranks (pp 2 x dp_shard 2 x cp 2), got "
                         f"{rc.world_size}: torchrun --nproc-per-node {WORLD} ...")
    config = config_from_dict(CONFIG)
    run = train_distributed(config, torch.device("cpu"))
    verdict = torch.zeros(1)
    if rc.rank == 0:
        print(f"layout: {run.mode}")
        baseline = train_single(config, log=lambda line: None)
        for a, b in zip(run.steps, baseline.steps):
            print(f"step {a.step}: loss {a.loss:.6f} vs {b.loss:.6f} (one device), "
                  f"grad norm {a.grad_norm:.6e} vs {b.grad_norm:.6e}")
        diff = compare_runs(run, baseline)
        worst = max(diff["max_rel_dloss"], diff["max_rel_dgrad_norm"])
        ok = worst <= TOL and diff["steps"] == config.train.steps
        print(f"CHECK train_4d: max relative difference {worst:.1e} <= {TOL:g} (loss and grad "
              f"norm, {diff['steps']} steps): {'OK' if ok else 'FAIL'}", flush=True)
        verdict[0] = 1.0 if ok else 0.0
    dist.broadcast(verdict, src=0)  # every rank exits with rank 0's verdict
    dist.destroy_process_group()
    return 0 if verdict[0] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
