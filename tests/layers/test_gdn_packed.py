"""Packed documents through the single-device GDN layer in one pass (issue #22 integration).

``LocalGDNMixer.forward_packed`` runs one conv over the packed rows with the taps before each
document start dropped and one varlen GDN call with ``cu_seqlens``. Checked against every
document run ALONE (``tests.support.packed_ref``: the ``F.conv1d`` conv per segment, the layer per
document), fp32 rel-L2 <= 1e-5 on the output, the input gradient and every parameter gradient:

* here (eager GDN, torch conv): the conv with ``doc_positions`` (K 2..4, dilation 1 and 2, a
  halo ``left`` reaching only a continuing first document), the layer with documents shorter
  than the halo, cut by a row start, crossing GDN chunks, with padding between them; the loop
  is gone (one conv and one GDN op call per layer forward, ``apply_per_segment`` never called);
* under the Triton interpreter (a forked child, ``tests.support.gdn_packed_cases``, about 15 s): the
  Triton conv kernels with ``doc_positions`` and the layer on ``backend="triton"`` with
  ``conv_backend="triton"``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tests.support.packed_ref import conv_per_document, layer_packed_vs_alone, reference_layer, slow_decay

from overlap_runtime.layers import GatedDeltaNet, document_positions, gated_deltanet, segments
from overlap_runtime.layers.elementwise import causal_conv_silu, causal_conv_silu_shifted
from overlap_runtime.testing import rel_l2

from tests.support.gdn import run_interpreted
TOL = 1e-5

# B = 2 rows of T = 12: documents of 3, 1 (shorter than the halo 3), 6, 2 (cut by the row start
# at 12 -> 2 + 5), 7
CU = torch.tensor([0, 3, 4, 10, 12, 17, 24], dtype=torch.int32)


@pytest.mark.parametrize("kernel,dilation,with_left", [(4, 1, True), (3, 2, False), (2, 1, True)])
@pytest.mark.parametrize("fn", [causal_conv_silu_shifted, causal_conv_silu])
def test_conv_with_document_positions_equals_each_document_alone(fn, kernel, dilation,
                                                                 with_left) -> None:
    gen = torch.Generator().manual_seed(kernel * 10 + dilation)
    batch, seq_len, channels = 2, 12, 6
    pos = document_positions(CU, batch, seq_len)
    if with_left:  # row 0 continues a document from before x: its first positions count on
        pos[0, :3] += 5
    x = torch.randn(batch, seq_len, channels, generator=gen, requires_grad=True)
    w = torch.randn(channels, kernel, generator=gen, requires_grad=True)
    left = None
    if with_left:
        left = torch.randn(batch, (kernel - 1) * dilation, channels, generator=gen,
                           requires_grad=True)
    dy = torch.randn(batch, seq_len, channels, generator=gen)
    leaves = [t for t in (x, w, left) if t is not None]
    y = fn(x, w, left, dilation, pos)
    got = [y, *torch.autograd.grad(y, leaves, dy)]
    y_ref = conv_per_document(x, w, left, dilation, pos)
    want = [y_ref, *torch.autograd.grad(y_ref, leaves, dy)]
    errors = {n: rel_l2(a, b) for n, a, b in zip(("y", "dx", "dw", "d_left"), got, want)}
    assert all(e <= TOL for e in errors.values()), errors
    # the masks matter: the same conv without positions reads across document starts
    assert rel_l2(fn(x, w, left, dilation), y_ref) > 1e-2


def _layer(**kw) -> GatedDeltaNet:
    torch.manual_seed(0)
    return slow_decay(GatedDeltaNet(hidden_size=24, num_key_heads=2, num_value_heads=4,
                                    head_k_dim=8, head_v_dim=8, chunk_size=4, **kw))


def test_packed_layer_equals_each_document_alone() -> None:
    layer = _layer()
    hidden = torch.randn(2, 12, 24, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[0, 9] = 0  # padding at the end of a document and at a row's last token
    mask[1, 11] = 0
    hidden[0, 9] = float("nan")  # a padded slot may hold anything
    errors = layer_packed_vs_alone(layer, reference_layer(layer), hidden, CU, mask)
    assert len(errors) == 2 + len(list(layer.parameters())), errors.keys()
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"rel-L2 above {TOL}: {bad}"
    # one document per row is the unpacked layer
    whole = torch.tensor([0, 12, 24], dtype=torch.int64)
    assert rel_l2(layer(hidden[1:], cu_seqlens=whole[:2]), layer(hidden[1:])) <= TOL


def test_packed_forward_is_one_conv_and_one_gdn_call(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    calls: list[dict] = []
    op = gated_deltanet.chunk_gated_delta_rule

    def counting_op(q, *args, **kwargs):
        cu = kwargs.get("cu_seqlens")
        calls.append({"q": tuple(q.shape), "cu": None if cu is None else cu.tolist()})
        return op(q, *args, **kwargs)

    def no_loop(*args, **kwargs):
        raise AssertionError("apply_per_segment called: the per-document loop is back")

    convs = []
    conv_fn = layer.conv_fn
    layer.conv_fn = lambda *a: convs.append(a[0].shape) or conv_fn(*a)
    monkeypatch.setattr(gated_deltanet, "chunk_gated_delta_rule", counting_op)
    monkeypatch.setattr(segments, "apply_per_segment", no_loop)
    hidden = torch.randn(2, 12, 24, requires_grad=True)
    layer(hidden, cu_seqlens=CU).sum().backward()
    assert calls == [{"q": (1, 24, 2, 8), "cu": CU.tolist()}], calls
    assert convs == [torch.Size([2, 12, layer.conv_dim])], convs
    with pytest.raises(ValueError, match="every row start"):
        layer(hidden, cu_seqlens=torch.tensor([0, 3, 13, 24]))


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_interpreter_triton_conv_and_gdn_packed_equal_each_document_alone() -> None:
    result = run_interpreted("gdn_packed_cases")
    assert set(result) == {"conv_k4_d1_left", "conv_k3_d2", "layer_triton_triton"}, result
    for case, errors in result.items():
        assert len(errors) >= 3, (case, errors)
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"{case}: rel-L2 above {TOL}: {bad}"
