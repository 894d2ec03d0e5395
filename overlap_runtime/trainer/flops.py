"""Model FLOPs per training step (``models.flops``, the model spec's count) and MFU (model FLOPs utilisation) on known accelerators.

Formula (the model's useful work, not what a kernel happens to execute)::

    flops/step = 6 * N_active * T  +  T * sum over token-mixer layers of f_layer

    N_active   parameters a token goes through, embeddings excluded (a lookup does no
               arithmetic), the LM head included (a GEMM), routed experts scaled by k / E
               (each token meets k of E experts); norms and biases are counted, negligibly
    T          tokens in the global batch (data.batch_size x dp x data.seq_len)
    6          forward 2 (multiply + add) + backward 4 (input and weight gradients)
    full attention (causal), per token:   6 * S * h * d       S = data.seq_len (the whole
               sequence, also under CP), h = num_attention_heads, d = head_dim; QK^T and PV are
               2 * S * d * h each per token without a mask, halved for the causal half, x 3
    GDN (linear attention), per token:    18 * K * V * HV     three K x V products per value head
               in the recurrent form (S^T k, k r^T, S^T q), x 2 for multiply-add, x 3; the
               chunked kernels do more arithmetic than this, which is not counted as useful

    MFU = flops/step / (step_time_s * devices * peak_bf16_flops_per_device)

Peak bf16 FLOP/s are the vendors' dense (no sparsity) tensor-core figures for the devices in
:data:`PEAK_BF16_FLOPS`; a device that is not in the table (and every CPU) gives ``None``,
never a guess.
"""

from __future__ import annotations

import re

import torch

from overlap_runtime.models.flops import active_parameters, train_flops_per_step

# (pattern matched against torch.cuda.get_device_name, dense bf16 FLOP/s per device); the first
# match wins, so more specific names come first ("H100 PCIe" before "H100", "H200" before "H20").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bB200\b", 2.25e15),
    (r"\bGH200\b", 989.4e12),
    (r"\bH200\b", 989.4e12),
    (r"\bH100\b.*\bPCIe\b", 756.0e12),
    (r"\bH100\b.*\bNVL\b", 835.5e12),
    (r"\bH100\b", 989.4e12),
    (r"\bH800\b", 989.4e12),
    (r"\bH20\b", 148.0e12),
    (r"\bA100\b", 312.0e12),
    (r"\bA800\b", 312.0e12),
    (r"\bL40S\b", 362.05e12),
)


def device_peak_flops(device: torch.device | str, name: str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one ``device`` (``name``: its marketing name, default
    ``torch.cuda.get_device_name``); None for the CPU, NPUs and any device not in the table."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if name is None:
        name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, name):
            return peak
    return None


def mfu(flops_per_step: float, step_time_s: float, devices: int,
        peak_flops: float | None) -> float | None:
    """``flops_per_step / (step_time_s * devices * peak_flops)``; None without a known peak."""
    if peak_flops is None or step_time_s <= 0:
        return None
    return flops_per_step / (step_time_s * devices * peak_flops)
