"""Start from a Hugging Face checkpoint, fine-tune it on pp 2 x ep 2, hand it back to transformers.

What it shows:
  * a Qwen3.5-MoE checkpoint as a user brings it: ``config.json`` + safetensors written by
    ``transformers`` (here a tiny random ``Qwen3_5MoeForCausalLM`` that rank 0 saves; every
    parameter randomised);
  * ``model.init_from`` in the trainer's configuration: each rank builds its pipeline stage on
    the meta device, keeps its experts (EP 2) and its FSDP2 rows, and reads only that share of
    the safetensors; 3 AdamW steps with checkpoints (``checkpoint.dir``);
  * ``export_checkpoint`` (what ``overlap-runtime export CKPT --hf OUT`` runs): the pp2 x ep2
    checkpoint as ``config.json`` + sharded safetensors;
  * ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and the check: its logits equal
    ours, computed from the same checkpoint (rel-L2 <= 1e-5, fp32), and the run's losses equal
    one device's (``train_single``, 1e-5 relative). Every token goes to every expert (top-4 of
    4) so no routing tie can flip between the runs.

Run (CPU, gloo; exactly 4 ranks; writes out/hf_finetune_export/):
  torchrun --nproc-per-node 4 examples/hf_finetune_export.py

Prints (rank 0; numbers vary in the last digits):
  step 1: loss 5.970438 vs 5.970438 (one device)
  step 2: loss 5.559317 vs 5.559317 (one device)
  step 3: loss 5.272845 vs 5.272845 (one device)
  exported out/hf_finetune_export/ckpt/step-00000003 to out/hf_finetune_export/hf_out: 112 tensors, 1 shard(s)
  transformers loaded Qwen3_5MoeForCausalLM
  CHECK hf_finetune_export: max rel-L2 2.9e-06 <= 1e-05 (transformers logits vs ours; losses vs one device): OK
Exits 1 (and prints FAIL) on a mismatch.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from overlap_runtime.launch import init_from_env
from overlap_runtime.trainer import (build_model, compare_runs, config_from_dict,
                                     export_checkpoint, read_checkpoint_tensors,
                                     train_distributed, train_single)

WORLD = 4
TOL = 1e-5
OUT = Path("out/hf_finetune_export")


def save_hf_model(directory: Path) -> None:
    """A tiny random Qwen3.5-MoE saved as transformers saves it (the user's checkpoint)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3_5MoeTextConfig(
        vocab_size=272, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=4,
        router_aux_loss_coef=0.0)
    model = tf.Qwen3_5MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(-1.0, 1.0) if "A_log" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(str(directory))


def config(hf_dir: Path) -> dict:
    return {
        "model": {"init_from": str(hf_dir)},      # the architecture comes from its config.json
        "data": {"seq_len": 64, "batch_size": 4},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "max_grad_norm": 1.0},
        "train": {"steps": 3, "seed": 0, "precision": "fp32",
                  "accelerator": {"device": "cpu", "world_size": WORLD, "pp": 2, "ep": 2,
                                  "dp_shard": 2, "comm_timeout_s": 120},
                  "pipeline": {"schedule": "1f1b", "microbatches": 4}},
        "checkpoint": {"dir": str(OUT / "ckpt"), "interval": 3},
    }


def check(cfg: dict) -> float:
    """Rank 0: export, load in transformers, compare logits; returns the worst rel-L2."""
    from transformers import AutoModelForCausalLM

    step = OUT / "ckpt" / "step-00000003"
    report = export_checkpoint(step, OUT / "hf_out")
    print(f"exported {step} to {OUT / 'hf_out'}: {report.tensors} tensors, {report.shards} "
          f"shard(s)")
    hf = AutoModelForCausalLM.from_pretrained(str(OUT / "hf_out"), dtype=torch.float32).eval()
    print(f"transformers loaded {type(hf).__name__}")
    ours = build_model(config_from_dict(cfg))             # the import, then the trained weights
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, expert, value in read_checkpoint_tensors(step):
            (params[name][expert] if expert is not None else params[name]).copy_(value)
        ids = torch.randint(0, 272, (2, 100), generator=torch.Generator().manual_seed(1))
        a, b = ours(ids), hf(ids).logits
    return float((a - b).norm() / b.norm())


def main() -> int:
    rc = init_from_env("cpu")
    if rc.world_size != WORLD:
        raise ValueError(f"hf_finetune_export.py needs {WORLD} ranks (pp 2 x dp_shard 2, ep 2), "
                         f"got {rc.world_size}: torchrun --nproc-per-node {WORLD} ...")
    hf_dir = OUT / "hf_in"
    if rc.rank == 0:
        shutil.rmtree(OUT, ignore_errors=True)
        save_hf_model(hf_dir)
    dist.barrier()
    cfg = config(hf_dir)
    run = train_distributed(config_from_dict(cfg), torch.device("cpu"), log=lambda line: None)
    dist.barrier()  # every rank's checkpoint is committed
    verdict = torch.zeros(1)
    if rc.rank == 0:
        single = {k: v for k, v in cfg.items() if k != "checkpoint"}  # same batches, one process
        base = train_single(config_from_dict(single), log=lambda line: None)
        for a, b in zip(run.steps, base.steps):
            print(f"step {a.step}: loss {a.loss:.6f} vs {b.loss:.6f} (one device)")
        diff = compare_runs(run, base)
        worst_run = max(diff["max_rel_dloss"], diff["max_rel_dgrad_norm"])
        err = check(cfg)
        ok = err <= TOL and worst_run <= TOL
        print(f"CHECK hf_finetune_export: max rel-L2 {max(err, worst_run):.1e} <= {TOL:g} "
              f"(transformers logits vs ours; losses vs one device): {'OK' if ok else 'FAIL'}",
              flush=True)
        verdict[0] = 1.0 if ok else 0.0
    dist.broadcast(verdict, src=0)
    dist.destroy_process_group()
    return 0 if verdict[0] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
