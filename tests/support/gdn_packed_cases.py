"""Cases of tests/layers/test_gdn_packed.py under the Triton interpreter, run as ``python -m
tests.support.gdn_packed_cases`` in a child process with ``TRITON_INTERPRET=1`` (triton reads it when the
kernels are first imported; a child keeps it out of other test files). Prints one line
``RESULT {case: {name: rel-L2}}``, each against the documents run alone (``tests.support.packed_ref``):

* ``conv_*``: the Triton conv with ``doc_positions`` (y, dx, dweight, d_left) against the
  ``F.conv1d`` conv of each segment alone on the float64 inputs;
* ``layer_triton_triton``: a GatedDeltaNet (fp32, K = V = 16, chunk 64) on the Triton GDN and
  the Triton conv, packed rows of two lengths (1 token, longer than a chunk, cut by a row start,
  with padding) against the eager / ``F.conv1d`` layer on each document alone: output, input
  gradient and every parameter gradient.
"""

from __future__ import annotations

import json

import torch

from tests.support.interpreter import require_interpreter  # noqa: E402

require_interpreter()
torch.set_num_threads(1)

from tests.support.packed_ref import (conv_per_document, layer_packed_vs_alone,  # noqa: E402
                         reference_layer, slow_decay)
from overlap_runtime.layers import GatedDeltaNet, document_positions  # noqa: E402
from overlap_runtime.ops.causal_conv import causal_conv_silu_triton  # noqa: E402
from overlap_runtime.testing import rel_l2  # noqa: E402

# B = 2 rows of T = 45 (not a multiple of the 32-row tile): documents of 1, 30, 14 | 3, 42
CONV_CU = torch.tensor([0, 1, 31, 45, 48, 90], dtype=torch.int64)
# B = 2 rows of T = 80: 1, 69 (> one chunk), 10 cut by the row start -> 10 + 15, 65
LAYER_CU = torch.tensor([0, 1, 70, 80, 95, 160], dtype=torch.int32)


def conv_case(kernel: int, dilation: int, with_left: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(kernel + dilation)
    batch, seq_len, channels = 2, 45, 24
    pos = document_positions(CONV_CU, batch, seq_len)
    if with_left:  # row 0's first document continues from the halo
        pos[0, :1] += 7
    x = torch.randn(batch, seq_len, channels, generator=gen, requires_grad=True)
    w = (torch.randn(channels, kernel, generator=gen) * 0.7).requires_grad_()
    left = None
    if with_left:
        left = torch.randn(batch, (kernel - 1) * dilation, channels, generator=gen)
        left.requires_grad_()
    dy = torch.randn(batch, seq_len, channels, generator=gen, dtype=torch.float64)
    leaves = [t for t in (x, w, left) if t is not None]
    y = causal_conv_silu_triton(x, w, left, dilation, pos.to(torch.int32))
    got = [y, *torch.autograd.grad(y, leaves, dy.float())]
    up = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = conv_per_document(up[0], up[1], up[2] if with_left else None, dilation, pos)
    want = [y_ref, *torch.autograd.grad(y_ref, up, dy)]
    return {n: rel_l2(a, b) for n, a, b in zip(("y", "dx", "dw", "d_left"), got, want)}


def layer_case() -> dict[str, float]:
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, num_key_heads=1, num_value_heads=2, head_k_dim=16,
                          head_v_dim=16, chunk_size=64, backend="triton", conv_backend="triton")
    slow_decay(layer)
    hidden = torch.randn(2, 80, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 80, dtype=torch.int64)
    mask[0, 40] = mask[1, 79] = 0
    return layer_packed_vs_alone(layer, reference_layer(layer), hidden, LAYER_CU, mask)


if __name__ == "__main__":
    result = {"conv_k4_d1_left": conv_case(4, 1, True), "conv_k3_d2": conv_case(3, 2, False),
              "layer_triton_triton": layer_case()}
    print("RESULT " + json.dumps(result))
