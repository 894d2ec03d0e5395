"""The layers' elementwise pieces (layers.elementwise) against independent references, and
their compiled form (layers.compile, ``train.compile``) against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlap_runtime.layers.elementwise import causal_conv_silu, causal_conv_silu_shifted
from overlap_runtime.testing import rel_l2


@pytest.mark.parametrize("conv", [causal_conv_silu, causal_conv_silu_shifted])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dilation", [1, 2])
@pytest.mark.parametrize("with_left", [False, True])
def test_causal_conv_silu_matches_conv1d(conv, dtype: torch.dtype, dilation: int,
                                         with_left: bool) -> None:
    torch.manual_seed(0)
    b, t, c, k = 2, 37, 12, 4
    halo = (k - 1) * dilation
    x = torch.randn(b, t, c, dtype=dtype)
    w = torch.randn(c, 1, k, dtype=dtype)
    left = torch.randn(b, halo, c, dtype=dtype) if with_left else None
    full = torch.cat([left if left is not None else torch.zeros(b, halo, c, dtype=dtype), x], 1)
    ref = F.silu(F.conv1d(full.transpose(1, 2), w, None, 1, 0, dilation, c)).transpose(1, 2)
    got = conv(x, w[:, 0, :], left, dilation)
    assert got.dtype == dtype and got.shape == (b, t, c)
    assert rel_l2(got, ref) <= (1e-6 if dtype == torch.float32 else 1e-14)


def test_train_compile_matches_eager_on_one_device() -> None:
    """``train.compile: true`` (the norms, the GDN conv and gates compiled by torch.compile)
    trains the same as eager: 2 steps of the tiny hybrid, fp32, loss and grad norm within
    1e-5 relative."""
    from overlap_runtime.trainer import compare_runs, config_from_dict, train_single

    # the shapes of tests/trainer/test_trainer_alignment.py's compiled single-device baseline
    # (tests.support.trainer.tiny_config): whichever runs second finds the graphs compiled
    cfg = {"model": {"hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64},
           "data": {"seq_len": 128, "batch_size": 1},
           "train": {"steps": 2, "accelerator": {"world_size": 1, "cp": 1}}}
    eager = train_single(config_from_dict(cfg))
    cfg["train"]["compile"] = True
    fused = train_single(config_from_dict(cfg))
    diff = compare_runs(fused, eager)
    assert diff["max_rel_dloss"] <= 1e-5 and diff["max_rel_dgrad_norm"] <= 1e-5, diff


def test_sigmoid_gate_compiled_matches_eager() -> None:
    """The attention output gate as ``layers.compile`` runs it (compiled, a strided gate view as
    the layer passes it) against the eager ops: values and both gradients, fp32."""
    from overlap_runtime.layers.compile import compiled
    from overlap_runtime.layers.elementwise import sigmoid_gate

    torch.manual_seed(0)
    q_all = torch.randn(2, 16, 4, 16, requires_grad=True)
    o = torch.randn(2, 16, 4, 8, requires_grad=True)
    grad = torch.randn(2, 16, 4, 8)
    out = []
    for fn in (compiled(sigmoid_gate), lambda a, b: a * torch.sigmoid(b)):
        q_all.grad = o.grad = None
        _, gate = q_all.split(8, dim=-1)
        y = fn(o, gate)
        y.backward(grad)
        out.append((y.detach(), o.grad.clone(), q_all.grad.clone()))
    for got, ref in zip(*out):
        assert rel_l2(got, ref) <= 1e-6
