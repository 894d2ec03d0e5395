"""The fused GDN forward (ops/gdn/triton/fused_fwd.py, ``fused_forward=True``).

On the CPU each case runs under the Triton interpreter in a child process (cases in
``tests.support.gdn_triton_fused_cases``, a group of them per child; why a child:
test_gdn_triton.py): dense and packed inputs,
value heads sharing key heads, with and without initial states and the l2 norm, one and
several scan segments, forward alone and forward + backward (the fused walk writes the
per-chunk states and v_new the backward reads), and extreme gates (forward alone), against the
float64 token recurrence; and the saved set against the kernel chain's.
On a CUDA machine a full-size bf16 check runs against the fp32 eager backend.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.case_groups import GroupedCases
from tests.support.gdn import children_fixture, make_inputs, rel_l2

pytestmark = pytest.mark.triton

NAMES = ("q", "k", "v", "g", "beta")

needs_triton = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed")

# one child per worker runs a group of the cases (tests.support.case_groups); the costs (CPU
# seconds of each case inside a group child, measured) balance two groups
_CASES = GroupedCases("gdn_triton_fused_cases", timeout_s=480,
                      cost={"fp32_packed": 12.3, "fp32_gqa": 4.2, "fp32_heads_no_state": 4.5,
                            "fp32_no_norm": 3.5, "bf16_gqa": 5.8, "gates_fp32": 2.8,
                            "errors": 0.1})
_CASE_OF_TEST = {"test_interpreter_fused_misuse_names_the_rule": "errors"}

_interpreter_children = children_fixture(_CASES, _CASE_OF_TEST)


@needs_triton
@pytest.mark.parametrize("case", ["fp32_gqa", "fp32_heads_no_state", "fp32_no_norm",
                                  "fp32_packed", "bf16_gqa", "gates_fp32"])
def test_interpreter_fused_forward_matches_recurrence(case):
    result = _CASES.result(case)
    errors, tol = result["errors"], result["tolerance"]
    assert result["finite"], "non-finite output or gradient"
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"rel-L2 above {tol}: {bad} (all: {errors})"


@needs_triton
@pytest.mark.parametrize("case", ["fp32_gqa", "fp32_heads_no_state", "fp32_no_norm",
                                  "fp32_packed", "bf16_gqa"])
def test_interpreter_fused_saved_set_matches_the_chain(case):
    """The fused forward with 2 segments saves what the chain saves: q, k, v, g, beta and the
    prep's q_rstd, k_rstd, gamma, Ainv, w bitwise in the same slots (the fused prep normalises
    q, k inside its kernels, with the norm kernel's operations); the walk's states, v_new,
    segment maps and o, the final state within the case's tolerance."""
    result = _CASES.result(case)
    assert result["prep_unequal"] == [], f"not bitwise the chain's: {result['prep_unequal']}"
    tol, errors = result["tolerance"], result["vs_chain"]
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"rel-L2 against the chain above {tol}: {bad} (all: {errors})"


@needs_triton
def test_interpreter_fused_misuse_names_the_rule():
    raised = _CASES.result("errors")["raised"]
    assert "FusedConfig.block=24 must divide K=32" in raised["block"]
    assert "needs fused=True" in raised["chain_no_save"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_fused_forward_full_size_bf16_against_eager_fp32(packed):
    """B = 1, T = 4K (dense) or 8 documents of 256..4K tokens (packed), H = 4 / HV = 8,
    K = V = 128, bf16 with initial states: the fused forward alone and the fused forward's
    gradients against the fp32 eager backend, every tensor within rel-L2 1e-2 and finite."""
    from overlap_runtime.ops.gdn import chunk_gated_delta_rule
    from overlap_runtime.ops.gdn.triton.function import chunk_gated_delta_rule_triton

    dev = torch.device("cuda")
    lengths = (256, 4096, 1000, 300, 2065, 700, 3333, 517) if packed else (4096,)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    heads, value_heads, dim = 4, 8, 128
    x = make_inputs(1, offsets[-1], heads, value_heads, dim, dim, dtype=torch.bfloat16,
                    seed=0, decay_shift=0.0)
    x["initial_state"] = make_inputs(len(lengths), 1, 1, value_heads, dim, dim,
                                     dtype=torch.bfloat16, seed=1)["initial_state"]
    tri = {n: t.detach().to(dev).requires_grad_() for n, t in x.items()}
    ref = {n: t.detach().to(dev).float().requires_grad_() for n, t in x.items()}
    gen = torch.Generator(device=dev).manual_seed(2)
    do = torch.randn(1, offsets[-1], value_heads, dim, generator=gen, device=dev)
    dh = torch.randn(len(lengths), value_heads, dim, dim, generator=gen, device=dev)
    cu = torch.tensor(offsets, dtype=torch.int32, device=dev) if packed else None

    def ours():
        return chunk_gated_delta_rule_triton(*(tri[n] for n in NAMES), dim ** -0.5,
                                             tri["initial_state"], True, None, cu_seqlens=cu,
                                             fused_forward=True)

    with torch.no_grad():
        o_alone, h_alone = ours()
    o, h = ours()
    ((o.float() * do).sum() + (h * dh).sum()).backward()
    o_ref, h_ref = chunk_gated_delta_rule(*(ref[n] for n in NAMES),
                                          initial_state=ref["initial_state"],
                                          output_final_state=True, cu_seqlens=cu,
                                          backend="eager")
    ((o_ref * do).sum() + (h_ref * dh).sum()).backward()
    tensors = {"o_alone": o_alone, "h_alone": h_alone, "o": o, "h": h,
               **{"d" + n: tri[n].grad for n in tri}}
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    errors = {"o_alone": rel_l2(o_alone, o_ref), "h_alone": rel_l2(h_alone, h_ref),
              "o": rel_l2(o, o_ref), "h": rel_l2(h, h_ref)}
    errors.update({"d" + n: rel_l2(tri[n].grad, ref[n].grad) for n in tri})
    assert all(e < 1e-2 for e in errors.values()), errors
