"""Cases of tests/ops/test_gdn_triton.py, run as ``python -m tests.support.gdn_triton_cases CASE`` in a child
process with ``TRITON_INTERPRET=1`` (triton reads it when a kernel module is imported, so it
must be set before; a child keeps it out of the other test files). Prints one JSON object:
``{"errors": {name: rel-L2}, "tolerance": float}`` (or ``{"raised": ...}`` for the error cases).
"""

from __future__ import annotations

import json
import sys

import torch

from tests.support.interpreter import require_interpreter  # noqa: E402

require_interpreter()
torch.set_num_threads(1)

from tests.support.gdn import make_inputs, rel_l2, upcast  # noqa: E402
from overlap_runtime.ops.gdn import chunk_gated_delta_rule, summary  # noqa: E402
from overlap_runtime.ops.gdn.backend import TritonBackend  # noqa: E402
from overlap_runtime.ops.gdn.chunk import prepare_chunks  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")

# (T, H, HV, K, V, dtype, num_segments, initial_state, l2norm, tolerance)
# fp32 runs the same kernels with fp32 storage: it checks the algebra tightly. bf16 adds the
# storage roundings; the interpreter also truncates fp32 -> bf16 casts (round toward zero),
# about twice the GPU's rounding error, hence the looser bound here (the GPU script checks
# bf16 at 1e-2 at full size).
CASES = {
    "fp32_one_segment": (130, 2, 4, 32, 32, torch.float32, 1, True, True, 1e-5),
    "fp32_segments": (250, 1, 2, 32, 16, torch.float32, 3, False, False, 1e-5),
    "bf16_segments": (192, 2, 4, 64, 64, torch.bfloat16, 2, True, True, 4e-2),
    # one value head per key head: dk's l2norm backward runs inside the WY/KKT kernel
    "fp32_norm_in_kernel": (150, 2, 2, 32, 32, torch.float32, 2, True, True, 1e-5),
}


def forward_backward(case: str) -> dict:
    seq_len, heads, value_heads, key_dim, value_dim, dtype, segments, with_state, l2, tol = (
        CASES[case])
    x = make_inputs(1, seq_len, heads, value_heads, key_dim, value_dim, dtype=dtype, seed=3,
                    decay_shift=3.0)
    if not l2:  # unnormalised keys of norm ~sqrt(K) make (I + A) ill conditioned: pre-normalise
        for name in ("q", "k"):
            raw = x[name].detach().double()
            x[name] = (raw / raw.norm(dim=-1, keepdim=True)).to(dtype).requires_grad_()
    ref_x = upcast(x)  # the float64 eager backend is the reference
    state = "initial_state"
    kwargs = dict(output_final_state=True, use_qk_l2norm=l2)
    o_ref, h_ref = chunk_gated_delta_rule(*(ref_x[n] for n in NAMES), initial_state=(
        ref_x[state] if with_state else None), **kwargs)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h_ref.shape, generator=gen, dtype=torch.float64)
    ((o_ref * do).sum() + (h_ref * dh).sum()).backward()
    # through the registry contract: validate_inputs, check, forward
    backend = TritonBackend(num_segments=segments)
    inputs = [x[n] for n in NAMES]
    backend.check(*inputs, initial_state=x[state] if with_state else None, chunk_size=64)
    o, h = backend.forward(*inputs, scale=key_dim ** -0.5,
                           initial_state=x[state] if with_state else None, use_qk_l2norm=l2,
                           chunk_size=64)
    ((o.double() * do).sum() + (h.double() * dh).sum()).backward()
    errors = {"o": rel_l2(o, o_ref), "final_state": rel_l2(h, h_ref)}
    for name in NAMES + ((state,) if with_state else ()):
        errors["d" + name] = rel_l2(x[name].grad, ref_x[name].grad)
    finite = all(torch.isfinite(t).all().item() for t in
                 [o, h] + [x[n].grad for n in NAMES])
    return {"errors": errors, "tolerance": tol, "finite": finite,
            "dtypes": [str(o.dtype), str(h.dtype)]}


def summaries(case: str) -> dict:
    from overlap_runtime.ops.gdn import triton as tri

    x = make_inputs(2, 200, 1, 2, 32, 32, dtype=torch.float32, seed=4, requires_grad=False,
                    decay_shift=4.0, beta_max=0.2)
    x64 = {n: t.double() for n, t in x.items()}
    m_ref, s_ref = summary.state_summary(*(x64[n] for n in NAMES))
    errors = {}
    for ns in (1, 3):
        m, s = tri.state_summary(*(x[n] for n in NAMES), num_segments=ns)
        errors[f"M_ns{ns}"], errors[f"S_ns{ns}"] = rel_l2(m, m_ref), rel_l2(s, s_ref)
    gen = torch.Generator().manual_seed(6)
    h_in = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    errors["apply"] = rel_l2(tri.apply_summary(m_ref.float(), s_ref.float(), h_in.float()),
                             summary.apply_summary(m_ref, s_ref, h_in))
    errors["apply_backward"] = rel_l2(
        tri.apply_summary_backward(m_ref.float(), h_in.float(), s_ref.float()),
        summary.apply_summary_backward(m_ref, h_in, s_ref))
    m2, s2 = m_ref.flip(1), s_ref.flip(1)
    cm, cs = tri.compose((m2.float(), s2.float()), (m_ref.float(), s_ref.float()))
    rm, rs = summary.compose((m2, s2), (m_ref, s_ref))
    errors["compose_M"], errors["compose_S"] = rel_l2(cm, rm), rel_l2(cs, rs)
    prep = prepare_chunks(*(x64[n] for n in NAMES))
    ref_grad = summary.output_state_grad(prep, do)
    for ns in (1, 2):
        errors[f"dH_in_local_ns{ns}"] = rel_l2(
            tri.output_state_grad(*(x[n] for n in NAMES), do.float(), num_segments=ns),
            ref_grad)
    return {"errors": errors, "tolerance": 1e-5, "finite": True, "dtypes": [str(m.dtype)]}


# Extreme gates (issue #28 item 1): (name, gate, positions); T = 200 (chunks start at 0, 64,
# 128, 192), one of the two value heads reset (the other one not), against the float64
# recurrence. One key head and two value heads: the interpreter's time is per program.
GATE_CASES = [(f"{gname}@{where}", gate, pos)
              for gname, gate in (("-inf", float("-inf")), ("-1e38", -1e38), ("-1e4", -1e4))
              for where, pos in (("start", (64,)), ("middle", (100,)), ("end", (127,)),
                                 ("two_in_a_chunk", (70, 120)), ("first", (0,)),
                                 ("last", (199,)))]
# Not extreme, but the partial last chunk's gates sum to -96: padded tokens (gamma 0) once met
# exp(0 - gamma_j) = inf there, and inf * 0 = NaN reached dk, dv, dg.
GATE_CASES.append(("-12@partial_chunk", -12.0, tuple(range(192, 200))))
# Several resets in one chunk (every other token of 64..78): each floored gate adds 20 to |gamma|
# for the rest of the chunk, so the gaps after them cancel more (docs/gdn.md, "Extreme gates").
GATE_CASES.append(("-inf@8_in_a_chunk", float("-inf"), tuple(range(64, 80, 2))))
# measured fp32 (interpreter, gates floored at -20, fp32 gamma): one reset per chunk <= 7.2e-7
# (dg), <= 4.8e-7 for the rest; 8 in a chunk <= 2.1e-6. bf16: <= 1.8e-2.
GATE_TOL = {"fp32": 5e-6, "bf16": 4e-2}


def gates(case: str) -> dict:
    """``gates_fp32`` / ``gates_bf16``: every GATE_CASES entry, forward and backward, two
    segments (summaries and chain) for half of them."""
    from overlap_runtime.ops.gdn.reference import recurrent_gated_delta_rule

    dtype = torch.float32 if case == "gates_fp32" else torch.bfloat16
    errors, finite, zero_dg = {}, True, True
    # every gate below -20 is floored to -20 by the kernel: fp32 checks -inf and the finite
    # -1e4 (-1e38 takes the same path as -1e4), bf16 the -inf positions and the partial chunk
    # (the interpreter costs about 4 s per case: the suite's budget)
    # -1e4 takes the floored path of -inf in the kernel: two of its positions suffice
    cases = [c for c in GATE_CASES if not c[0].startswith("-1e38")
             and c[0] not in ("-1e4@end", "-1e4@two_in_a_chunk", "-1e4@first", "-1e4@last",
                              "-1e4@middle")] \
        if case == "gates_fp32" else [c for c in GATE_CASES if c[0] in (
            "-inf@start", "-inf@last", "-inf@8_in_a_chunk", "-12@partial_chunk")]
    for i, (name, gate, positions) in enumerate(cases):
        x = make_inputs(1, 200, 1, 2, 32, 32, dtype=dtype, seed=7, decay_shift=3.0)
        g = x["g"].detach().clone()
        for p in positions:
            g[:, p, :1] = gate
        x["g"] = g.requires_grad_()
        ref = upcast(x)
        o_ref, h_ref = recurrent_gated_delta_rule(*(ref[n] for n in NAMES),
                                                  initial_state=ref["initial_state"])
        gen = torch.Generator().manual_seed(5)
        do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
        dh = torch.randn(h_ref.shape, generator=gen, dtype=torch.float64)
        ((o_ref * do).sum() + (h_ref * dh).sum()).backward()
        backend = TritonBackend(num_segments=1 + i % 2)
        o, h = backend.forward(*(x[n] for n in NAMES), scale=32 ** -0.5,
                               initial_state=x["initial_state"], use_qk_l2norm=True,
                               chunk_size=64)
        ((o.double() * do).sum() + (h.double() * dh).sum()).backward()
        errors[f"{name} o"], errors[f"{name} final_state"] = rel_l2(o, o_ref), rel_l2(h, h_ref)
        for n in NAMES + ("initial_state",):
            errors[f"{name} d{n}"] = rel_l2(x[n].grad, ref[n].grad)
        tensors = [o, h] + [x[n].grad for n in NAMES + ("initial_state",)]
        finite = finite and all(torch.isfinite(t).all().item() for t in tensors)
        if gate == float("-inf"):  # the reference's gate gradient there is exactly 0
            zero_dg = zero_dg and all(
                (x["g"].grad[0, p, :1] == 0).all().item() for p in positions)
    return {"errors": errors, "tolerance": GATE_TOL[case.split("_")[1]], "finite": finite,
            "zero_dg_at_resets": zero_dg}


def nan_containment(case: str) -> dict:
    """``nan_fp32``: a NaN in one input at token t (forward). What the Triton op guarantees
    (docs/gdn.md): every entry the recurrence makes non-finite is non-finite; beyond those, only
    the rows of t's own chunk before t, in the columns the NaN reaches; the finite rest matches."""
    from overlap_runtime.ops.gdn.reference import recurrent_gated_delta_rule

    report = {}
    # every input at one of two positions (mid-chunk 100, early in the next chunk 130), each
    # position for half of the inputs: the interpreter costs about 2 s a case
    for i, (name, where) in enumerate([("v", 100), ("v_one", 130), ("k", 100), ("beta", 130),
                                       ("g", 100), ("q", 130), ("v", 130), ("g", 130)]):
        x = make_inputs(1, 200, 1, 2, 32, 32, dtype=torch.float32, seed=13, requires_grad=False)
        target = "v" if name == "v_one" else name
        t = x[target].clone()
        if name in ("q", "k"):
            t[:, where, 0, 3] = float("nan")
        elif name == "v_one":
            t[:, where, 1, 5] = float("nan")
        else:
            t[:, where, 1] = float("nan")
        x[target] = t
        o_ref, _ = recurrent_gated_delta_rule(*(x[n].double() for n in NAMES),
                                              initial_state=x["initial_state"].double())
        o, _ = TritonBackend(num_segments=1 + i % 2).forward(
            *(x[n] for n in NAMES), scale=32 ** -0.5, initial_state=x["initial_state"],
            use_qk_l2norm=True, chunk_size=64)
        bad, bad_ref = ~torch.isfinite(o), ~torch.isfinite(o_ref)
        start = where // 64 * 64
        allowed = bad_ref.clone()
        allowed[:, start:where] |= bad_ref.any(dim=1, keepdim=True)
        fine = ~bad
        report[f"{name}@{where}"] = {
            "covers_reference": bool((bad_ref <= bad).all()),
            "within_chunk": bool((bad <= allowed).all()),
            "first_bad_row": int(bad.any(-1).any(-1)[0].nonzero().min()),
            "rel_l2_finite": rel_l2(o[fine], o_ref[fine]),
        }
    return {"nan": report}


def capability_errors(case: str) -> dict:
    """The rules that need the interpreter to be on (device passes): each must raise."""
    x = make_inputs(1, 64, 1, 1, 32, 32, dtype=torch.bfloat16, requires_grad=False)
    raised = {}
    bad = {
        "K=8": dict(q=x["q"][..., :8], k=x["k"][..., :8]),
        "V=48": dict(v=torch.cat([x["v"], x["v"][..., :16]], -1)),
        "chunk 32": dict(chunk_size=32),
        "q float64": dict(q=x["q"].double(), k=x["k"].double(), v=x["v"].double()),
    }
    for name, override in bad.items():
        args = {n: x[n] for n in NAMES}
        args.update(override)
        try:
            chunk_gated_delta_rule(**args, backend="triton")
            raised[name] = "no error"
        except NotImplementedError as error:
            raised[name] = str(error)
    return {"raised": raised}


if __name__ == "__main__":
    name = sys.argv[1]
    if name in CASES:
        result = forward_backward(name)
    elif name == "summaries":
        result = summaries(name)
    elif name.startswith("gates_"):
        result = gates(name)
    elif name == "nan_fp32":
        result = nan_containment(name)
    else:
        result = capability_errors(name)
    print("RESULT " + json.dumps(result))
