"""Affine state summaries (M, S): orientation, compose, chains of segments, state gradients."""

from __future__ import annotations

import pytest
import torch

from tests.support.gdn import loss_of, make_inputs, output_grads, rel_l2, upcast
from overlap_runtime.ops.gdn import (
    apply_summary,
    apply_summary_backward,
    chunk_gated_delta_rule,
    chunk_output,
    chunk_transitions,
    compose,
    l2norm,
    output_state_grad,
    prepare_chunks,
    recurrent_gated_delta_rule,
    state_summary,
    summarize,
    tree_compose,
)

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
LONG_MEMORY = {"decay_shift": 4.0, "beta_max": 0.2}  # keeps M @ H comparable to S


def _args(inputs, lo=0, hi=None):
    return [inputs[n][:, lo:hi] for n in NAMES[:5]]


def test_summary_is_the_product_of_per_token_transitions():
    """M = A_T ... A_1 with A_t = exp(g_t) (I - beta_t k_t k_t^T); S = run from zero."""
    inputs = make_inputs(1, 9, 1, 1, 4, 3, requires_grad=False, **LONG_MEMORY)
    m, s = state_summary(*_args(inputs), chunk_size=4)
    k = l2norm(inputs["k"])[0, :, 0]  # [T, K]
    g, beta = inputs["g"][0, :, 0], inputs["beta"][0, :, 0]
    expected = torch.eye(4, dtype=torch.float64)
    for t in range(9):
        a_t = g[t].exp() * (torch.eye(4, dtype=torch.float64) - beta[t] * torch.outer(k[t], k[t]))
        expected = a_t @ expected
    assert rel_l2(m[0, 0], expected) <= 1e-12
    _, s_ref = recurrent_gated_delta_rule(*_args(inputs))
    assert rel_l2(s, s_ref) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("seq_len", [1, 64, 65, 300])
def test_running_from_h_ends_in_m_h_plus_s(dtype, seq_len):
    inputs = make_inputs(2, seq_len, 2, 4, 8, 8, dtype=dtype, requires_grad=False, **LONG_MEMORY)
    m, s = state_summary(*_args(inputs))
    if seq_len <= 100:  # the check below must see the initial state
        assert rel_l2(m @ inputs["initial_state"], s) > 0.05
    assert m.dtype == dtype and m.shape == (2, 4, 8, 8) and s.shape == (2, 4, 8, 8)
    ref = upcast(inputs)
    _, state_ref = recurrent_gated_delta_rule(*_args(ref), initial_state=ref["initial_state"])
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_l2(apply_summary(m, s, inputs["initial_state"]), state_ref) <= tol


def test_summary_stays_fp32_for_bf16_inputs():
    inputs = make_inputs(1, 100, 1, 1, 8, 8, dtype=torch.bfloat16, requires_grad=False)
    m, s = state_summary(*_args(inputs))
    assert m.dtype == torch.float32 and s.dtype == torch.float32
    m_ref, s_ref = state_summary(*_args(upcast(inputs)))
    assert rel_l2(m, m_ref) <= 1e-5 and rel_l2(s, s_ref) <= 1e-5


def test_compose_is_associative_not_commutative():
    inputs = make_inputs(1, 150, 1, 2, 8, 8, requires_grad=False, **LONG_MEMORY)
    c0, c1, c2 = (state_summary(*_args(inputs, lo, lo + 50)) for lo in (0, 50, 100))
    left = compose(c2, compose(c1, c0))
    right = compose(compose(c2, c1), c0)
    whole = state_summary(*_args(inputs))
    for a, b, w in zip(left, right, whole):
        assert rel_l2(a, b) <= 1e-12
        assert rel_l2(a, w) <= 1e-10
    swapped = compose(c0, c1)
    assert rel_l2(swapped[1], compose(c1, c0)[1]) > 1e-3


@pytest.mark.parametrize("num_chunks", [1, 2, 5, 8, 13])
def test_tree_compose_equals_sequential_fold(num_chunks):
    gen = torch.Generator().manual_seed(num_chunks)
    m = torch.randn(2, num_chunks, 5, 5, generator=gen, dtype=torch.float64) / 2
    s = torch.randn(2, num_chunks, 5, 3, generator=gen, dtype=torch.float64)
    fold = (m[:, 0], s[:, 0])
    for n in range(1, num_chunks):
        fold = compose((m[:, n], s[:, n]), fold)
    tree = tree_compose(m, s)
    assert rel_l2(tree[0], fold[0]) <= 1e-12 and rel_l2(tree[1], fold[1]) <= 1e-12


@pytest.mark.parametrize("lean_output", [False, True], ids=["split", "lean"])
@pytest.mark.parametrize("bounds", [(0, 70, 134, 200), (0, 64, 128, 192, 200), (0, 1, 200)])
def test_chained_segments_reproduce_the_unsplit_run(bounds, lean_output):
    """prepare + summary per segment, chain H through apply, outputs after H arrives."""
    inputs = make_inputs(1, 200, 2, 4, 8, 8, seed=11, **LONG_MEMORY)
    ref = upcast(inputs)
    o_ref, state_ref = recurrent_gated_delta_rule(*_args(ref), initial_state=ref["initial_state"])

    h = inputs["initial_state"]
    outputs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        prep = prepare_chunks(*_args(inputs, lo, hi))  # before H_in arrives
        m, s = summarize(prep)  # before H_in arrives
        if lean_output:
            o_seg, _ = chunk_gated_delta_rule(*_args(inputs, lo, hi), initial_state=h)
        else:
            o_seg, _ = chunk_output(prep, h)  # after H_in arrives
        outputs.append(o_seg)
        h = apply_summary(m, s, h)  # H_out, sent on to the next segment
    o = torch.cat(outputs, dim=1)
    assert rel_l2(o, o_ref) <= 1e-10
    assert rel_l2(h, state_ref) <= 1e-10

    do, dstate = output_grads(o_ref, state_ref)
    ref_grads = torch.autograd.grad(loss_of(o_ref, state_ref, do, dstate), [ref[n] for n in NAMES])
    grads = torch.autograd.grad(loss_of(o, h, do, dstate), [inputs[n] for n in NAMES])
    for name, grad, ref_grad in zip(NAMES, grads, ref_grads):
        assert rel_l2(grad, ref_grad) <= 1e-10, name


def test_state_gradient_chain_dh_in_equals_mt_dh_out_plus_local():
    inputs = make_inputs(2, 60, 2, 4, 8, 6, seed=13, requires_grad=False, **LONG_MEMORY)
    h_in = inputs["initial_state"].clone().requires_grad_(True)
    prep = prepare_chunks(*_args(inputs), chunk_size=16)
    m, _ = summarize(prep)
    o, h_out = chunk_output(prep, h_in)
    do, dh_out = output_grads(o, h_out, seed=2)
    (dh_in_ref,) = torch.autograd.grad(loss_of(o, h_out, do, dh_out), h_in, retain_graph=True)
    dh_in_local = output_state_grad(prep, do)
    (dh_local_ref,) = torch.autograd.grad(loss_of(o, h_out, do, torch.zeros_like(dh_out)), h_in)
    assert rel_l2(dh_in_local, dh_local_ref) <= 1e-10
    assert rel_l2(apply_summary_backward(m, dh_out, dh_in_local), dh_in_ref) <= 1e-10
    assert rel_l2(apply_summary_backward(m, dh_out), dh_in_ref - dh_local_ref) <= 1e-10


def test_chunk_transitions_map_each_chunk_state():
    inputs = make_inputs(1, 100, 1, 1, 8, 8, requires_grad=False, **LONG_MEMORY)
    m, s = chunk_transitions(prepare_chunks(*_args(inputs), chunk_size=32))
    assert m.shape == (1, 1, 4, 8, 8) and s.shape == (1, 1, 4, 8, 8)
    h = inputs["initial_state"]
    for n, (lo, hi) in enumerate([(0, 32), (32, 64), (64, 96), (96, 100)]):
        _, h_next = recurrent_gated_delta_rule(*_args(inputs, lo, hi), initial_state=h)
        assert rel_l2(m[:, :, n] @ h + s[:, :, n], h_next) <= 1e-10
        h = h_next


def test_gradcheck_summary_float64_small():
    inputs = make_inputs(1, 7, 1, 2, 3, 2, seed=17)

    def fn(k, v, g, beta, h):
        m, s = state_summary(inputs["q"].detach(), k, v, g, beta, chunk_size=2)
        return apply_summary(m, s, h), m

    args = (inputs["k"], inputs["v"], inputs["g"], inputs["beta"], inputs["initial_state"])
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)
