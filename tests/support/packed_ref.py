"""Independent references for packed documents (tests/layers/test_gdn_packed.py and its Triton
cases in ``tests.support.gdn_packed_cases``): every document run ALONE, never the packed path's masks.

* :func:`conv_per_document`: the ``F.conv1d`` conv (``layers.elementwise.causal_conv_silu``) on
  each segment of each row alone, from zero padding, or from ``left`` for a first segment whose
  token 0 continues a document (position > 0).
* :func:`slow_decay`: parameters under which the documents' states matter.
* :func:`layer_packed_vs_alone`: a GatedDeltaNet's packed forward/backward against the same
  parameters run on each document alone (a reference layer, e.g. the eager backend and the
  torch conv), output, input gradient and every parameter gradient as rel-L2.
"""

from __future__ import annotations

import copy

import torch

from overlap_runtime.layers import GatedDeltaNet
from overlap_runtime.layers.elementwise import causal_conv_silu
from overlap_runtime.layers.segments import segments_of
from overlap_runtime.testing import rel_l2


def row_segments(positions: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, end)`` of each run of positions counting up from a start."""
    rows = []
    for row in positions.tolist():
        cuts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1] + 1] + [len(row)]
        rows.append(list(zip(cuts[:-1], cuts[1:])))
    return rows


def conv_per_document(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                      dilation: int, positions: torch.Tensor) -> torch.Tensor:
    """``[B, T, C]``: each segment of each row through ``causal_conv_silu`` alone."""
    rows = []
    for b, segs in enumerate(row_segments(positions)):
        outs = []
        for s, e in segs:
            ctx = None
            if s == 0 and int(positions[b, 0]) > 0:
                assert left is not None, "a continuing first segment needs left"
                ctx = left[b:b + 1]
            outs.append(causal_conv_silu(x[b:b + 1, s:e], weight, ctx, dilation))
        rows.append(torch.cat(outs, 1))
    return torch.cat(rows, 0)


def _grads(layer: GatedDeltaNet, hidden: torch.Tensor, out: torch.Tensor,
           dout: torch.Tensor) -> dict[str, torch.Tensor]:
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    params = [p for n, p in layer.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [hidden, *params], dout)
    return {"d_hidden": grads[0], **{n: g for n, g in zip(names, grads[1:])}}


def layer_packed_vs_alone(layer: GatedDeltaNet, ref: GatedDeltaNet, hidden: torch.Tensor,
                          cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None,
                          seed: int = 0) -> dict[str, float]:
    """rel-L2 of ``layer(hidden, mask, cu_seqlens)`` (output, d_hidden, every parameter
    gradient) against ``ref`` (same parameters) run on each document alone."""
    ref.load_state_dict(layer.state_dict())
    batch, seq_len = hidden.shape[:2]
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(hidden.shape, generator=gen, dtype=hidden.dtype)

    x = hidden.detach().clone().requires_grad_()
    out = layer(x, mask, cu_seqlens=cu_seqlens)
    got = {"out": out.detach(), **_grads(layer, x, out, dout)}

    xr = hidden.detach().clone().requires_grad_()
    flat, fm = xr.reshape(1, batch * seq_len, -1), None
    if mask is not None:
        fm = mask.reshape(1, batch * seq_len)
    outs = [ref(flat[:, s:e], None if fm is None else fm[:, s:e])
            for s, e in segments_of(cu_seqlens, batch, seq_len)]
    out_ref = torch.cat(outs, 1).reshape(hidden.shape)
    want = {"out": out_ref.detach(), **_grads(ref, xr, out_ref, dout)}
    assert got.keys() == want.keys()
    return {name: float(rel_l2(got[name], want[name])) for name in want}


def slow_decay(layer: GatedDeltaNet) -> GatedDeltaNet:
    """Slow decay (``exp(g)`` about 0.97-0.9995 per token; the default init forgets within a few
    tokens) so a state leaking across a document start would show, and a non-trivial norm
    weight; as tests/support/gdn_cp.py. Also keeps the decay parameters'
    gradients (sums over tokens) away from cancellation, where fp32 rounding of the GDN
    backends' different summation orders would dominate their rel-L2. Returns the layer."""
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.A_log.uniform_(-5.0, -3.0)
        layer.dt_bias.uniform_(-2.0, 0.0)
    return layer


def reference_layer(layer: GatedDeltaNet) -> GatedDeltaNet:
    """A copy of ``layer`` on the eager GDN backend and the ``F.conv1d`` torch conv, for q, k
    and v too: a Triton-conv layer also holds the Triton conv as its per-group conv
    (``conv_parts_fn``); without it the copy runs the one torch conv, then split views
    (``GatedDeltaNet.causal_conv_qkv``), so no Triton kernel runs in the reference."""
    ref = copy.deepcopy(layer)
    ref.backend, ref.conv_backend, ref.conv_fn = "eager", "torch", causal_conv_silu
    ref.conv_parts_fn = None
    return ref
