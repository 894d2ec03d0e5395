"""Where one training step of the Qwen3.5-style hybrid goes on one GPU (issue #29, item 1).

    python -m benchmarks.model_breakdown configs/gpu_cp2_16k.yaml --tokens 16384 32768 \
        --compile both

The model of the config (cp 1, world 1) in bf16 on one device. Every module of interest gets CUDA
events at the start and end of its forward (forward pre/post hooks) and of its backward (full
backward pre/post hooks), so each category's time is read from the GPU timeline; a module's
*exclusive* time subtracts its timed children. Categories:

- ``proj`` GDN in/out projections and attention q/k/v/o (Linear GEMMs)
- ``gdn_mixer`` conv + SiLU + gates + l2norm + the chunked GDN op (``sequence_mixer``) and the
  layer's reshapes: the GDN layer minus its projections and output norm (a module whose inputs
  are not tensors, like the mixer, gets its backward-end hook at once, so its backward is
  measured as part of the layer)
- ``gdn_norm`` the gated RMSNorm of the GDN output
- ``attn_core`` attention (SDPA / cuDNN)
- ``attn_misc`` attention's q/k norms, RoPE, reshapes and output gate (exclusive)
- ``mlp`` SwiGLU (three GEMMs and the activation)
- ``layer_misc`` decoder RMSNorms and residual adds (exclusive)
- ``embed``, ``lm_head``; ``loss`` (cross entropy, outside the model); ``optimizer`` (AdamW step)

Each row also gets its ideal time: FLOPs at the GEMM rate measured in the same run (a large
bf16 matmul) for GEMM rows, bytes at the H200's HBM bandwidth (4.8 TB/s) for elementwise rows.
Medians over ``--steps`` after ``--warmup``. Output: a table per token count, and JSON under
``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


from overlap_runtime.trainer.build import build_model  # noqa: E402
from overlap_runtime.config.train import load_config  # noqa: E402
from overlap_runtime.trainer.flops import train_flops_per_step  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
PEAK = 989.4e12


def _category(name: str, mod: torch.nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj",
                "k_proj", "v_proj", "o_proj"):
        return "proj"
    if leaf == "sequence_mixer":
        return "gdn_mixer"
    if leaf == "norm" and ".linear_attn." in f".{name}.":
        return "gdn_norm"
    if leaf == "core_attention":
        return "attn_core"
    if leaf == "self_attn":
        return "attn_misc"
    if leaf == "mlp":
        return "mlp"
    if name.startswith("layers.") and name.count(".") == 1:
        return "layer_misc"
    if name in ("embed_tokens", "lm_head"):
        return name.replace("embed_tokens", "embed")
    if leaf == "linear_attn":
        return "gdn_mixer"  # its exclusive time: the mixer's backward (see the module doc)
    return None


class Timer:
    """CUDA events around each tagged module's forward and backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.events: list[tuple[str, str, str, torch.cuda.Event]] = []  # (module, dir, edge)
        self.cat: dict[str, str] = {}
        self.parent: dict[str, str | None] = {}
        tagged = []
        for name, mod in model.named_modules():
            c = _category(name, mod)
            if c is None:
                continue
            self.cat[name] = c
            tagged.append(name)
            self._hook(name, mod)
        for name in tagged:  # nearest tagged ancestor
            p = name
            self.parent[name] = None
            while "." in p:
                p = p.rsplit(".", 1)[0]
                if p in self.cat:
                    self.parent[name] = p
                    break

    def _mark(self, name: str, direction: str, edge: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.events.append((name, direction, edge, e))

    def _hook(self, name: str, mod: torch.nn.Module) -> None:
        mod.register_forward_pre_hook(lambda m, a: self._mark(name, "fwd", "start"))
        mod.register_forward_hook(lambda m, a, o: self._mark(name, "fwd", "end"))
        mod.register_full_backward_pre_hook(lambda m, g: self._mark(name, "bwd", "start"))
        mod.register_full_backward_hook(lambda m, gi, go: self._mark(name, "bwd", "end"))

    def collect(self) -> dict[str, float]:
        """Exclusive milliseconds per category of the events since the last call."""
        torch.cuda.synchronize()
        open_: dict[tuple[str, str], list[torch.cuda.Event]] = defaultdict(list)
        incl: dict[tuple[str, str], float] = defaultdict(float)
        spans: list[tuple[str, str, float]] = []
        for name, d, edge, e in self.events:
            if edge == "start":
                open_[(name, d)].append(e)
            elif open_[(name, d)]:
                s = open_[(name, d)].pop()
                try:
                    ms = s.elapsed_time(e)
                except ValueError:  # a hook that never fired (compiled module's backward)
                    continue
                incl[(name, d)] += ms
                spans.append((name, d, ms))
        self.events.clear()
        excl: dict[str, float] = defaultdict(float)
        for (name, d), ms in incl.items():
            excl[self.cat[name]] += ms
            p = self.parent[name]
            if p is not None:
                excl[self.cat[p]] -= ms
        return dict(excl)


def _gemm_rate(device: torch.device) -> float:
    a = torch.randn(16384, 2048, device=device, dtype=torch.bfloat16)
    b = torch.randn(2048, 6144, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        a @ b
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * 16384 * 2048 * 6144 / statistics.median(times)


def _ideal(config: Any, tokens: int, gemm_rate: float) -> dict[str, float]:
    """Ideal ms per category: GEMM FLOPs (x3: forward + backward) at ``gemm_rate``, and the
    compulsory bytes of elementwise rows (bf16 activations read + written, x3) at HBM speed."""
    m = config.model
    h, t = m.hidden_size, tokens
    n_gdn = sum(1 for k in m.layer_types if k == "linear_attention")
    n_att = len(m.layer_types) - n_gdn
    qkv = 2 * m.linear_num_key_heads * m.linear_key_head_dim + \
        m.linear_num_value_heads * m.linear_value_head_dim
    vdim = m.linear_num_value_heads * m.linear_value_head_dim
    gdn_proj = h * (qkv + vdim + 2 * m.linear_num_value_heads) + vdim * h
    att_proj = h * (m.num_attention_heads * m.head_dim * 2 + 2 * m.num_key_value_heads
                    * m.head_dim) + m.num_attention_heads * m.head_dim * h
    mlp = 3 * h * m.intermediate_size * len(m.layer_types)
    gemm = lambda params: 6 * t * params / gemm_rate * 1e3  # noqa: E731
    byte = lambda n: 3 * n / HBM_BYTES_PER_S * 1e3  # noqa: E731
    return {
        "proj": gemm(n_gdn * gdn_proj + n_att * att_proj),
        "mlp": gemm(mlp),
        "lm_head": gemm(h * m.vocab_size),
        "attn_core": 6 * t * t * m.num_attention_heads * m.head_dim * n_att / gemm_rate * 1e3,
        "gdn_mixer": byte(n_gdn * t * (qkv + 2 * vdim) * 2),
        "gdn_norm": byte(n_gdn * t * vdim * 2 * 3),
        "layer_misc": byte(len(m.layer_types) * t * h * 2 * 6),
        "loss": byte(t * m.vocab_size * 4 * 2),
    }


def run(config_path: str, tokens: int, steps: int, warmup: int,
        compile_: bool = False) -> dict[str, Any]:
    base = load_config(config_path)
    config = base.model_copy(update={
        "data": base.data.model_copy(update={"seq_len": tokens, "batch_size": 1}),
        "train": base.train.model_copy(update={
            "accelerator": base.train.accelerator.model_copy(update={"cp": 1,
                                                                      "world_size": 1})})})
    device = torch.device("cuda:0")
    model = build_model(config, device).to(torch.bfloat16)
    if compile_:  # what train.compile applies
        from overlap_runtime.layers.compile import compile_elementwise

        compile_elementwise(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    timer = Timer(model)
    ids = torch.randint(0, config.model.vocab_size, (1, tokens + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(tokens, device=device)
    rows: list[dict[str, float]] = []
    for it in range(warmup + steps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ls, le = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        os_, oe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        logits = model(x, pos)
        ls.record()
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        le.record()
        loss.backward()
        os_.record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        oe.record()
        e.record()
        torch.cuda.synchronize()
        cats = timer.collect()
        cats["loss_fwd"] = ls.elapsed_time(le)
        cats["optimizer"] = os_.elapsed_time(oe)
        cats["step"] = s.elapsed_time(e)
        if it >= warmup:
            rows.append(cats)
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0]}
    accounted = sum(v for k, v in med.items() if k != "step")
    med["other (loss bwd, autograd, launches)"] = med["step"] - accounted
    gemm_rate = _gemm_rate(device)
    flops = train_flops_per_step(config.model, tokens, tokens)
    return {"tokens": tokens, "compile": compile_, "ms": med, "ideal_ms": _ideal(config, tokens, gemm_rate),
            "gemm_tflops": gemm_rate / 1e12, "mfu": flops / (med["step"] / 1e3) / PEAK,
            "tokens_per_s": tokens / (med["step"] / 1e3),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", choices=["off", "on", "both"], default="both",
                   help="train.compile's regional torch.compile (layers.compile)")
    args = p.parse_args()
    out = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    for t, c in [(t, c) for t in args.tokens for c in modes]:
        r = run(args.config, t, args.steps, args.warmup, c)
        out.append(r)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        print(f"\n{t} tokens, compile {'on' if c else 'off'}: step {r['ms']['step']:.1f} ms, {r['tokens_per_s']:,.0f} tok/s, "
              f"MFU {r['mfu']:.3f}, GEMM {r['gemm_tflops']:.0f} TFLOP/s, peak "
              f"{r['peak_memory_gib']:.1f} GiB")
        print(f"| {'part':<40} | ms | share | ideal ms |")
        for k, v in sorted(r["ms"].items(), key=lambda kv: -kv[1]):
            if k == "step":
                continue
            ideal = r["ideal_ms"].get(k)
            print(f"| {k:<40} | {v:.2f} | {v / r['ms']['step']:.1%} | "
                  f"{'' if ideal is None else f'{ideal:.2f}'} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "model_breakdown.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
