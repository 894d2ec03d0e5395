"""Packed variable-length sequences (``cu_seqlens``) in the Triton GDN kernels (issue #22 item 1).

On the CPU each case runs under the Triton interpreter in a child process (cases in
``tests.support.gdn_triton_varlen_cases``, a group of them per child; why a child:
test_gdn_triton.py): lengths shorter than a chunk,
equal to it, one past it, empty, with and without initial states, with and without the l2 norm,
value heads sharing key heads, one scan segment per sequence and chained segments, against the
float64 recurrence run on each sequence alone: output, final states and every gradient. On a
CUDA machine a full-size bf16 check runs against the fp32 eager backend per sequence.
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
_CASES = GroupedCases("gdn_triton_varlen_cases",
                      cost={"fp32_gqa_state": 5.1, "fp32_chained_no_state_no_norm": 6.1,
                            "fp32_norm_in_kernel_chained": 6.1, "bf16_gqa_state": 6.3,
                            "one_sequence_is_dense": 3.4, "errors": 0.1})
_CASE_OF_TEST = {"test_interpreter_one_sequence_is_the_dense_path_bit_for_bit":
                 "one_sequence_is_dense", "test_interpreter_varlen_errors_name_the_value": "errors"}


_interpreter_children = children_fixture(_CASES, _CASE_OF_TEST)


def _run_case(case: str) -> dict:
    return _CASES.result(case)


@needs_triton
@pytest.mark.parametrize("case", ["fp32_gqa_state", "fp32_chained_no_state_no_norm",
                                  "fp32_norm_in_kernel_chained", "bf16_gqa_state"])
def test_interpreter_varlen_matches_per_sequence_recurrence(case):
    result = _run_case(case)
    errors, tol = result["errors"], result["tolerance"]
    assert result["finite"], "non-finite output or gradient"
    assert result["dtypes"][1] == "torch.float32"
    assert result["shapes"]["final_state"][0] == result["num_seqs"], result["shapes"]
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"rel-L2 above {tol}: {bad} (all: {errors})"


@needs_triton
def test_interpreter_one_sequence_is_the_dense_path_bit_for_bit():
    equal = _run_case("one_sequence_is_dense")["equal"]
    assert all(equal.values()), f"cu_seqlens=[0, T] differs from the dense path: {equal}"


@needs_triton
def test_interpreter_varlen_errors_name_the_value():
    raised = _run_case("errors")["raised"]
    assert "B=2" in raised["B=2"]
    assert "T=64" in raised["ends at 60"] and "[0, 60]" in raised["ends at 60"]
    assert "[0, 40, 30, 64]" in raised["decreasing"]
    assert "torch.float32" in raised["float offsets"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_varlen_full_size_bf16_against_eager_fp32_per_sequence():
    """8 sequences of 256..4K tokens (most not multiples of 64), H = HV = 4, K = V = 128, bf16
    with initial states, against the fp32 eager backend run on each sequence alone: every
    tensor within rel-L2 1e-2 and finite (catches a Hopper miscompile of the backward too)."""
    from overlap_runtime.ops.gdn import chunk_gated_delta_rule
    from overlap_runtime.ops.gdn.triton.function import chunk_gated_delta_rule_triton

    dev = torch.device("cuda")
    lengths = (256, 4096, 1000, 300, 2065, 700, 3333, 517)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    num_seqs, heads, dim = len(lengths), 4, 128
    x = make_inputs(1, offsets[-1], heads, heads, dim, dim, dtype=torch.bfloat16, seed=0,
                    decay_shift=0.0)
    x["initial_state"] = make_inputs(num_seqs, 1, 1, heads, dim, dim, dtype=torch.bfloat16,
                                     seed=1)["initial_state"]
    tri = {n: t.detach().to(dev).requires_grad_() for n, t in x.items()}
    ref = {n: t.detach().to(dev).float().requires_grad_() for n, t in x.items()}
    gen = torch.Generator(device=dev).manual_seed(2)
    do = torch.randn(1, offsets[-1], heads, dim, generator=gen, device=dev)
    dh = torch.randn(num_seqs, heads, dim, dim, generator=gen, device=dev)
    cu = torch.tensor(offsets, dtype=torch.int32, device=dev)
    o, h = chunk_gated_delta_rule_triton(*(tri[n] for n in NAMES), dim ** -0.5,
                                         tri["initial_state"], True, None, cu_seqlens=cu)
    ((o.float() * do).sum() + (h * dh).sum()).backward()
    outs, finals = [], []
    for i in range(num_seqs):
        a, b = offsets[i], offsets[i + 1]
        oi, hi = chunk_gated_delta_rule(*(ref[n][:, a:b] for n in NAMES),
                                        initial_state=ref["initial_state"][i:i + 1],
                                        output_final_state=True, backend="eager")
        outs.append(oi)
        finals.append(hi)
    o_ref, h_ref = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    ((o_ref * do).sum() + (h_ref * dh).sum()).backward()
    tensors = {"o": o, "h": h, **{"d" + n: tri[n].grad for n in tri}}
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())
    errors = {"o": rel_l2(o, o_ref), "h": rel_l2(h, h_ref)}
    errors.update({"d" + n: rel_l2(tri[n].grad, ref[n].grad) for n in tri})
    assert all(e < 1e-2 for e in errors.values()), errors
