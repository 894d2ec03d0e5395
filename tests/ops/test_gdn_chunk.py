"""Chunked eager gated delta rule against the float64 recurrent reference."""

from __future__ import annotations

import pytest
import torch

from tests.support.gdn import loss_of, make_inputs, output_grads, rel_l2, upcast
from overlap_runtime.ops.gdn import (
    EagerBackend,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

# (T, H, HV, K, V, memory): T=1000 only at small sizes to keep the suite fast on two cores.
# "short" forgets within a chunk or two and has beta up to 1 (stresses the triangular solve);
# "long" (weak decay, small beta) carries the state across many chunks (stresses the scan).
SHORT = {}
LONG = {"decay_shift": 4.0, "beta_max": 0.2}
CASES = [
    (1, 2, 4, 16, 8, SHORT),
    (63, 2, 4, 16, 8, SHORT),
    (64, 1, 1, 16, 8, SHORT),
    (65, 2, 4, 16, 8, SHORT),
    (130, 2, 2, 8, 16, LONG),
    (1000, 1, 2, 8, 8, SHORT),
    (1000, 1, 2, 8, 8, LONG),
]


def _reference(inputs, **kwargs):
    ref = upcast(inputs)
    o, state = recurrent_gated_delta_rule(
        ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"],
        initial_state=ref["initial_state"], **kwargs,
    )
    return ref, o, state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("seq_len,heads,value_heads,key_dim,value_dim,memory", CASES)
def test_chunked_matches_recurrent(dtype, seq_len, heads, value_heads, key_dim, value_dim, memory):
    inputs = make_inputs(2 if seq_len < 1000 else 1, seq_len, heads, value_heads, key_dim,
                         value_dim, dtype=dtype, **memory)
    ref, o_ref, state_ref = _reference(inputs)
    o, state = chunk_gated_delta_rule(
        *(inputs[n] for n in NAMES[:5]), initial_state=inputs["initial_state"],
        output_final_state=True,
    )
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert state.dtype == dtype and state.shape == state_ref.shape
    tol = TOL[dtype]
    assert rel_l2(o, o_ref) <= tol
    assert rel_l2(state, state_ref) <= tol

    do, dstate = output_grads(o_ref, state_ref)
    ref_grads = torch.autograd.grad(loss_of(o_ref, state_ref, do, dstate), [ref[n] for n in NAMES])
    grads = torch.autograd.grad(loss_of(o, state, do, dstate), [inputs[n] for n in NAMES])
    for name, grad, ref_grad in zip(NAMES, grads, ref_grads):
        assert grad.dtype == inputs[name].dtype
        err = rel_l2(grad, ref_grad)
        assert err <= tol, f"d{name}: rel-L2 {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_options_scale_l2norm_and_no_initial_state(use_qk_l2norm):
    inputs = make_inputs(1, 77, 2, 4, 8, 8, seed=3)
    inputs["initial_state"] = None
    args = [inputs[n] for n in NAMES[:5]]
    o_ref, state_ref = recurrent_gated_delta_rule(*args, scale=0.3, use_qk_l2norm=use_qk_l2norm)
    o, state = chunk_gated_delta_rule(*args, scale=0.3, output_final_state=True,
                                      use_qk_l2norm=use_qk_l2norm)
    assert rel_l2(o, o_ref) <= 1e-10 and rel_l2(state, state_ref) <= 1e-10
    do, dstate = output_grads(o_ref, state_ref)
    ref_grads = torch.autograd.grad(loss_of(o_ref, state_ref, do, dstate), args)
    grads = torch.autograd.grad(loss_of(o, state, do, dstate), args)
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_l2(grad, ref_grad) <= 1e-10
    o_only, none_state = chunk_gated_delta_rule(*args, scale=0.3, use_qk_l2norm=use_qk_l2norm)
    assert none_state is None
    assert rel_l2(o_only, o_ref) <= 1e-10


def test_default_scale_is_inverse_sqrt_key_dim():
    inputs = make_inputs(1, 20, 1, 1, 16, 4, requires_grad=False)
    args = [inputs[n] for n in NAMES[:5]]
    o_default, _ = chunk_gated_delta_rule(*args)
    o_explicit, _ = chunk_gated_delta_rule(*args, scale=0.25)
    o_other, _ = chunk_gated_delta_rule(*args, scale=0.5)
    assert rel_l2(o_default, o_explicit) <= 1e-14
    assert rel_l2(o_other, o_explicit) > 0.1


def test_grouped_values_use_key_head_j_div_group():
    """HV=4, H=2: value heads 0,1 read key head 0 and heads 2,3 key head 1."""
    inputs = make_inputs(1, 40, 2, 4, 8, 8, requires_grad=False)
    o, state = chunk_gated_delta_rule(*(inputs[n] for n in NAMES[:5]), output_final_state=True)
    for j in range(4):
        one_head = {n: inputs[n][:, :, j:j + 1] for n in ("v", "g", "beta")}
        o_j, state_j = recurrent_gated_delta_rule(
            inputs["q"][:, :, j // 2:j // 2 + 1], inputs["k"][:, :, j // 2:j // 2 + 1],
            one_head["v"], one_head["g"], one_head["beta"],
        )
        assert rel_l2(o[:, :, j:j + 1], o_j) <= 1e-10
        assert rel_l2(state[:, j:j + 1], state_j) <= 1e-10


@pytest.mark.parametrize("block_chunks", [1, 3, 100])
def test_recompute_block_size_does_not_change_gradients(block_chunks):
    inputs = make_inputs(1, 200, 1, 2, 8, 8, seed=5)
    ref, o_ref, state_ref = _reference(inputs)
    o, state = EagerBackend(block_chunks).forward(
        *(inputs[n] for n in NAMES[:5]), scale=8**-0.5, initial_state=inputs["initial_state"],
        use_qk_l2norm=True, chunk_size=16,
    )
    do, dstate = output_grads(o_ref, state_ref)
    ref_grads = torch.autograd.grad(loss_of(o_ref, state_ref, do, dstate), [ref[n] for n in NAMES])
    grads = torch.autograd.grad(loss_of(o, state, do, dstate), [inputs[n] for n in NAMES])
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_l2(grad, ref_grad) <= 1e-10


def test_backward_saves_only_inputs_and_block_boundary_states():
    batch, seq_len, value_heads, key_dim, value_dim, block_chunks = 1, 1000, 2, 8, 8, 4
    inputs = make_inputs(batch, seq_len, 1, value_heads, key_dim, value_dim)
    o, state = EagerBackend(block_chunks).forward(
        *(inputs[n] for n in NAMES[:5]), scale=1.0, initial_state=inputs["initial_state"],
        use_qk_l2norm=True, chunk_size=64,
    )
    node = o.grad_fn
    assert node is state.grad_fn and type(node).__name__ == "ChunkGatedDeltaRuleFunctionBackward"
    saved = [t for t in node.saved_tensors if t is not None]
    num_blocks = -(-seq_len // (64 * block_chunks))  # 4
    budget = sum(x.numel() for x in inputs.values()) + num_blocks * value_heads * key_dim * value_dim
    assert sum(t.numel() for t in saved) == budget
    # nothing of the forward graph hangs below the node besides the input leaves
    assert all(fn is None or type(fn).__name__ == "AccumulateGrad"
               for fn, _ in node.next_functions)


def test_half_precision_inputs_compute_in_fp32():
    inputs = make_inputs(1, 70, 2, 2, 16, 16, dtype=torch.bfloat16, requires_grad=False)
    o, state = chunk_gated_delta_rule(*(inputs[n] for n in NAMES[:5]),
                                      initial_state=inputs["initial_state"],
                                      output_final_state=True)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    _, o_ref, state_ref = _reference(inputs)
    assert rel_l2(o, o_ref) <= 1e-2  # bf16 rounding of the output only
    assert rel_l2(state, state_ref) <= 1e-5  # state never leaves fp32


def test_l2norm_gives_unit_rows():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    norms = l2norm(x).norm(dim=-1)
    expected = x.norm(dim=-1) / torch.sqrt(x.norm(dim=-1) ** 2 + 1e-6)
    assert torch.allclose(norms, expected, rtol=1e-14, atol=0)
    assert torch.equal(l2norm(torch.zeros(4, 8)), torch.zeros(4, 8))


def test_gradcheck_float64_small():
    inputs = make_inputs(1, 11, 1, 2, 3, 2, seed=7)
    args = tuple(inputs[n] for n in NAMES)

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True, chunk_size=2)  # 2 blocks

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)
