"""Packed variable-length sequences (``cu_seqlens``) on the eager backend, and their validation.

Each packed call is checked sequence by sequence against the float64 token recurrence run on
that sequence alone from its own initial state: outputs, final states and every gradient
(q, k, v, g, beta, initial_state), fp32 rel-L2 <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.gdn import make_inputs, rel_l2, upcast
from overlap_runtime.ops.gdn import (
    GDNKernelOptions,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    validate_inputs,
)

NAMES = ("q", "k", "v", "g", "beta")
H, HV, K, V = 2, 4, 8, 6


def packed_inputs(lengths: list[int], dtype: torch.dtype = torch.float32, seed: int = 0
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """B = 1 inputs of T = sum(lengths) tokens, an initial state per sequence, and cu_seqlens."""
    x = make_inputs(1, sum(lengths), H, HV, K, V, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x["initial_state"] = torch.randn(len(lengths), HV, K, V, generator=gen,
                                     dtype=torch.float64).to(x["g"].dtype).requires_grad_(True)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return x, offsets


def per_sequence_reference(x: dict[str, torch.Tensor], offsets: list[int], with_state: bool,
                           use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 recurrence on each sequence alone; ``(o [1, T, HV, V], final [N, HV, K, V])``."""
    outs, finals = [], []
    for n in range(len(offsets) - 1):
        s, e = offsets[n], offsets[n + 1]
        h0 = x["initial_state"][n:n + 1] if with_state else None
        if e == s:  # an empty sequence: no output, its final state is its initial state
            finals.append(h0[0] if with_state else x["v"].new_zeros(HV, K, V))
            continue
        o, h = recurrent_gated_delta_rule(*(x[m][:, s:e] for m in NAMES), initial_state=h0,
                                          use_qk_l2norm=use_qk_l2norm)
        outs.append(o)
        finals.append(h[0])
    return torch.cat(outs, dim=1), torch.stack(finals)


CASES = [
    # lengths (shorter than a chunk, not multiples of 64, empty, several blocks), block_chunks,
    # initial state, l2norm, chunk size
    ([5, 0, 64, 130, 1, 100], 1, True, True, 64),
    ([200, 0, 37], None, False, False, 64),
    ([0, 7, 0, 90], 2, True, False, 32),
]


@pytest.mark.parametrize("lengths, block_chunks, with_state, use_qk_l2norm, chunk_size", CASES)
def test_packed_matches_per_sequence_recurrence(lengths, block_chunks, with_state,
                                                use_qk_l2norm, chunk_size):
    x, cu_seqlens = packed_inputs(lengths)
    ref = upcast(x)
    wanted = list(NAMES) + (["initial_state"] if with_state else [])
    o, h = chunk_gated_delta_rule(
        *(x[n] for n in NAMES), initial_state=x["initial_state"] if with_state else None,
        output_final_state=True, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
        cu_seqlens=cu_seqlens.to(torch.int32), options=GDNKernelOptions(block_chunks=block_chunks),
    )
    assert o.shape == (1, sum(lengths), HV, V) and h.shape == (len(lengths), HV, K, V)
    assert o.dtype == torch.float32 and h.dtype == torch.float32
    o_ref, h_ref = per_sequence_reference(ref, cu_seqlens.tolist(), with_state, use_qk_l2norm)
    assert rel_l2(o, o_ref) <= 1e-5
    assert rel_l2(h, h_ref) <= 1e-5
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((o * do.float()).sum() + (h * dh.float()).sum(),
                                [x[n] for n in wanted])
    ref_grads = torch.autograd.grad((o_ref * do).sum() + (h_ref * dh).sum(),
                                    [ref[n] for n in wanted])
    for name, grad, ref_grad in zip(wanted, grads, ref_grads):
        assert rel_l2(grad, ref_grad) <= 1e-5, name


def test_one_sequence_equals_the_unpacked_call():
    x, _ = packed_inputs([150])
    args = [x[n] for n in NAMES]
    o, h = chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True,
                                  cu_seqlens=torch.tensor([0, 150]))
    o1, h1 = chunk_gated_delta_rule(*args, initial_state=x["initial_state"],
                                    output_final_state=True)
    assert torch.equal(o, o1) and torch.equal(h, h1)


def _valid():
    x, cu_seqlens = packed_inputs([3, 5])
    return [x[n].detach() for n in NAMES], x["initial_state"].detach(), cu_seqlens


@pytest.mark.parametrize("bad, error, match", [
    (lambda cu: cu.float(), TypeError, "cu_seqlens has dtype torch.float32; it must be int32"),
    (lambda cu: cu.tolist(), TypeError, "cu_seqlens must be a torch.Tensor, got list"),
    (lambda cu: cu[None], ValueError, r"cu_seqlens must be 1-D \[N \+ 1\].*\[1, 3\]"),
    (lambda cu: cu[:1], ValueError, r"N >= 1 sequences, got shape \[1\]"),
    (lambda cu: cu + 1, ValueError, r"must start at 0, got cu_seqlens\[0\]=1"),
    (lambda cu: torch.tensor([0, 3, 7]), ValueError, r"must end at T=8.*cu_seqlens\[-1\]=7"),
    (lambda cu: torch.tensor([0, 6, 3, 8]), ValueError,
     r"non-decreasing, got cu_seqlens\[1\]=6 > cu_seqlens\[2\]=3"),
])
def test_cu_seqlens_errors_name_the_rule(bad, error, match):
    args, _, cu_seqlens = _valid()
    with pytest.raises(error, match=match):
        chunk_gated_delta_rule(*args, cu_seqlens=bad(cu_seqlens))
    with pytest.raises(error, match=match):
        validate_inputs(*args, cu_seqlens=bad(cu_seqlens))


def test_cu_seqlens_needs_batch_one():
    x = make_inputs(2, 8, H, HV, K, V, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="cu_seqlens needs B == 1.*got B=2"):
        chunk_gated_delta_rule(*(x[n] for n in NAMES), cu_seqlens=torch.tensor([0, 3, 8]))


def test_initial_state_must_have_one_row_per_sequence():
    args, h0, cu_seqlens = _valid()
    match = r"initial_state must be \[N, HV, K, V\] .*= \[2, 4, 8, 6\], got \[1, 4, 8, 6\]"
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(*args, initial_state=h0[:1], cu_seqlens=cu_seqlens)
    chunk_gated_delta_rule(*args, initial_state=h0, cu_seqlens=cu_seqlens)  # the valid call runs
