"""layers.norm.add_rms_norm / RMSNorm.add_forward (the residual add fused with the next norm)
and rms_norm_keep_input / RMSNorm.forward_keep_input (the residual passed through the norm's
node) equal the plain ops (values and every gradient, float64 and fp32); in bf16 they sum the
two gradients once (no worse than the engine's two roundings against float64); the decoder
layer uses both without changing its function, and its input then has one consumer."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.layers.norm import (AddRMSNormFunction, RMSNorm,
                                         RMSNormKeepInputFunction, add_rms_norm,
                                         add_rms_norm_reference, rms_norm_keep_input_reference)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _run(fn, residual, delta, weight, dh, dy):
    r, d, w = (t.detach().clone().requires_grad_(True) for t in (residual, delta, weight))
    h, y = fn(r, d, w, 1e-6)
    torch.autograd.backward((h, y), (dh, dy))
    return h.detach(), y.detach(), r.grad, d.grad, w.grad


def _inputs(dtype: torch.dtype, shape=(2, 9, 16)):
    torch.manual_seed(0)
    residual, delta, dh, dy = (torch.randn(shape, dtype=dtype) for _ in range(4))
    weight = torch.rand(shape[-1], dtype=dtype) + 0.5
    return residual, delta, weight, dh, dy


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_equals_the_plain_ops(dtype: torch.dtype, tol: float) -> None:
    args = _inputs(dtype)
    got = _run(AddRMSNormFunction.apply, *args)
    ref = _run(add_rms_norm_reference, *args)
    for name, a, b in zip(("h", "y", "d_residual", "d_delta", "d_weight"), got, ref):
        assert a.dtype == b.dtype and _rel(a, b) <= tol, (name, _rel(a, b))


def test_bf16_no_worse_than_the_engine_against_float64() -> None:
    args = _inputs(torch.bfloat16, (4, 64, 256))
    exact = _run(add_rms_norm_reference, *(t.double() for t in args))
    fused = _run(AddRMSNormFunction.apply, *args)
    plain = _run(add_rms_norm_reference, *args)
    for i in range(5):
        assert _rel(fused[i], exact[i]) <= 1e-2
        assert _rel(fused[i], exact[i]) <= _rel(plain[i], exact[i]) * 1.05 + 1e-4


def test_only_the_wanted_gradients() -> None:
    residual, delta, weight, dh, dy = _inputs(torch.float64)
    d = delta.clone().requires_grad_(True)
    h, y = add_rms_norm(residual, d, weight, 1e-6)
    torch.autograd.backward((h, y), (dh, dy))
    ref = _run(add_rms_norm_reference, residual, delta, weight, dh, dy)
    assert _rel(d.grad, ref[3]) <= 1e-12


def _reads(out: torch.Tensor) -> dict[tuple[object, int], int]:
    """``{(node, output index): how many nodes read it}`` over the autograd graph of ``out``."""
    reads: dict[tuple[object, int], int] = {}
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for f, nr in fn.next_functions:
            if f is not None:
                reads[(f, nr)] = reads.get((f, nr), 0) + 1
                stack.append(f)
    return reads


def _run_keep(fn, x, weight, dy, dr):
    xx, w = (t.detach().clone().requires_grad_(True) for t in (x, weight))
    y, r = fn(xx, w, 1e-6)
    torch.autograd.backward((y, r), (dy, dr))
    return y.detach(), r.detach(), xx.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_keep_input_equals_the_plain_ops(dtype: torch.dtype, tol: float) -> None:
    x, _, weight, dy, dr = _inputs(dtype)
    got = _run_keep(RMSNormKeepInputFunction.apply, x, weight, dy, dr)
    ref = _run_keep(rms_norm_keep_input_reference, x, weight, dy, dr)
    assert torch.equal(got[1], x)
    for name, a, b in zip(("y", "r", "dx", "d_weight"), got, ref):
        assert a.dtype == b.dtype and _rel(a, b) <= tol, (name, _rel(a, b))


def test_keep_input_bf16_no_worse_than_the_engine() -> None:
    x, _, weight, dy, dr = _inputs(torch.bfloat16, (4, 64, 256))
    exact = _run_keep(rms_norm_keep_input_reference, *(t.double() for t in (x, weight, dy, dr)))
    fused = _run_keep(RMSNormKeepInputFunction.apply, x, weight, dy, dr)
    plain = _run_keep(rms_norm_keep_input_reference, x, weight, dy, dr)
    for i in range(4):
        assert _rel(fused[i], exact[i]) <= _rel(plain[i], exact[i]) * 1.05 + 1e-4


@pytest.mark.parametrize("zero_centered", [False, True])
def test_module_add_forward_is_add_then_norm(zero_centered: bool) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(16, 1e-6, zero_centered).double()
    with torch.no_grad():
        norm.weight.add_(torch.randn(16, dtype=torch.float64) * 0.1)
    residual, delta = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16,
                                                                          dtype=torch.float64)
    h, y = norm.add_forward(residual, delta)
    assert torch.equal(h, residual + delta)
    assert _rel(y, norm(residual + delta)) <= 1e-14
    y, r = norm.forward_keep_input(residual)
    assert torch.equal(r, residual) and _rel(y, norm(residual)) <= 1e-14


def test_decoder_layer_is_unchanged() -> None:
    """The decoder block with the fused add against its plain formula (float64): output and
    the gradients of its input and every parameter."""
    from overlap_runtime.config.model import Qwen3_5Config
    from overlap_runtime.models.qwen3_5 import Qwen3_5DecoderLayer

    cfg = Qwen3_5Config(hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=8)
    torch.manual_seed(2)
    layer = Qwen3_5DecoderLayer(cfg, "linear_attention").double()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    pos = torch.arange(12)

    def plain(inp):
        h = inp + layer.linear_attn(layer.input_layernorm(inp))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # the layer's input (a node's output here) is read by one node: no engine add for it
    inp = x.clone().requires_grad_(True) * 1.0
    reads = _reads(layer(inp, pos))
    assert {"AddRMSNormFunctionBackward", "RMSNormKeepInputFunctionBackward"} <= {
        type(f).__name__ for f, _ in reads}
    assert reads[(inp.grad_fn, 0)] == 1
    outs, grads = [], []
    for fn in (lambda inp: layer(inp, pos), plain):
        layer.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        out = fn(inp)
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
        grads.append([inp.grad] + [p.grad for p in layer.parameters()])
    assert _rel(outs[0], outs[1]) <= 1e-12
    assert len(grads[0]) == len(list(layer.parameters())) + 1
    for a, b in zip(*grads):
        assert _rel(a, b) <= 1e-10


def test_model_backward_sums_no_gradient_in_the_engine() -> None:
    """In the tiny hybrid (GDN + attention layers, SwiGLU), no autograd node's output is read
    by two nodes: every pair of gradients is summed inside a node (shared-input projections,
    the norms' residual nodes), none by the engine's separate add."""
    from overlap_runtime.trainer import config_from_dict
    from overlap_runtime.trainer.build import build_model

    cfg = config_from_dict({"model": {
        "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8}, "data": {"seq_len": 16, "batch_size": 1}})
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    reads = _reads(model(torch.randint(0, 100, (1, 16))).float().sum())
    twice = sorted(type(f).__name__ for (f, _), n in reads.items() if n > 1)
    assert twice == []
