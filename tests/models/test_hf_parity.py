"""Our decoder equals transformers' Qwen3.5 (dense and MoE) once a checkpoint is imported.

Tiny random models built by ``transformers`` (every parameter randomised), saved with
``save_pretrained`` and imported through ``model.init_from`` (``models.hf``): logits over a
sequence longer than one GDN chunk and over packed documents, every parameter's gradient of one
step, and a 5-step training trajectory of our trainer against a plain AdamW loop over the
``transformers`` model on the same batches. fp32 on CPU: rel-L2 <= 1e-5.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.support.hf_tiny import save_hf, train_config  # noqa: E402

from overlap_runtime.models.hf.state_dict import hf_prefix, hf_source  # noqa: E402
from overlap_runtime.testing import rel_l2  # noqa: E402
from overlap_runtime.trainer import config_from_dict, train_single  # noqa: E402
from overlap_runtime.trainer.build import build_model, ce_sum  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module", params=["dense", "moe"])
def imported(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"hf_{request.param}")
    hf = save_hf(request.param, d)
    config = config_from_dict(train_config(str(d)))
    return request.param, hf, build_model(config), config


def test_logits_over_more_than_one_gdn_chunk(imported) -> None:
    _, hf, ours, _ = imported
    ids = torch.randint(0, 272, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = rel_l2(ours(ids), hf(ids).logits)
    assert err <= TOL, err


def test_packed_documents_equal_each_document_alone(imported) -> None:
    _, hf, ours, _ = imported
    lengths = [70, 20, 38]  # one document crosses a chunk boundary
    ids = torch.randint(0, 272, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 70, 90, 128])
    with torch.no_grad():
        packed = ours(ids, cu_seqlens=cu)
        alone = torch.cat([hf(ids[:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    err = rel_l2(packed, alone)
    assert err <= TOL, err


def _hf_grad(hf, name: str, prefix: str, num_experts: int) -> torch.Tensor:
    src = hf_source(name, prefix, num_experts)
    params = dict(hf.named_parameters())
    if not src.stacked:
        return params[src.keys[0]].grad
    # transformers >= 5 keeps experts stacked in memory: gate_up_proj [E, 2F, H], down_proj
    # [E, H, F]; ours are w1/w3 [E, H, F], w2 [E, F, H]
    layer = name.split(".")[1]
    experts = f"model.layers.{layer}.mlp.experts."
    if name.endswith("w2"):
        return params[experts + "down_proj"].grad.transpose(1, 2)
    gate, up = params[experts + "gate_up_proj"].grad.chunk(2, dim=1)
    return (gate if name.endswith("w1") else up).transpose(1, 2)


def _record_gate_scales(model) -> dict[str, torch.Tensor]:
    """``sum_t |dL/dg * dg/dtheta|`` per head of every A_log / dt_bias, filled by backward:
    their gradients are sums of per-token terms that cancel (by orders of magnitude), so they
    are compared in units of that sum (fp32 rounding of each term), not by rel-L2."""
    from overlap_runtime.layers.gated_deltanet import GatedDeltaNet

    scales: dict[str, torch.Tensor] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, GatedDeltaNet):
            def gates(a, b, a_log, dt_bias, fn=m.gates_fn, prefix=prefix):
                g, beta = fn(a, b, a_log, dt_bias)
                with torch.no_grad():
                    d_dt = -a_log.exp() * torch.sigmoid(a + dt_bias)
                    g_val = g.detach()

                def hook(dg):
                    for name, d in (("A_log", g_val), ("dt_bias", d_dt)):
                        scales[f"{prefix}.{name}"] = (dg * d).abs().sum(dim=(0, 1))
                g.register_hook(hook)
                return g, beta
            m.gates_fn = gates
    return scales


def test_every_parameter_gradient_of_one_step(imported) -> None:
    kind, hf, ours, config = imported
    ids = torch.randint(0, 272, (2, 96), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    exact = copy.deepcopy(ours).double()  # the fp32 rounding floor of each gradient
    ce_sum(exact(ids), labels).backward()
    floor = {n: p.grad for n, p in exact.named_parameters()}
    scales = _record_gate_scales(ours)
    ours.zero_grad()
    ce_sum(ours(ids), labels).backward()
    hf.zero_grad()
    ce_sum(hf(ids).logits, labels).backward()
    prefix = hf_prefix({n for n, _ in hf.named_parameters()})
    worst: dict[str, float] = {}
    tol: dict[str, float] = {}
    for name, p in ours.named_parameters():
        ref = _hf_grad(hf, name, prefix, config.model.num_experts)
        assert ref is not None, name
        if name in scales:  # in units of the summed per-token magnitude
            worst[name] = float(((p.grad - ref).abs() / scales[name]).max())
            tol[name] = TOL
        else:
            worst[name] = rel_l2(p.grad, ref)
            # both fp32 results lie about rel_l2(fp32, float64) from the exact gradient; the
            # gradient of an early layer passes back through every later one, so its floor
            # can exceed 1e-5: allow 8x the floor (two roundings, 4x margin)
            tol[name] = max(TOL, 8 * rel_l2(p.grad.double(), floor[name]))
    bad = {n: (e, tol[n]) for n, e in worst.items() if not e <= tol[n]}
    assert not bad, bad
    assert len(worst) == len(list(ours.parameters()))
    assert len(scales) == 2 * sum(t == "linear_attention" for t in config.model.layer_types)


def test_five_step_trajectory_against_a_plain_transformers_loop(tmp_path) -> None:
    # dense: no routing choice that a reduction-order rounding could flip
    hf = save_hf("dense", tmp_path, seed=4).train()
    config = config_from_dict(train_config(str(tmp_path), steps=5))
    ours = train_single(config)
    from overlap_runtime.trainer.data import build_dataset

    data = build_dataset(config.data, 1, config.train.seed)
    o = config.optimizer
    opt = torch.optim.AdamW(hf.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    losses = []
    for step in range(5):
        batch = data.full_batch(step)
        opt.zero_grad()
        loss = ce_sum(hf(batch.input_ids).logits, batch.labels) / batch.global_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), o.max_grad_norm)
        opt.step()
        losses.append(loss.item())
    ref = [s.loss for s in ours.steps]
    assert all(math.isfinite(x) for x in losses)
    errs = [abs(a - b) / abs(b) for a, b in zip(ref, losses)]
    assert max(errs) <= TOL, (ref, losses)
    assert losses[-1] < losses[0]


def test_pooled_aux_loss_gradient_equals_transformers(tmp_path) -> None:
    """``moe_aux_loss_pooling: model`` is transformers' ``router_aux_loss_coef * aux`` pooled
    over the layers (``output_router_logits=True``): every router gradient of the loss
    ``CE + coef * aux`` agrees (the CE alone is checked above; a large coefficient makes the
    aux term dominate the router gradients)."""
    from tests.support.hf_tiny import hf_model

    coef = 5.0
    hf = hf_model("moe", seed=10)
    hf.config.router_aux_loss_coef = coef
    hf.router_aux_loss_coef = coef
    hf.save_pretrained(str(tmp_path))
    config = config_from_dict(train_config(str(tmp_path), model={
        "moe_aux_loss_coef": coef, "moe_aux_loss_pooling": "model"}))
    ours = build_model(config)
    ids = torch.randint(0, 272, (2, 80), generator=torch.Generator().manual_seed(11))
    out = hf(ids, labels=ids, output_router_logits=True)
    hf.zero_grad()
    out.loss.backward()
    logits = ours(ids)
    (ce_sum(logits[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()).backward()
    params = dict(hf.named_parameters())
    for i in range(4):
        name = f"layers.{i}.mlp.router.gate.weight"
        ref = params[f"model.layers.{i}.mlp.gate.weight"].grad
        err = rel_l2(dict(ours.named_parameters())[name].grad, ref)
        assert err <= 1e-5, (name, err)
