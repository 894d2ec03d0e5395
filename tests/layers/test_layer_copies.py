"""benchmarks/layer_copies.py (issue #29): the copy counter's bytes on snippets whose answer is
known, and the GDN layer's copies: q, k, v written contiguous by the conv (no copy at the GDN
op), results bitwise unchanged, the forward bytes asserted (a copy added back fails)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from overlap_runtime.layers.elementwise import (causal_conv_silu_shifted,
                                                causal_conv_silu_shifted_parts)
from overlap_runtime.layers.gated_deltanet import GatedDeltaNet
from overlap_runtime.testing import rel_l2

from benchmarks import layer_copies
from tests.support.forked_child import ForkedChild


def _count(fn) -> list:
    counter = layer_copies.CopyCounter()
    with counter:
        fn()
    return counter.records


def test_counter_bytes_of_known_snippets() -> None:
    x = torch.randn(24, 40)
    recs = _count(lambda: x.t().contiguous())
    assert [(r.op, r.nbytes) for r in recs] == [("clone", 24 * 40 * 4)]
    assert _count(lambda: x.t().reshape(40, 2, 12)[0].sum()) == []  # views, arithmetic: none
    assert _count(lambda: x.contiguous()) == []                     # already contiguous
    recs = _count(lambda: x.to(torch.bfloat16))
    assert [(r.op, r.nbytes) for r in recs] == [("_to_copy (cast)", 24 * 40 * 2)]
    recs = _count(lambda: F.pad(x, (0, 0, 3, 0)))
    assert [(r.op, r.nbytes) for r in recs] == [("constant_pad_nd", 27 * 40 * 4)]
    recs = _count(lambda: torch.cat([x, x], 0))
    assert [(r.op, r.nbytes) for r in recs] == [("cat", 48 * 40 * 4)]


def test_counter_attributes_backward_to_the_forward_line() -> None:
    """split's backward (a cat) is charged to the layer line that split."""
    layer = GatedDeltaNet(32, 2, 4, 8, 8)
    conv_out = torch.randn(1, 8, layer.conv_dim, requires_grad=True)
    counter = layer_copies.CopyCounter()
    with torch.autograd.set_detect_anomaly(True, check_nan=False), counter:
        q, k, v = layer.split_qkv(conv_out)
        counter.phase = "backward"
        (q.sum() + k.sum() + v.sum()).backward()
    assert [(r.phase, r.op, r.nbytes) for r in counter.records] == [
        ("backward", "cat", 8 * layer.conv_dim * 4)]
    assert "SplitWithSizesBackward0 @ layers/gated_deltanet.py" in counter.records[0].where
    assert "split_qkv" in counter.records[0].where


@pytest.mark.parametrize("packed", [False, True])
def test_shifted_parts_equal_the_whole_conv(packed: bool) -> None:
    """The compiled conv's form (``train.compile``) per channel group = the whole conv's
    channels, values and gradients (fp32, bitwise here; asserted rel-L2 <= 1e-6)."""
    torch.manual_seed(0)
    sizes = (16, 16, 32)
    x = torch.randn(2, 37, sum(sizes), requires_grad=True)
    w = torch.randn(sum(sizes), 4, requires_grad=True)
    pos = torch.cat([torch.arange(20), torch.arange(17)]).expand(2, 37) if packed else None
    extra = () if pos is None else (pos,)
    whole = causal_conv_silu_shifted(x, w, None, 1, *extra)
    parts = causal_conv_silu_shifted_parts(x, w, sizes, None, 1, pos)
    assert all(p.is_contiguous() for p in parts)
    dy = torch.randn_like(whole)
    gx, gw = torch.autograd.grad(whole, (x, w), dy)
    px, pw = torch.autograd.grad(parts, (x, w), dy.split(sizes, -1))
    got = torch.cat(parts, -1)
    for a, b in ((got, whole), (px, gx), (pw, gw)):
        assert rel_l2(a, b) <= 1e-6


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_interpreter_gdn_layer_copies() -> None:
    """Triton GDN op and Triton conv under the interpreter, bf16: the forward copies only the
    gated norm's and gates' casts (q, k, v reach the op contiguous), results bitwise equal to
    one conv + split; the eager F.conv1d path unchanged (tests/support/layer_copies_cases.py).
    One child per conv backend, side by side (each single-threaded, ~8 s)."""
    children = {b: ForkedChild("layer_copies_cases", b) for b in ("triton", "torch")}
    try:
        for backend, child in children.items():
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0 and out.splitlines()[-1:] == ["ok"], (
                f"conv backend {backend}: cases failed:\n{out}\n{err[-4000:]}")
    finally:
        for child in children.values():
            child.kill()
            child.wait(10)
