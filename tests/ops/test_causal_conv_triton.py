"""The causal depthwise conv + SiLU Triton kernels (``ops.causal_conv``, ``conv_backend="triton"``).

* Under the Triton interpreter (one child process with ``TRITON_INTERPRET=1``, cases in
  ``tests.support.causal_conv_cases``): y, dx, dweight and d_left against ``causal_conv_silu`` on float64
  inputs, rel-L2 <= 1e-5 in fp32; with and without ``left``, dilation 1 and 2, K 2..4, T not a
  multiple of the tile (and below the halo), B = 2, several partial sums of dweight; bf16 / fp16
  within their rounding; x a channel slice of a wider tensor (read in place); a whole GatedDeltaNet layer with ``conv_backend="triton"`` against
  ``"torch"``; the backward at the module's 256-row tiles and at 32-row tiles with several
  tiles per program; packed documents (``doc_positions``); the conv on channel
  groups (``causal_conv_silu_triton_parts``: q, k, v contiguous, each group's dx written into
  one gradient, an unused group's output gradient None). About 20 s on two shared cores.
* In this process (no kernel runs): the named errors, and the wiring (model config ->
  GatedDeltaNet.conv_fn, kept by ``compile_elementwise``).
* On a CUDA device only: 32K tokens x 8192 channels, fp32 against float64 and bf16 against the
  fp32 conv.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.support.gdn import run_interpreted
from overlap_runtime.layers import GatedDeltaNet
from overlap_runtime.layers.compile import compile_elementwise
from overlap_runtime.layers.elementwise import causal_conv_silu
from overlap_runtime.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from overlap_runtime.ops.causal_conv import causal_conv_silu_triton
from overlap_runtime.testing import rel_l2

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
CASE_NAMES = ("k4_d1_left", "k4_d1_left_t300", "k4_d1_left_rows64", "k4_d1",
              "k4_d1_left_channel_slice", "k2_d2_left", "k3_d2", "k3_d1_left",
              "k4_d2_left_t_below_halo", "bf16_k4_left_fp32_weight", "fp16_k4_left",
              "gated_deltanet_layer", "docs_k4_d1_left_rows64", "docs_k3_d2", "docs_k4_d1_left",
              "parts")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted("causal_conv_cases")


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("case", CASE_NAMES)
def test_interpreter_matches_float64_conv(interpreted: dict, case: str) -> None:
    result = interpreted[case]
    errors, tol = result["errors"], result["tolerance"]
    assert result["dtypes_ok"], f"{case}: y / dx / dweight not in the inputs' dtypes"
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"{case}: rel-L2 above {tol}: {bad} (all: {errors})"


def _inputs(**over):
    args = dict(x=torch.randn(2, 9, 4), weight=torch.randn(4, 3), left=None, dilation=1)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(x=torch.randn(2, 9, 4, dtype=torch.float64)), NotImplementedError, "x dtype"),
    (dict(weight=torch.randn(4, 9)), NotImplementedError, "K=9"),
    (dict(weight=torch.randn(5, 3)), ValueError, r"weight must be \[C=4, K\]"),
    (dict(x=torch.randn(9, 4)), ValueError, r"x must be \[B, T, C\]"),
    (dict(x=torch.randn(2, 4, 9).transpose(1, 2)), ValueError, "C innermost"),
    (dict(x=torch.randn(2, 0, 4)), ValueError, "empty dim"),
    (dict(left=torch.randn(2, 3, 4)), ValueError, r"\[2, 2, 4\]"),
    (dict(left=torch.randn(2, 4, 4), dilation=2, weight=torch.randn(4, 2)), ValueError,
     r"\[2, 2, 4\]"),
    (dict(left=torch.randn(2, 2, 4, dtype=torch.float16)), ValueError, "left dtype"),
    (dict(dilation=0), ValueError, "dilation=0"),
    (dict(), NotImplementedError, "TRITON_INTERPRET=1"),  # cpu without the interpreter
])
def test_unsupported_inputs_raise_named_errors(over, exc, match) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1" and not over:
        pytest.skip("this process runs under the interpreter")
    with pytest.raises(exc, match=match):
        causal_conv_silu_triton(**_inputs(**over))


def test_conv_backend_is_explicit_and_wired() -> None:
    with pytest.raises(ValueError, match="conv_backend='auto'"):
        GatedDeltaNet(32, 2, 4, 8, 8, conv_backend="auto")
    with pytest.raises(ValueError, match="conv_backend"):
        Qwen3_5Config(conv_backend="auto")
    with pytest.raises(NotImplementedError, match="K <= 8"):
        GatedDeltaNet(32, 2, 4, 8, 8, conv_kernel_size=9, conv_backend="triton")
    for backend, expected in (("torch", causal_conv_silu), ("triton", causal_conv_silu_triton)):
        model = Qwen3_5ForCausalLM(Qwen3_5Config(conv_backend=backend))
        layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(m.conv_fn is expected for m in layers), backend
        compile_elementwise(model)  # train.compile: the Triton conv stays, torch gets compiled
        fns = {m.conv_fn for m in layers}
        if backend == "triton":
            assert fns == {causal_conv_silu_triton}
        else:
            assert causal_conv_silu not in fns and causal_conv_silu_triton not in fns


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_full_size(dtype: torch.dtype, tol: float) -> None:
    """32K tokens x 8192 channels, K = 4, with a halo: fp32 against the float64 conv, bf16
    against the fp32 conv (one rounding of y, dx, d_left; dweight reduced in fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, ref_dtype = torch.device("cuda"), torch.promote_types(dtype, torch.float64) \
        if dtype == torch.float32 else torch.float32
    x = torch.randn(1, 32768, 8192, device=dev, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(8192, 4, device=dev, generator=gen) * 0.5).requires_grad_()
    left = torch.randn(1, 3, 8192, device=dev, generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(1, 32768, 8192, device=dev, generator=gen).to(dtype)
    y = causal_conv_silu_triton(x, w, left, 1)
    got = (y, *torch.autograd.grad(y, (x, w, left), dy))
    ref_in = [t.detach().to(ref_dtype).requires_grad_() for t in (x, w, left)]
    y_ref = causal_conv_silu(ref_in[0], ref_in[1], ref_in[2], 1)
    ref = (y_ref, *torch.autograd.grad(y_ref, ref_in, dy.to(ref_dtype)))
    errors = {n: rel_l2(a.double(), b.double()) for n, a, b in
              zip(("y", "dx", "dweight", "d_left"), got, ref)}
    assert all(e <= tol for e in errors.values()), f"{dtype}: {errors}"
