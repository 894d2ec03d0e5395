"""Extreme gates (issue #28 item 1): any ``g <= 0``, including ``-inf`` (a state reset), is exact.

The chunked form once used differences of in-chunk cumulative gate sums, ``exp(G_i - G_j)``: one
large gate made them cancel (``g = -1e38`` in float64 gave rel-L2 0.4 against the recurrence, no
NaN; ``g = -1e4`` in fp32 gave 1.2e-4) and ``g = -inf`` gave ``-inf - -inf = NaN`` (192 NaN rows).
The gate sums are now direct sums (chunk.gate_sums). Every test compares the eager backend with
the float64 token-by-token recurrence, forward and backward, with the extreme gate at chunk
starts, middles and ends (C = 64).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.gdn import loss_of, make_inputs, output_grads, rel_l2, upcast
from overlap_runtime.ops.gdn import (
    apply_summary,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    state_summary,
)
from overlap_runtime.ops.gdn.chunk import gate_sums

NAMES = ("q", "k", "v", "g", "beta")
# chunk start, middle, end; start of the sequence; two resets in one chunk; the last token
POSITIONS = {"start": (64,), "middle": (100,), "end": (127,), "first": (0,),
             "two_in_a_chunk": (70, 120), "last": (199,)}
GATES = {"-inf": float("-inf"), "-1e38": -1e38, "-1e4": -1e4, "-80": -80.0}
# measured after the fix (T=200, K=V=16): float64 <= 5.1e-16, fp32 <= 2.5e-7 for every figure
TOL = {torch.float64: 1e-12, torch.float32: 3e-6}


def _inputs(dtype: torch.dtype, gate: float, positions: tuple[int, ...], seq_len: int = 200):
    x = make_inputs(1, seq_len, 2, 4, 16, 16, dtype=dtype, seed=11)
    g = x["g"].detach().clone()
    for p in positions:
        g[:, p, :2] = gate  # two of the four value heads reset; the others keep their gates
    x["g"] = g.requires_grad_()
    return x


def _errors(x: dict[str, torch.Tensor]) -> dict[str, float]:
    ref = upcast(x)
    o_ref, h_ref = recurrent_gated_delta_rule(*(ref[n] for n in NAMES),
                                              initial_state=ref["initial_state"])
    o, h = chunk_gated_delta_rule(*(x[n] for n in NAMES), initial_state=x["initial_state"],
                                  output_final_state=True, backend="eager")
    do, dh = output_grads(o_ref, h_ref)
    loss_of(o_ref, h_ref, do, dh).backward()
    loss_of(o, h, do, dh).backward()
    errors = {"o": rel_l2(o, o_ref), "final_state": rel_l2(h, h_ref)}
    for name in NAMES + ("initial_state",):
        grad = x[name].grad
        assert torch.isfinite(grad).all(), f"d{name} is not finite"
        errors["d" + name] = rel_l2(grad, ref[name].grad)
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    return errors


@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_eager_is_exact_for_extreme_gates(dtype, gate, where):
    errors = _errors(_inputs(dtype, GATES[gate], POSITIONS[where]))
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, f"g={gate} at {POSITIONS[where]}: rel-L2 above {TOL[dtype]:.0e}: {bad}"


def test_a_reset_gives_a_zero_gate_gradient_where_the_reference_does():
    """At ``g = -inf`` the state is multiplied by exp(-inf) = 0: d loss / d g_t is exactly 0."""
    x = _inputs(torch.float64, float("-inf"), (64, 100))
    _errors(x)
    dg = x["g"].grad[0]
    assert torch.equal(dg[[64, 100], :2], torch.zeros(2, 2, dtype=torch.float64))
    assert (dg[[64, 100], 2:] != 0).all()  # the heads without a reset keep a real gradient


@pytest.mark.parametrize("gate", ["-inf", "-1e38"])
def test_summary_of_a_segment_with_resets(gate):
    """``H_out = M H_in + S`` with resets inside: M forgets everything before the last reset."""
    x = _inputs(torch.float64, GATES[gate], (64, 100), seq_len=130)
    x = {n: t.detach() for n, t in x.items()}
    m, s = state_summary(*(x[n] for n in NAMES))
    assert torch.isfinite(m).all() and torch.isfinite(s).all()
    _, h_ref = recurrent_gated_delta_rule(*(x[n] for n in NAMES),
                                          initial_state=x["initial_state"])
    assert rel_l2(apply_summary(m, s, x["initial_state"]), h_ref) <= 1e-12
    _, h_zero = recurrent_gated_delta_rule(*(x[n] for n in NAMES))
    assert rel_l2(s, h_zero) <= 1e-12
    # the reset heads' M is 0 exactly: no path from H_in survives a reset
    assert torch.equal(m[:, :2], torch.zeros_like(m[:, :2]))


def test_gate_sums_are_direct_sums():
    g = torch.tensor([[-1.0, float("-inf"), -2.0, -1e38, -0.5]], dtype=torch.float64)
    gamma, tail, pair = gate_sums(g)
    n = g.shape[-1]
    for i in range(n):
        for j in range(n):
            expect = g[0, j + 1:i + 1].sum() if i >= j else torch.tensor(float("-inf"))
            assert pair[0, i, j].item() == expect.item(), (i, j)
        assert tail[0, i].item() == g[0, i + 1:].sum().item()
    assert torch.equal(gamma, g.cumsum(-1))
    assert not torch.isnan(pair).any() and not torch.isnan(tail).any()


# ----------------------------------------------------------------------------- NaN containment
# (issue #28 item 2, op part). A NaN in v, k, beta or g at token t makes the recurrence's state,
# hence its outputs from t on, NaN (in the heads it reaches); a NaN in q only o_t. The eager
# chunked form once made every row from the start of t's chunk NaN (0 * NaN through the masked
# products); now its non-finite rows are exactly the recurrence's, and the others match it.


def _plant_nan(x: dict[str, torch.Tensor], name: str, where: int) -> None:
    target = "v" if name == "v_one" else name
    t = x[target].clone()
    if name in ("q", "k"):
        t[:, where, 1, 3] = float("nan")  # key head 1 (value heads 2 and 3), one element
    elif name == "v_one":
        t[:, where, 2, 5] = float("nan")  # one value column of head 2: only that column
    else:
        t[:, where, 2] = float("nan")  # value head 2 only
    x[target] = t


@pytest.mark.parametrize("name", ["v", "v_one", "k", "beta", "g", "q"])
@pytest.mark.parametrize("where", [64, 100, 127, 130])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_eager_nan_touches_only_what_the_recurrence_does(dtype, where, name):
    x = make_inputs(1, 200, 2, 4, 16, 16, dtype=dtype, seed=13, requires_grad=False)
    _plant_nan(x, name, where)
    o, h = chunk_gated_delta_rule(*(x[n] for n in NAMES), initial_state=x["initial_state"],
                                  output_final_state=True, backend="eager")
    o_ref, h_ref = recurrent_gated_delta_rule(*(upcast(x)[n] for n in NAMES),
                                              initial_state=x["initial_state"].double())
    bad, bad_ref = ~torch.isfinite(o), ~torch.isfinite(o_ref)
    if not torch.equal(bad, bad_ref):
        first = bad.nonzero()[0].tolist(), bad_ref.nonzero()[0].tolist()
        raise AssertionError(f"non-finite entries differ: {int(bad.sum())} in eager (first "
                             f"[b, t, hv, c] {first[0]}), {int(bad_ref.sum())} in the reference "
                             f"(first {first[1]})")
    assert bad_ref.any()
    assert torch.equal(~torch.isfinite(h), ~torch.isfinite(h_ref))
    fine = ~bad_ref
    assert rel_l2(o[fine], o_ref[fine]) <= TOL[dtype]
