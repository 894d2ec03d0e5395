"""Cases of tests/ops/test_causal_conv_triton.py, run as ``python -m tests.support.causal_conv_cases`` in a
child process with ``TRITON_INTERPRET=1`` (triton reads it when the kernels are first imported;
a child keeps it out of the other test files). Prints one line ``RESULT {json}``:
``{case: {"errors": {name: rel-L2}, "tolerance": float}}``.

Every case: y, dx, dweight and d_left of the Triton kernels against ``causal_conv_silu``
(``F.conv1d``) on the float64 inputs, with the same float64 output gradient.
"""

from __future__ import annotations

import json

import torch

from tests.support.interpreter import require_interpreter  # noqa: E402

require_interpreter()
torch.set_num_threads(1)

from overlap_runtime.layers import GatedDeltaNet  # noqa: E402
from overlap_runtime.layers.elementwise import causal_conv_silu  # noqa: E402
from overlap_runtime.ops.causal_conv import (causal_conv_silu_triton,  # noqa: E402
                                             causal_conv_silu_triton_parts, function)
from overlap_runtime.testing import rel_l2  # noqa: E402

# name: (B, T, C, K, dilation, with left, x dtype, weight dtype, backward tile rows (None:
# the module's), backward rows per program, tolerance).
# T = 130 / 77 / 45 are not multiples of any tile; C = 48 / 24 are not multiples of the channel
# block. Tile rows 32 at K = 4 own 29 rows each, so rows per program 64 at T = 130 give 3
# programs of 2 tiles per batch (3 * 2 = 6 fp32 partial sums of dweight reduced), and each
# tile's dx reads ds of rows the next tile owns; T = 300 with the module's 256-row tiles is
# two programs; bf16/fp16 add one rounding of y / dx (the interpreter truncates casts, hence
# the bound).
CASES = {
    "k4_d1_left": (2, 130, 48, 4, 1, True, torch.float32, torch.float32, None, 256, 1e-5),
    "k4_d1_left_t300": (1, 300, 16, 4, 1, True, torch.float32, torch.float32, None, 256, 1e-5),
    "k4_d1_left_rows64": (2, 130, 48, 4, 1, True, torch.float32, torch.float32, 32, 64, 1e-5),
    "k4_d1": (2, 77, 64, 4, 1, False, torch.float32, torch.float32, None, 256, 1e-5),
    # x a channel slice of a wider [B, T, 80] tensor (strides (80 T, 80, 1), read in place)
    "k4_d1_left_channel_slice": (2, 77, 48, 4, 1, True, torch.float32, torch.float32, 32, 64,
                                 1e-5),
    "k2_d2_left": (2, 45, 24, 2, 2, True, torch.float32, torch.float32, None, 256, 1e-5),
    "k3_d2": (2, 100, 24, 3, 2, False, torch.float32, torch.float32, 32, 256, 1e-5),
    "k3_d1_left": (2, 64, 16, 3, 1, True, torch.float32, torch.float32, None, 256, 1e-5),
    "k4_d2_left_t_below_halo": (2, 3, 16, 4, 2, True, torch.float32, torch.float32, 32, 256,
                                1e-5),
    "bf16_k4_left_fp32_weight": (2, 70, 32, 4, 1, True, torch.bfloat16, torch.float32, 32, 256,
                                 1e-2),
    "fp16_k4_left": (2, 70, 32, 4, 1, True, torch.float16, torch.float16, None, 256, 2e-3),
}

# name: case of CASES run with doc_positions (documents of 37, 50 and the rest of T, the first
# one continuing from before x; taps never cross a document start)
DOCUMENT_CASES = {
    "docs_k4_d1_left_rows64": "k4_d1_left_rows64",
    "docs_k3_d2": "k3_d2",
    "docs_k4_d1_left": "k4_d1_left",
}


def run_case(name: str) -> dict:
    base = DOCUMENT_CASES.get(name, name)
    docs = name in DOCUMENT_CASES
    batch, seq_len, channels, kernel, dil, with_left, dtype, wdtype, tile, rows, tol = CASES[base]
    gen = torch.Generator().manual_seed(len(name))
    if name.endswith("channel_slice"):
        wide = torch.randn(batch, seq_len, channels + 32, generator=gen).to(dtype)
        x = wide[:, :, 16:16 + channels].requires_grad_()
        assert not x.is_contiguous()
    else:
        x = torch.randn(batch, seq_len, channels, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(channels, kernel, generator=gen) * 0.7).to(wdtype).requires_grad_()
    left = None
    if with_left:
        left = torch.randn(batch, (kernel - 1) * dil, channels, generator=gen).to(dtype)
        left.requires_grad_()
    dy = torch.randn(batch, seq_len, channels, generator=gen, dtype=torch.float64)
    leaves = [t for t in (x, w, left) if t is not None]
    pos = None
    if docs:  # the first document began 10 tokens before x (left reaches it)
        pos = torch.cat([torch.arange(10, 47), torch.arange(50), torch.arange(seq_len - 87)])
        pos = pos.repeat(batch, 1)
    default = function.BACKWARD_ROWS, function.BACKWARD_BLOCK_T
    function.BACKWARD_ROWS = rows
    function.BACKWARD_BLOCK_T = default[1] if tile is None else tile
    try:
        y = causal_conv_silu_triton(x, w, left, dil, doc_positions=pos)
        grads = torch.autograd.grad(y, leaves, dy.to(dtype))
    finally:
        function.BACKWARD_ROWS, function.BACKWARD_BLOCK_T = default
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_left = ref_leaves[2] if with_left else None
    y_ref = causal_conv_silu(ref_leaves[0], ref_leaves[1], ref_left, dil, doc_positions=pos)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy)
    errors = {"y": rel_l2(y.double(), y_ref)}
    for label, g, r in zip(("dx", "dweight", "d_left"), grads, ref_grads):
        errors[label] = rel_l2(g.double(), r)
    dtypes_ok = y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == wdtype
    return {"errors": errors, "tolerance": tol, "dtypes_ok": dtypes_ok}


def run_parts() -> dict:
    """``causal_conv_silu_triton_parts`` on groups of 16, 16 and 32 channels (x a slice of a
    wider tensor, with left and packed documents) against the float64 conv of the whole x; the
    loss uses the first and last groups only (the middle one's output gradient is None)."""
    gen = torch.Generator().manual_seed(5)
    batch, seq_len, sizes, kernel = 1, 100, (16, 16, 32), 4
    wide = torch.randn(batch, seq_len, 80, generator=gen)
    x = wide[:, :, 8:72].requires_grad_()
    w = (torch.randn(64, kernel, generator=gen) * 0.7).requires_grad_()
    left = torch.randn(batch, kernel - 1, 64, generator=gen).requires_grad_()
    # the first document began 10 tokens before x (left reaches it), two more start inside
    pos = torch.cat([torch.arange(10, 47), torch.arange(50), torch.arange(seq_len - 87)])
    pos = pos.repeat(batch, 1)
    dys = [torch.randn(batch, seq_len, n, generator=gen, dtype=torch.float64) for n in sizes]
    ys = causal_conv_silu_triton_parts(x, w, sizes, left, 1, pos)
    grads = torch.autograd.grad([ys[0], ys[2]], [x, w, left], [dys[0].float(), dys[2].float()])
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, left)]
    y_ref = causal_conv_silu(ref_in[0], ref_in[1], ref_in[2], 1, doc_positions=pos)
    dy_ref = torch.cat([dys[0], torch.zeros_like(dys[1]), dys[2]], -1)
    ref_grads = torch.autograd.grad(y_ref, ref_in, dy_ref)
    errors = {"y": rel_l2(torch.cat(ys, -1).double(), y_ref)}
    for label, g, r in zip(("dx", "dweight", "d_left"), grads, ref_grads):
        errors[label] = rel_l2(g.double(), r)
    dtypes_ok = all(y.is_contiguous() and y.dtype == x.dtype for y in ys)
    return {"errors": errors, "tolerance": 1e-5, "dtypes_ok": dtypes_ok}


def run_layer() -> dict:
    """A GatedDeltaNet layer with conv_backend="triton" against the same layer with "torch"."""
    out = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        layer = GatedDeltaNet(32, 2, 4, 8, 8, conv_backend=backend)
        x = torch.randn(2, 70, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out[backend] = (y.detach(), x.grad, layer.conv1d.weight.grad, layer.in_proj_qkv.weight.grad)
    errors = {name: rel_l2(a, b) for name, a, b in
              zip(("out", "dx", "conv1d.weight", "in_proj_qkv.weight"), out["triton"], out["torch"])}
    return {"errors": errors, "tolerance": 1e-5, "dtypes_ok": True}


if __name__ == "__main__":
    results = {name: run_case(name) for name in (*CASES, *DOCUMENT_CASES)}
    results["gated_deltanet_layer"] = run_layer()
    results["parts"] = run_parts()
    print("RESULT " + json.dumps(results))
