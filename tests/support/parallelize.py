"""Rank workers of the parallelize tests (module level so that spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from overlap_runtime.layers import CoreAttention, LocalGDNMixer
from overlap_runtime.models import (
    GDNKernelOptionsConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    build_dp_cp_mesh,
    parallelize_qwen3_5_cp,
)

CONFIG = Qwen3_5Config(num_hidden_layers=4)
SEQ = 96
# float64 parameters and activations: GDN CP is then exact to float64 rounding, and so is the
# attention (ops.attention accumulates float64 inputs in float64 since #28 item 6). In fp32
# the p2p / all_gather summaries' extra cancellation shows as ~2e-4 on small gate gradients.
DTYPE = torch.float64


def _model(config: Qwen3_5Config = CONFIG) -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(DTYPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.mul_(10.0)  # make every mixer matter (0.02-scale weights are nearly linear)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))


def single_device_reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[2, SEQ, V]`` and parameter gradients of a fixed loss, on one device."""
    model = _model()
    logits = model(_ids())
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(6), dtype=DTYPE)
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def cp_forward_backward_worker(rank: int, world: int, gdn_mode: str, attn_mode: str) -> Any:
    """CP over all ranks: this rank's logits shard and its (partial) parameter gradients."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = parallelize_qwen3_5_cp(_model(), mesh, linear_attention_cp_mode=gdn_mode,
                                   full_attention_cp_mode=attn_mode)
    core = model.layers[3].self_attn.core_attention
    kinds = (type(core).__name__, core.mode, core.load_balance,
             model.layers[0].linear_attn.sequence_mixer.mode)
    local = SEQ // world
    ids = _ids()[:, rank * local:(rank + 1) * local]
    logits = model(ids)  # default position ids: this rank's contiguous shard
    explicit = model(ids, torch.arange(rank * local, (rank + 1) * local))
    w = torch.randn((2, SEQ, CONFIG.vocab_size), generator=torch.Generator().manual_seed(6),
                    dtype=DTYPE)
    (logits * w[:, rank * local:(rank + 1) * local]).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # every rank holds a partial sum (its tokens)
        grads[n] = g
    return kinds, logits.detach(), torch.equal(logits, explicit), grads


def cp1_and_errors_worker(rank: int, world: int) -> dict[str, Any]:
    """cp=1 leaves the model untouched; bad arguments raise before anything changes."""
    out: dict[str, Any] = {}
    mesh = build_dp_cp_mesh("cpu", world, 1)          # dp = world, cp = 1
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward_before = model.forward
    same = parallelize_qwen3_5_cp(model, mesh["cp"], linear_attention_cp_mode="p2p")
    out["cp1_same_object"] = same is model
    out["cp1_core_untouched"] = all(
        type(l.self_attn.core_attention) is CoreAttention for l in model.layers if l.self_attn)
    out["cp1_gdn_untouched"] = all(
        type(l.linear_attn.sequence_mixer) is LocalGDNMixer for l in model.layers
        if l.linear_attn is not None)
    out["cp1_forward_untouched"] = model.forward == forward_before
    out["cp1_state_equal"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    errors = {}
    for name, kwargs in {
        "ulysses_degree": {"ulysses_degree": 1},
        "gdn_mode": {"linear_attention_cp_mode": "ring"},
        "backend": {"linear_attention_gdn_backend": "auto"},
        "attn_mode": {"full_attention_cp_mode": "zigzag"},
        # model.gdn_kernel_options for eager; the CP layers would run triton
        "kernel_options": {"linear_attention_gdn_backend": "triton"},
    }.items():
        fresh = _model(CONFIG.model_copy(update={"gdn_kernel_options": GDNKernelOptionsConfig(
            block_chunks=2)}) if name == "kernel_options" else CONFIG)
        try:
            parallelize_qwen3_5_cp(fresh, cp_mesh, **kwargs)
            errors[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the test inspects type and message
            errors[name] = (type(exc).__name__, str(exc))
        errors[name + "_untouched"] = all(
            type(l.self_attn.core_attention) is CoreAttention for l in fresh.layers if l.self_attn
        ) and all(type(l.linear_attn.sequence_mixer) is LocalGDNMixer for l in fresh.layers
                  if l.linear_attn is not None)
    try:
        parallelize_qwen3_5_cp(_model(), init_device_mesh("cpu", (1, world)))
        errors["mesh_2d"] = ("no error", "")
    except Exception as exc:  # noqa: BLE001
        errors["mesh_2d"] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    return out
