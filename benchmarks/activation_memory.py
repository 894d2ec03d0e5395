"""What holds the activation memory of one training step of the Qwen3.5-style hybrid (issue #29,
item 5).

    python -m benchmarks.activation_memory configs/gpu_cp2_16k.yaml --tokens 16384 32768 \
        --compile on --activation-checkpoint off

The model of the config (cp 1, world 1, the same overrides as ``model_breakdown.py``) in bf16 on
one device (``--device cuda`` or ``cpu``; ``--dtype fp32`` for CPU checks). One forward runs
under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for backward -
tensors saved by built-in ops and by custom ``autograd.Function``'s ``ctx.save_for_backward``
(the Triton GDN saves all its tensors that way; its ``ctx`` attributes are a ``ScanMeta`` of
ints and two flags) - is counted once per storage (``untyped_storage().data_ptr()``: views of
one tensor cost nothing extra) and attributed to the innermost tagged region running when it
was saved. Regions are modules (forward pre/post hooks) and, inside a GDN layer, the pieces its
sequence mixer calls (``causal_conv``, ``gates``, ``core``: wrapped per instance). Parameters
saved by an op (a Linear's weight) are not activations and are left out. As a check that nothing
hides outside the hooks, the autograd graph is walked after the forward and every tensor held as
an attribute of a custom Function's ``ctx`` and not seen by the hooks is counted under
``ctx attributes (unhooked)``.

Then the loss's backward and one AdamW step run, and the table gives MB per category per layer
type (per layer, and summed), the total saved, ``torch.cuda.max_memory_allocated`` at the end
of backward, parameters + gradients + optimizer state, and saved bytes per token. With
``--activation-checkpoint on`` the recomputed layers keep only their inputs (the checkpoint's
own hooks hold the rest, which is recomputed in backward): the table shows what stays, the peak
shows the price of one layer's recompute.

Categories: ``gdn proj`` (in_proj_qkv/z/b/a, out_proj), ``gdn conv``, ``gdn gates``, ``gdn
core``, ``gdn mixer other`` (reshapes around them), ``gdn norm`` (gated RMSNorm), ``gdn other``,
``attention proj`` (q/k/v/o), ``attention core``, ``attention norms`` (q/k RMSNorm), ``attention
other`` (RoPE, output gate), ``mlp``, ``norms`` (decoder RMSNorms, final norm), ``residual``
(what a decoder layer saves outside its children, the checkpoint's inputs included),
``embedding``, ``lm_head``, ``loss``. Output: the table, the largest saved tensors, and JSON
under ``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


from overlap_runtime.layers import GatedDeltaNet  # noqa: E402

MB = 1e6
UNHOOKED = "ctx attributes (unhooked)"

_LEAF_CATEGORY = {
    "in_proj_qkv": "gdn proj", "in_proj_z": "gdn proj", "in_proj_b": "gdn proj",
    "in_proj_a": "gdn proj", "out_proj": "gdn proj",
    "q_proj": "attention proj", "k_proj": "attention proj", "v_proj": "attention proj",
    "o_proj": "attention proj", "q_norm": "attention norms", "k_norm": "attention norms",
    "core_attention": "attention core", "self_attn": "attention other",
    "sequence_mixer": "gdn mixer other", "linear_attn": "gdn other",
    "input_layernorm": "norms", "post_attention_layernorm": "norms",
}


def category_of(name: str) -> str | None:
    """Category of the module ``name`` (``model.named_modules()``), None for an untagged one
    (its saves go to the nearest tagged ancestor: a SwiGLU's Linears count as ``mlp``)."""
    parts = name.split(".")
    leaf = parts[-1]
    if ".mlp." in f".{name}." and leaf != "mlp":
        return None
    if leaf == "mlp":
        return "mlp"
    if leaf == "norm":
        return "gdn norm" if ".linear_attn." in f".{name}." else "norms"
    if name in ("embed_tokens", "lm_head"):
        return "embedding" if name == "embed_tokens" else "lm_head"
    if len(parts) == 2 and parts[0] == "layers":
        return "residual"
    return _LEAF_CATEGORY.get(leaf)


def layer_type_of(name: str, model: nn.Module) -> str:
    """``"linear_attention"`` / ``"full_attention"`` for a module inside decoder layer ``i``,
    ``"model"`` outside the decoder layers (embedding, final norm, head, loss)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return str(model.layers[int(parts[1])].layer_type)
    return "model"


@dataclass
class SavedRecord:
    """One storage autograd keeps: bytes, where it was first saved, dtype and shape."""

    nbytes: int
    category: str
    layer_type: str
    region: str
    dtype: str
    shape: tuple[int, ...]
    producer: str


@dataclass
class SavedTensorLedger:
    """Attributes every tensor saved for backward to the innermost tagged region (module doc).

    Use ``with ledger.watch(): loss = ...`` around the forward (and loss); then
    :meth:`add_unhooked` with the loss, and read :meth:`table` / :attr:`records`.
    """

    model: nn.Module
    records: dict[tuple[str, int], SavedRecord] = field(default_factory=dict)
    stack: list[tuple[str, str, str]] = field(default_factory=list)  # (region, cat, type)
    _param_storages: set[int] = field(default_factory=set)
    _handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        for name, mod in self.model.named_modules():
            cat = category_of(name)
            if cat is not None:
                self._tag_module(name, mod, cat, layer_type_of(name, self.model))
            if isinstance(mod, GatedDeltaNet):
                lt = layer_type_of(name, self.model)
                for piece, cat in (("causal_conv", "gdn conv"), ("gates", "gdn gates"),
                                   ("core", "gdn core")):
                    setattr(mod, piece, self._tagged_call(f"{name}.{piece}", cat, lt,
                                                          getattr(mod, piece)))

    # -- regions ---------------------------------------------------------------------------
    def _tag_module(self, name: str, mod: nn.Module, cat: str, layer_type: str) -> None:
        def pre(m: nn.Module, args: Any) -> None:
            self.stack.append((name, cat, layer_type))

        def post(m: nn.Module, args: Any, out: Any) -> None:
            if self.stack and self.stack[-1][0] == name:
                self.stack.pop()

        self._handles.append(mod.register_forward_pre_hook(pre))
        self._handles.append(mod.register_forward_hook(post))

    def _tagged_call(self, region: str, cat: str, layer_type: str,
                     fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.region(region, cat, layer_type):
                return fn(*args, **kwargs)
        return call

    @contextlib.contextmanager
    def region(self, region: str, cat: str, layer_type: str = "model") -> Iterator[None]:
        """Attribute what is saved inside to ``cat`` (e.g. the loss, outside the model)."""
        self.stack.append((region, cat, layer_type))
        try:
            yield
        finally:
            self.stack.pop()

    # -- the hooks -------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t, *(self.stack[-1] if self.stack else ("(untagged)", "other", "model")))
        return t

    def _record(self, t: torch.Tensor, region: str, cat: str, layer_type: str) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages or storage.nbytes() == 0:
            return
        key = (str(t.device), ptr)
        if key not in self.records:
            producer = t.grad_fn.name() if t.grad_fn is not None else "leaf/no-grad"
            self.records[key] = SavedRecord(storage.nbytes(), cat, layer_type, region,
                                            str(t.dtype).replace("torch.", ""),
                                            tuple(t.shape), producer)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Record every tensor saved for backward inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def add_unhooked(self, root: torch.Tensor) -> int:
        """Walk the autograd graph of ``root`` and record tensors kept as attributes of custom
        Functions' ``ctx`` that the hooks did not see; returns how many were found."""
        found, seen, todo = 0, set(), [root.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            todo.extend(nxt for nxt, _ in node.next_functions)
            attrs = getattr(node, "__dict__", {})
            for key, val in attrs.items():
                for t in (val if isinstance(val, (list, tuple)) else [val]):
                    if isinstance(t, torch.Tensor):
                        before = len(self.records)
                        self._record(t, f"{node.name()}.{key}", UNHOOKED, "model")
                        found += len(self.records) - before
        return found

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- results ---------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def bytes_by(self, *keys: str) -> dict[tuple[str, ...], int]:
        """Bytes summed by record attributes, e.g. ``bytes_by("category", "layer_type")``."""
        out: dict[tuple[str, ...], int] = defaultdict(int)
        for r in self.records.values():
            out[tuple(getattr(r, k) for k in keys)] += r.nbytes
        return dict(out)

    def layer_counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for layer in getattr(self.model, "layers", []):
            counts[str(layer.layer_type)] += 1
        counts["model"] = 1
        return dict(counts)


def run(config_path: str, tokens: int, compile_: bool, checkpoint: bool, device: str,
        dtype: torch.dtype = torch.bfloat16, overrides: dict[str, Any] | None = None
        ) -> dict[str, Any]:
    """One forward + backward + AdamW step of the config's model; the ledger and memory."""
    from overlap_runtime.trainer.build import build_model
    from overlap_runtime.config.train import load_config

    base = load_config(config_path)
    config = base.model_copy(update={
        "model": base.model.model_copy(update=overrides or {}),
        "data": base.data.model_copy(update={"seq_len": tokens, "batch_size": 1}),
        "train": base.train.model_copy(update={
            "accelerator": base.train.accelerator.model_copy(update={"cp": 1,
                                                                      "world_size": 1})})})
    dev = torch.device(device)
    model = build_model(config, dev).to(dtype)
    model.set_activation_checkpointing(checkpoint)
    if compile_:  # what train.compile applies
        from overlap_runtime.layers.compile import compile_elementwise

        compile_elementwise(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    ids = torch.randint(0, config.model.vocab_size, (1, tokens + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(tokens, device=dev)

    def step(ledger: SavedTensorLedger | None) -> tuple[int, int]:
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            base_mem = torch.cuda.memory_allocated(dev)
        ctx = ledger.watch() if ledger is not None else contextlib.nullcontext()
        region = (ledger.region("loss", "loss") if ledger is not None
                  else contextlib.nullcontext())
        with ctx:
            logits = model(x, pos)
            with region:
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        del logits
        if ledger is not None:
            ledger.add_unhooked(loss)
        loss.backward()
        peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
        opt.step()
        opt.zero_grad(set_to_none=False)
        return (peak, base_mem) if cuda else (0, 0)

    step(None)  # warm-up: compilation, optimizer state, allocator
    ledger = SavedTensorLedger(model)
    peak, base_mem = step(ledger)
    ledger.close()
    state = sum(p.numel() * p.element_size() * (2 if p.grad is not None else 1)
                for p in model.parameters())
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    return {"tokens": tokens, "compile": compile_, "activation_checkpoint": checkpoint,
            "dtype": str(dtype).replace("torch.", ""), "ledger": ledger,
            "saved_bytes": ledger.total_bytes, "peak_bytes": peak,
            "allocated_before_step": base_mem, "params_grads_optimizer_bytes": state,
            "params": sum(p.numel() for p in model.parameters())}


_ORDER = ["gdn proj", "gdn conv", "gdn gates", "gdn core", "gdn mixer other", "gdn norm",
          "gdn other", "attention proj", "attention norms", "attention core", "attention other",
          "mlp", "norms", "residual", "embedding", "lm_head", "loss", "other", UNHOOKED]
_TYPES = [("linear_attention", "GDN layer"), ("full_attention", "attention layer"),
          ("model", "outside layers")]


def format_report(r: dict[str, Any], top: int = 12) -> str:
    """The markdown table (MB per category per layer type), totals and the largest tensors."""
    ledger: SavedTensorLedger = r["ledger"]
    by = ledger.bytes_by("category", "layer_type")
    by_dtype = ledger.bytes_by("category", "dtype")
    counts = ledger.layer_counts()
    cats = [c for c in _ORDER if any(k[0] == c for k in by)]
    cats += sorted({k[0] for k in by} - set(cats))
    head = " | ".join(f"{label} x{counts.get(t, 0)} (MB/layer)" for t, label in _TYPES
                      if t != "model") + " | outside layers (MB)"
    lines = [f"{r['tokens']} tokens, compile {'on' if r['compile'] else 'off'}, activation "
             f"checkpoint {'on' if r['activation_checkpoint'] else 'off'}, {r['dtype']}, "
             f"{r['params'] / 1e6:.1f}M parameters", "",
             f"| category | {head} | total (MB) | of it fp32 (MB) |",
             "| --- " * 6 + "|"]
    for c in cats:
        cells = []
        for t, _ in _TYPES:
            b = by.get((c, t), 0)
            per = b / max(counts.get(t, 1), 1) if t != "model" else b
            cells.append(f"{per / MB:.1f}" if b else "")
        tot = sum(v for k, v in by.items() if k[0] == c)
        f32 = by_dtype.get((c, "float32"), 0)
        lines.append(f"| {c} | {' | '.join(cells)} | {tot / MB:.1f} | "
                     f"{f32 / MB:.1f} |")
    saved = r["saved_bytes"]
    lines += [f"| **total saved** | | | | **{saved / MB:.1f}** | "
              f"{sum(v for k, v in by_dtype.items() if k[1] == 'float32') / MB:.1f} |", "",
              f"saved for backward: {saved / MB:.1f} MB = {saved / r['tokens'] / 1e3:.1f} KB "
              f"per token",
              f"parameters + gradients + optimizer state: "
              f"{r['params_grads_optimizer_bytes'] / MB:.1f} MB"]
    if r["peak_bytes"]:
        lines.append(f"max_memory_allocated at the end of backward: {r['peak_bytes'] / MB:.1f} MB"
                     f" ({r['peak_bytes'] / r['tokens'] / 1e3:.1f} KB per token; allocated "
                     f"before the step {r['allocated_before_step'] / MB:.1f} MB)")
    lines += ["", f"largest saved tensors (of {len(ledger.records)}):",
              "| MB | category | region | dtype | shape | produced by |", "| --- " * 6 + "|"]
    for rec in sorted(ledger.records.values(), key=lambda x: -x.nbytes)[:top]:
        lines.append(f"| {rec.nbytes / MB:.1f} | {rec.category} | {rec.region} | {rec.dtype} | "
                     f"{list(rec.shape)} | {rec.producer} |")
    return "\n".join(lines)


def _json(r: dict[str, Any]) -> dict[str, Any]:
    ledger: SavedTensorLedger = r.pop("ledger")
    r["saved_by_category"] = {f"{c}/{t}": b for (c, t), b in
                              ledger.bytes_by("category", "layer_type").items()}
    r["tensors"] = [vars(x) | {"shape": list(x.shape)} for x in ledger.records.values()]
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--compile", choices=["off", "on"], default="on",
                   help="train.compile's regional torch.compile (layers.compile)")
    p.add_argument("--activation-checkpoint", choices=["off", "on", "both"], default="both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--top", type=int, default=12, help="largest saved tensors to list")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    ckpt = {"off": [False], "on": [True], "both": [False, True]}[args.activation_checkpoint]
    out = []
    for t in args.tokens:
        for c in ckpt:
            r = run(args.config, t, args.compile == "on", c, args.device, dtype)
            print("\n" + format_report(r, args.top))
            out.append(_json(r))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "activation_memory.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
