"""Cases of tests/ops/test_gdn_triton_varlen.py, run as ``python -m tests.support.gdn_triton_varlen_cases
CASE [CASE ...]`` in a child process with ``TRITON_INTERPRET=1`` (as
tests/support/gdn_triton_cases.py, for the same reason; the test runs several cases in one child:
tests/support/case_groups.py). Prints one line per case,
``RESULT <case> {"errors": {name: rel-L2}, "tolerance": float, ...}``.

Every case packs sequences of the given lengths into ``B = 1`` and runs the Triton op with
``cu_seqlens`` forward and backward; the reference is the float64 token recurrence run on each
sequence alone from its own initial state (zeros without one).
"""

from __future__ import annotations

import sys

import torch

from tests.support.interpreter import require_interpreter  # noqa: E402

require_interpreter()
torch.set_num_threads(1)

from tests.support.case_groups import run_cases  # noqa: E402
from tests.support.gdn import make_inputs, per_sequence_reference, rel_l2, upcast  # noqa: E402
from overlap_runtime.ops.gdn.triton.function import chunk_gated_delta_rule_triton  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")
STATE = "initial_state"

# (lengths, H, HV, K, V, dtype, num_segments, initial_state, l2norm, cu_seqlens dtype, tolerance)
# fp32 at the bound of the dense fp32 cases of tests/support/gdn_triton_cases.py (1e-5), bf16 at theirs
# (4e-2: the interpreter truncates fp32 -> bf16 casts). num_segments 1: one scan segment per
# sequence (no summaries); 2 and 3: the longest sequences are cut into segments whose summaries
# are chained per sequence (and an empty sequence keeps its initial state).
CASES = {
    # value heads sharing a key head (H < HV): dk's norm backward after the sum over them
    "fp32_gqa_state": ((1, 63, 64, 65, 130), 1, 2, 16, 16, torch.float32, 1, True, True,
                       torch.int32, 1e-5),
    "fp32_chained_no_state_no_norm": ((130, 1, 64, 63, 65), 2, 2, 32, 16, torch.float32, 2,
                                      False, False, torch.int64, 1e-5),
    # H == HV with the norm: dk's norm backward inside the WY/KKT kernel; an empty sequence
    "fp32_norm_in_kernel_chained": ((65, 0, 200, 7), 2, 2, 16, 32, torch.float32, 3, True,
                                    True, torch.int64, 1e-5),
    "bf16_gqa_state": ((1, 63, 64, 65, 130), 1, 2, 32, 32, torch.bfloat16, 2, True, True,
                       torch.int32, 4e-2),
}


def _reference(x: dict, offsets: list[int], with_state: bool, l2: bool, do: torch.Tensor,
               dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-sequence float64 recurrence: (o, final states, input gradients)."""
    ref = upcast(x)
    o_ref, h_ref = per_sequence_reference(ref, offsets, ref[STATE] if with_state else None,
                                          l2, do, dh)
    return o_ref, h_ref, {n: ref[n].grad for n in NAMES + ((STATE,) if with_state else ())}


def forward_backward(case: str) -> dict:
    lengths, heads, value_heads, key_dim, value_dim, dtype, segments, with_state, l2, \
        offset_dtype, tol = CASES[case]
    seq_len, num_seqs = sum(lengths), len(lengths)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    x = make_inputs(1, seq_len, heads, value_heads, key_dim, value_dim, dtype=dtype, seed=3,
                    decay_shift=3.0)
    x[STATE] = make_inputs(num_seqs, 1, 1, value_heads, key_dim, value_dim, dtype=dtype,
                           seed=4)[STATE]
    if not l2:  # unnormalised keys of norm ~sqrt(K) make (I + A) ill conditioned: pre-normalise
        for name in ("q", "k"):
            raw = x[name].detach().double()
            x[name] = (raw / raw.norm(dim=-1, keepdim=True)).to(dtype).requires_grad_()
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, seq_len, value_heads, value_dim, generator=gen, dtype=torch.float64)
    dh = torch.randn(num_seqs, value_heads, key_dim, value_dim, generator=gen,
                     dtype=torch.float64)
    o_ref, h_ref, grads_ref = _reference(x, offsets, with_state, l2, do, dh)
    cu_seqlens = torch.tensor(offsets, dtype=offset_dtype)
    o, h = chunk_gated_delta_rule_triton(*(x[n] for n in NAMES), key_dim ** -0.5,
                                         x[STATE] if with_state else None, l2, segments,
                                         cu_seqlens=cu_seqlens)
    ((o.double() * do).sum() + (h.double() * dh).sum()).backward()
    errors = {"o": rel_l2(o, o_ref), "final_state": rel_l2(h, h_ref)}
    for name, grad in grads_ref.items():
        errors["d" + name] = rel_l2(x[name].grad, grad)
    tensors = [o, h] + [x[n].grad for n in grads_ref]
    return {"errors": errors, "tolerance": tol,
            "finite": all(bool(torch.isfinite(t).all()) for t in tensors),
            "shapes": {"o": list(o.shape), "final_state": list(h.shape)}, "num_seqs": num_seqs,
            "dtypes": [str(o.dtype), str(h.dtype)]}


def one_sequence_is_dense(case: str) -> dict:
    """``cu_seqlens = [0, T]`` runs the dense arithmetic: the same bits as no cu_seqlens
    (one segment; T = 130, a partial last chunk)."""
    x = make_inputs(1, 130, 1, 2, 16, 16, dtype=torch.float32, seed=9, decay_shift=3.0)
    runs = []
    for cu in (None, torch.tensor([0, 130], dtype=torch.int32)):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, h = chunk_gated_delta_rule_triton(*(leaves[n] for n in NAMES), 0.3, leaves[STATE],
                                             True, 1, cu_seqlens=cu)
        gen = torch.Generator().manual_seed(5)
        ((o * torch.randn(o.shape, generator=gen)).sum()
         + (h * torch.randn(h.shape, generator=gen)).sum()).backward()
        runs.append([o, h] + [leaves[n].grad for n in NAMES + (STATE,)])
    names = ["o", "final_state"] + ["d" + n for n in NAMES + (STATE,)]
    return {"equal": {n: bool(torch.equal(a, b)) for n, a, b in zip(names, *runs)}}


def errors_name_the_rule(case: str) -> dict:
    """B > 1 and malformed offsets raise, naming the value."""
    x = make_inputs(2, 64, 1, 1, 16, 16, dtype=torch.float32, requires_grad=False)
    one = {n: t[:1] for n, t in x.items()}
    bad = {
        "B=2": (x, torch.tensor([0, 64], dtype=torch.int32)),
        "ends at 60": (one, torch.tensor([0, 60], dtype=torch.int32)),
        "decreasing": (one, torch.tensor([0, 40, 30, 64], dtype=torch.int64)),
        "float offsets": (one, torch.tensor([0.0, 64.0])),
    }
    raised = {}
    for name, (inputs, cu) in bad.items():
        try:
            chunk_gated_delta_rule_triton(*(inputs[n] for n in NAMES), 0.25, None, True, None,
                                          cu_seqlens=cu)
            raised[name] = "no error"
        except ValueError as error:
            raised[name] = str(error)
    return {"raised": raised}


def run(case: str) -> dict:
    if case in CASES:
        return forward_backward(case)
    if case == "one_sequence_is_dense":
        return one_sequence_is_dense(case)
    return errors_name_the_rule(case)


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
