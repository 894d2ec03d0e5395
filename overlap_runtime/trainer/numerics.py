"""bf16 training numerics: the noise floor of a trajectory, and per-tensor gradients at fixed
weights (docs/training.md, "bf16 numerics").

Two measurements, both against the single-device baseline of the trainer
(:func:`~overlap_runtime.trainer.loop.train_single`):

* **Trajectories.** :func:`step_differences` gives, per optimizer step, the relative loss and
  grad-norm differences of a run against the baseline. The *noise floor* is the same
  measurement for one device against itself with one numerically neutral change. Two are used:
  the batch rows in two groups whose bf16 gradients are summed in fp32
  (``train_single(grad_microbatches=2)``: a reordered sum of the weight gradients, at bf16
  rounding level from step 1), and the GDN chunk size (:func:`floor_config`,
  ``model.gdn_chunk_size``: a reordered fp32 sum inside the chunked GDN that moves bf16
  roundings downstream only where it flips one). A CP run whose differences stay at the floor
  differs from one device by rounding only.
* **Gradients at fixed weights.** For one set of weights and one batch,
  :func:`single_gradients` (one device, fp32 or bf16 with the trainer's casts) and
  :func:`distributed_gradients` (this rank's part of the trainer's parallel model: CP, FSDP2
  with ``MixedPrecisionPolicy(bf16, reduce fp32)``) return every parameter's gradient as a
  whole fp32 tensor; :func:`gradient_errors` compares them tensor by tensor (rel-L2). A tensor
  whose bf16 CP error against fp32 is well above the bf16 single-device error points at a
  systematic difference (a cast in another place, a missing fp32 accumulation); the floor's own
  bf16 error (chunk size changed) says how far two equally valid bf16 computations lie apart.
* **The GDN decay parameters** (``A_log``, ``dt_bias``) get one gradient term per token and
  head, and the sum cancels (by up to 8000x at 256-512 tokens): rel-L2 of such a gradient
  measures its conditioning, not the computation. :func:`gate_gradient_scales` gives each
  head's ``sum |terms|`` (fp32, one device) and :func:`gate_scaled_errors` the distance in
  those units.

Only ``pp == 1`` and ``ep == 1`` layouts are handled (the CP x FSDP study); others raise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import nn

from overlap_runtime.config.train import TrainConfig
from overlap_runtime.layers.gated_deltanet import GatedDeltaNet
from overlap_runtime.testing import rel_l2
from overlap_runtime.trainer.build import build_model, build_parallel_model, ce_sum
from overlap_runtime.trainer.data import build_dataset
from overlap_runtime.trainer.loop import train_single
from overlap_runtime.trainer.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from overlap_runtime.trainer.loop import TrainResult

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepDifference:
    """One step of a run against its baseline: ``|a - b| / |b|`` of loss and grad norm."""

    step: int
    rel_loss: float
    rel_grad_norm: float


def step_differences(run: "TrainResult", baseline: "TrainResult") -> list[StepDifference]:
    """Per-step relative differences of ``run`` against ``baseline`` (equal lengths)."""
    if len(run.steps) != len(baseline.steps):
        raise ValueError(f"runs differ in length: {len(run.steps)} vs {len(baseline.steps)} steps")
    return [StepDifference(b.step, abs(a.loss - b.loss) / abs(b.loss),
                           abs(a.grad_norm - b.grad_norm) / abs(b.grad_norm))
            for a, b in zip(run.steps, baseline.steps)]


def floor_config(config: TrainConfig, gdn_chunk_size: int = 32) -> TrainConfig:
    """``config`` with the one neutral change of the noise floor: ``model.gdn_chunk_size``.

    Raises:
        ValueError: the chunk size equals the config's (no change) or the GDN runs on the
            Triton backend (its chunk is fixed at 64).
    """
    m = config.model
    if gdn_chunk_size == m.gdn_chunk_size:
        raise ValueError(f"floor_config: gdn_chunk_size={gdn_chunk_size} is the config's own "
                         f"chunk size; the floor needs a different one")
    if m.gdn_backend != "eager":
        raise ValueError(f"floor_config: model.gdn_backend={m.gdn_backend!r} has a fixed chunk "
                         f"size; the chunk-size floor needs gdn_backend='eager'")
    data = config.model_dump()
    data["model"]["gdn_chunk_size"] = gdn_chunk_size
    return TrainConfig.model_validate(data)


def _check_layout(config: TrainConfig) -> None:
    acc = config.train.accelerator
    if acc.pp != 1 or acc.ep != 1:
        raise ValueError(f"trainer.numerics handles pp == 1 and ep == 1 layouts (CP x FSDP); got "
                         f"train.accelerator.pp={acc.pp}, ep={acc.ep}")


def single_gradients(config: TrainConfig, weights: Weights | None, step: int,
                     precision: str | None = None, grad_microbatches: int = 1) -> Weights:
    """Every parameter's gradient on one device for the batch of ``step`` (0-based).

    Args:
        config: model, data and seed (``train.precision`` unless ``precision`` is given).
        weights: ``{name: fp32 tensor}`` to load; None: the seed's initial weights.
        step: the data step whose global batch is used.
        precision: ``"fp32"`` or ``"bf16"`` (the trainer's casts: a bf16 copy of the model,
            gradients cast to fp32); None: ``config.train.precision``.
        grad_microbatches: the rows in that many groups, gradients summed in fp32 (the
            floor's reordered sum, as ``train_single(grad_microbatches=...)``).

    Returns:
        ``{name: gradient}``, fp32 tensors of the parameters' shapes, on the CPU.
    """
    _check_layout(config)
    precision = precision or config.train.precision
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r}: expected 'fp32' or 'bf16'")
    model = build_model(config)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    compute = model.to(torch.bfloat16) if precision == "bf16" else model
    batch = build_dataset(config.data, config.dp, config.train.seed).full_batch(step)
    rows = batch.input_ids.shape[0]
    if grad_microbatches < 1 or rows % grad_microbatches:
        raise ValueError(f"grad_microbatches={grad_microbatches} must divide the batch's {rows} "
                         f"rows")
    n = rows // grad_microbatches
    grads: Weights = {}
    for i in range(grad_microbatches):
        r = slice(i * n, (i + 1) * n)
        pos = batch.position_ids if batch.position_ids.dim() == 1 else batch.position_ids[r]
        logits = compute(batch.input_ids[r], pos, **batch.model_kwargs())
        (ce_sum(logits, batch.labels[r]) / batch.global_tokens).backward()
        for name, p in compute.named_parameters():
            if p.grad is not None:
                g = p.grad.float()
                grads[name] = g if name not in grads else grads[name] + g
                p.grad = None
    return grads


def _load_sharded(model: nn.Module, weights: Weights) -> None:
    """Copy whole fp32 ``weights`` into the FSDP2 (DTensor) parameters of ``model``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise KeyError(f"weights lack parameters {missing[:4]} ({len(missing)} in all)")
    with torch.no_grad():
        for name, p in params.items():
            full = weights[name].to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            else:
                p.copy_(full)


def distributed_gradients(config: TrainConfig, weights: Weights | None, step: int,
                          device: torch.device | str = "cpu") -> Weights:
    """Every parameter's gradient under the trainer's parallel model, on every rank.

    Runs on each rank of an initialised process group whose size is the layout's world size
    (``train.accelerator``, pp == 1, ep == 1): builds the model as ``train_distributed`` does
    (CP strategies, FSDP2 with the ``train.precision`` policy), loads ``weights`` (None: the
    seed's), runs forward and backward of this rank's shard of ``step``'s batch and gathers each
    reduced gradient whole (``DTensor.full_tensor``, a collective on every rank).

    Returns:
        ``{name: gradient}``, fp32 whole tensors on the CPU (the same on every rank).
    """
    _check_layout(config)
    device = torch.device(device)
    acc = config.train.accelerator
    dims = ParallelDims.of(acc.model_copy(update={"world_size": dist.get_world_size()}
                                           ).layout())
    dims.build_meshes(device.type)
    coords = dims.coordinates(dist.get_rank())
    pm = build_parallel_model(config, dims, device, coords["pp"])
    try:
        model = pm.parts[0]
        if weights is not None:
            _load_sharded(model, weights)
        batch = build_dataset(config.data, dims.dp, config.train.seed).rank_batch(
            step, coords["dp"], coords["cp"], dims.cp)
        logits = model(batch.input_ids.to(device), batch.position_ids.to(device),
                       **batch.model_kwargs(device))
        (ce_sum(logits, batch.labels.to(device)) / batch.global_tokens).backward()
        out: Weights = {}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad
            full = g.full_tensor() if hasattr(g, "full_tensor") else g
            out[name] = full.detach().float().cpu()
        return out
    finally:
        pm.close()


def gradient_errors(grads: Weights, reference: Weights) -> dict[str, float]:
    """``{name: rel_l2(grads[name], reference[name])}`` over the reference's tensors.

    Raises:
        KeyError: a tensor of the reference is missing from ``grads``.
    """
    missing = sorted(set(reference) - set(grads))
    if missing:
        raise KeyError(f"gradients lack {missing[:4]} ({len(missing)} in all)")
    return {name: rel_l2(grads[name], ref) for name, ref in reference.items()}


def gate_gradient_scales(config: TrainConfig, weights: Weights | None, step: int,
                         signed: bool = False) -> Weights:
    """The scale of each GDN decay parameter's gradient before its sum over tokens cancels.

    ``A_log`` / ``dt_bias`` ``[hv]`` get one gradient term per token and head,
    ``dL/dg * dg/dtheta`` (``dg/dA_log = g``, ``dg/ddt_bias = -exp(A_log) sigmoid(a + dt_bias)``),
    and their sum cancels: a head's gradient can be thousands of times smaller than
    ``sum |terms|``, so a bf16-level change of the per-token terms moves it by O(1) relative and
    its rel-L2 says nothing. This returns ``sum |terms|`` per head, on one device in fp32, the
    scale :func:`gate_scaled_errors` divides by. ``signed=True`` sums the terms without the
    absolute value: that is the fp32 gradient itself (a check of the terms).

    Returns:
        ``{"<layer>.A_log": [hv], "<layer>.dt_bias": [hv]}`` fp32, one entry per GDN layer.
    """
    _check_layout(config)
    model = build_model(config)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    scales: Weights = {}

    def recorder(prefix: str, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                 ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            g, beta = fn(a, b, a_log, dt_bias)
            with torch.no_grad():
                d_dt = -a_log.exp() * torch.sigmoid(a + dt_bias)  # [B, T, hv]
                g_val = g.detach()

            def hook(dg: torch.Tensor) -> None:
                for name, d in (("A_log", g_val), ("dt_bias", d_dt)):
                    term = dg * d
                    s = (term if signed else term.abs()).sum(dim=(0, 1))
                    key = f"{prefix}.{name}"
                    scales[key] = s if key not in scales else scales[key] + s

            g.register_hook(hook)
            return g, beta
        return gates

    for prefix, m in model.named_modules():
        if isinstance(m, GatedDeltaNet):
            m.gates_fn = recorder(prefix, m.gates_fn)
    batch = build_dataset(config.data, config.dp, config.train.seed).full_batch(step)
    logits = model(batch.input_ids, batch.position_ids, **batch.model_kwargs())
    (ce_sum(logits, batch.labels) / batch.global_tokens).backward()
    return scales


def gate_scaled_errors(grads: Weights, reference: Weights, scales: Weights) -> dict[str, float]:
    """``{name: max over heads |grads - reference| / scale}`` for the GDN decay parameters of
    ``scales`` (:func:`gate_gradient_scales`): the distance in units of the summed per-token
    magnitude, meaningful however much the sum cancels."""
    return {name: float(((grads[name] - reference[name]).abs() / s.clamp_min(1e-30)).max())
            for name, s in scales.items()}


def initial_weights(config: TrainConfig) -> Weights:
    """The seed's initial weights ``{name: fp32 tensor}`` (what every run starts from)."""
    return {n: p.detach().clone() for n, p in build_model(config).state_dict().items()}


def trained_weights(config: TrainConfig, steps: int) -> Weights:
    """Weights after ``steps`` steps of the single-device baseline (``train_single`` with
    ``config``'s precision and optimizer): fixed weights from inside a trajectory."""
    holder: list[nn.Module] = []
    train_single(config.with_overrides(steps=steps), log=lambda line: None,
                 on_model=holder.append)
    return {n: p.detach().clone() for n, p in copy.deepcopy(holder[0]).state_dict().items()}
