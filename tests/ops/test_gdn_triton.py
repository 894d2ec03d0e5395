"""Triton backend of GDN against the eager backend / float64 reference.

On the CPU the kernels run under the Triton interpreter: the cases run in one child process with
``TRITON_INTERPRET=1`` (triton reads it when the kernels are first imported, so setting it here
would leak into every later test file and could not be undone). The cases live in
``tests.support.gdn_triton_cases``: small sizes (T <= 264), output, final state, dH0 and every
input gradient; each test asserts its own case's result. On a CUDA machine the full-size check
at the end also runs (it is the test that catches Hopper miscompiles of the backward,
gpu/README.md).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.support.case_groups import GroupedCases
from tests.support.gdn import children_fixture, make_inputs, rel_l2
from overlap_runtime.ops.gdn import chunk_gated_delta_rule

pytestmark = pytest.mark.triton

NAMES = ("q", "k", "v", "g", "beta")

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed")


_CASE_OF_TEST = {"test_interpreter_nan_stays_in_its_chunk": "nan_fp32",
                 "test_interpreter_capability_errors_name_the_rule": "capability_errors"}
# one child per worker runs a group of the cases (tests.support.case_groups), each test
# asserting its own case's result; the costs (CPU seconds of each case in a group child,
# measured) balance two groups
_CASES = GroupedCases("gdn_triton_cases", timeout_s=480,
                      cost={"summaries": 10, "gates_fp32": 11, "gates_bf16": 10, "nan_fp32": 12.6,
                            "bf16_segments": 10, "fp32_one_segment": 7, "fp32_segments": 6,
                            "fp32_norm_in_kernel": 6, "capability_errors": 0.5})

_interpreter_children = children_fixture(_CASES, _CASE_OF_TEST)


def _run_case(case: str) -> dict:
    return _CASES.result(case)


@needs_triton
@pytest.mark.parametrize("case", ["fp32_one_segment", "fp32_segments", "bf16_segments",
                                  "fp32_norm_in_kernel", "summaries"])
def test_interpreter_matches_reference(case):
    result = _run_case(case)
    errors, tol = result["errors"], result["tolerance"]
    assert result["finite"]
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"rel-L2 above {tol}: {bad} (all: {errors})"


@needs_triton
@pytest.mark.parametrize("case", ["gates_fp32", "gates_bf16"])
def test_interpreter_exact_for_extreme_gates(case):
    """g = -inf / -1e38 / -1e4 at chunk starts, middles, ends, the first and last tokens, two
    and eight in a chunk, -12 over the partial last chunk (issue #28 item 1), each pattern in
    its own chunk of one sequence, with one segment and with two: finite, within the usual
    tolerance of the float64 recurrence (each tensor, and each value head alone), forward and
    backward; dg = 0 at a floored gate (below -20), as the reference's."""
    result = _run_case(case)
    errors, tol = result["errors"], result["tolerance"]
    # per pattern: rel-L2 of its chunk's rows (reported, not bounded: a chunk whose gradients
    # are ~0 in the reference has a large relative error of no size)
    worst = sorted(result["pattern_errors"].items(), key=lambda kv: -kv[1])[:8]
    assert len(result["nonfinite"]) == 2 and not any(result["nonfinite"].values()), \
        f"non-finite output or gradient: {result['nonfinite']}"
    assert not result["nonzero_dg_at_resets"], \
        f"dg is not 0 at a floored gate: {result['nonzero_dg_at_resets']}"
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"rel-L2 above {tol}: {bad}; largest per pattern chunk: {worst}"


@needs_triton
def test_interpreter_nan_stays_in_its_chunk():
    """A NaN at token t: never hidden, and it reaches no earlier chunk (docs/gdn.md); the value
    head no NaN reaches stays finite and matches."""
    result = _run_case("nan_fp32")
    report = result["nan"]
    assert len(report) == 8, sorted(report)
    for case, r in report.items():
        assert r["covers_reference"], f"{case}: a NaN of the recurrence came out finite"
        assert r["within_chunk"], f"{case}: non-finite beyond t's chunk/columns: {r}"
        assert r["first_bad_row"] is not None, (case, r)
        assert r["first_bad_row"] >= int(case.split("@")[1]) // 64 * 64, (case, r)
        assert r["rel_l2_finite"] <= 1e-5, (case, r)
    for run, r in result["clean_heads"].items():
        assert r["finite"] and r["reference_finite"] and r["rel_l2"] <= 1e-5, (run, r)


@needs_triton
def test_interpreter_capability_errors_name_the_rule():
    raised = _run_case("capability_errors")["raised"]
    assert "head dim K=8" in raised["K=8"]
    assert "head dim V=48" in raised["V=48"]
    assert "chunk_size=32" in raised["chunk 32"]
    assert "torch.float64" in raised["q float64"]


def test_cpu_without_interpreter_fails_fast_naming_the_device():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    x = make_inputs(1, 64, 1, 1, 32, 32, dtype=torch.bfloat16, requires_grad=False)
    with pytest.raises(NotImplementedError, match="backend='triton'.*cpu.*TRITON_INTERPRET=1"):
        chunk_gated_delta_rule(*(x[n] for n in NAMES), backend="triton")
    with pytest.raises(NotImplementedError, match="g dtype torch.float64"):
        chunk_gated_delta_rule(*(x[n] for n in NAMES[:3]), x["g"].double(), x["beta"],
                               backend="triton")


@pytest.mark.parametrize("key_dim,value_dim", [(32, 128), (128, 16), (32, 32)])
def test_head_dims_below_64_are_refused_off_the_interpreter(key_dim, value_dim):
    """Head dims 16 / 32 (column blocks below 64) run only under the CPU interpreter: on any
    other device the error names the dim, the device and the rule (meta tensors stand in for a
    GPU here: the head-dim rule comes before the device rule)."""
    pytest.importorskip("triton")
    from overlap_runtime.ops.gdn.triton.capability import check_triton_inputs

    x = make_inputs(1, 64, 1, 1, key_dim, value_dim, dtype=torch.bfloat16, requires_grad=False)
    meta = {n: t.to("meta") for n, t in x.items()}
    name, dim = ("K", key_dim) if key_dim < 64 else ("V", value_dim)
    with pytest.raises(NotImplementedError,
                       match=rf"head dim {name}={dim} is not supported on meta: .*interpreter"):
        check_triton_inputs(*(meta[n] for n in NAMES), None, 64)
    ok = {n: t.to("meta") for n, t in make_inputs(1, 64, 1, 1, 64, 128, dtype=torch.bfloat16,
                                                   requires_grad=False).items()}
    with pytest.raises(NotImplementedError, match="device 'meta' is not supported"):
        check_triton_inputs(*(ok[n] for n in NAMES), None, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("key_dim,value_dim", [(64, 64), (64, 128), (128, 64)])
def test_gpu_head_dims_64_bf16_against_eager_fp32(key_dim, value_dim):
    """The supported head dims other than K = V = 128 (the benchmarks' size), full size on the
    GPU: never run there before this test."""
    torch.manual_seed(0)
    x = make_inputs(1, 1000, 4, 8, key_dim, value_dim, dtype=torch.bfloat16, decay_shift=0.0)
    tensors, errors = _gpu_against_eager_fp32(x, torch.device("cuda"))
    assert all(torch.isfinite(t).all() for t in tensors.values()), errors
    assert all(e < 1e-2 for e in errors.values()), errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq_len", [1000, 4096])
def test_gpu_full_size_bf16_against_eager_fp32(seq_len):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = make_inputs(1, seq_len, 4, 8, 128, 128, dtype=torch.bfloat16, decay_shift=0.0)
    tensors, errors = _gpu_against_eager_fp32(x, dev)
    assert all(e < 1e-2 for e in errors.values()), errors


def _gpu_against_eager_fp32(x: dict, dev: torch.device) -> tuple[dict, dict]:
    """Triton bf16 on ``dev`` vs eager fp32, forward + backward: (Triton's o, h and gradients,
    rel-L2 of each against eager)."""
    x = {n: t.detach().to(dev).requires_grad_() for n, t in x.items()}
    ref = {n: (t.detach().float() if n != "g" else t.detach()).requires_grad_()
           for n, t in x.items()}
    outs = {}
    for tag, inp, backend in (("tri", x, "triton"), ("ref", ref, "eager")):
        o, h = chunk_gated_delta_rule(*(inp[n] for n in NAMES), initial_state=inp["initial_state"],
                                      output_final_state=True, backend=backend)
        gen = torch.Generator(device=dev).manual_seed(1)
        do = torch.randn(o.shape, generator=gen, device=dev)
        dh = torch.randn(h.shape, generator=gen, device=dev)
        ((o.float() * do).sum() + (h * dh).sum()).backward()
        outs[tag] = (o, h)
    tensors = {"o": outs["tri"][0], "h": outs["tri"][1], **{"d" + n: x[n].grad for n in x}}
    errors = {"o": rel_l2(outs["tri"][0], outs["ref"][0]),
              "h": rel_l2(outs["tri"][1], outs["ref"][1])}
    errors.update({"d" + n: rel_l2(x[n].grad, ref[n].grad) for n in x})
    return tensors, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gate", [float("-inf"), -1e38, -1e4])
def test_gpu_extreme_gates_bf16_against_eager_fp32(gate):
    """Resets (#28 item 1) at a chunk start, middle and end and on the last token, full size on
    the GPU: every tensor finite and within 1e-2 of the fp32 eager backend."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    seq_len = 4096
    x = make_inputs(1, seq_len, 4, 8, 128, 128, dtype=torch.bfloat16, decay_shift=0.0)
    g = x["g"].detach().clone()
    for p in (0, 64, 100, 127, 2048 + 33, seq_len - 1):
        g[:, p, :4] = gate
    x["g"] = g
    tensors, errors = _gpu_against_eager_fp32(x, dev)
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values()), \
        {k: int((~torch.isfinite(t)).sum()) for k, t in tensors.items()}
    assert all(e < 1e-2 for e in errors.values()), errors
