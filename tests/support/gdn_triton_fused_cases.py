"""Cases of tests/ops/test_gdn_triton_fused.py, run as ``python -m tests.support.gdn_triton_fused_cases
CASE [CASE ...]`` in a child process with ``TRITON_INTERPRET=1`` (as
tests/support/gdn_triton_cases.py, for the same reason; the test runs several cases in one child:
tests/support/case_groups.py). Prints one line per case,
``RESULT <case> {"errors": {name: rel-L2}, "tolerance": float, ...}``.

The fused forward (ops/gdn/triton/fused_fwd.py) against the float64 token recurrence (run per
sequence for packed inputs): without gradients (nothing saved: o and the final state) with one
and several scan segments (the summary mode and the chain); with gradients (the fused walk
writes the per-chunk states and v_new, the unchanged backward reads the saved set); its saved
set against the kernel chain's (the prep's tensors bit for bit: the fused prep normalises q, k
in its own kernels with the norm kernel's operations; the walk's states, v_new, segment maps,
o and the final state within the case's tolerance of the chain's); the
extreme gates of tests/support/gdn_triton_cases.py through the fused forward.
"""

from __future__ import annotations

import sys

import torch

from tests.support.interpreter import require_interpreter  # noqa: E402

require_interpreter()
torch.set_num_threads(1)

from tests.support.case_groups import run_cases  # noqa: E402
from tests.support.gdn import make_inputs, per_sequence_reference, rel_l2  # noqa: E402
from tests.support.gdn_triton_cases import (  # noqa: E402
    GATE_PATTERNS, GATE_T, GATE_TOL, SharedPrepare)
from overlap_runtime.ops.gdn.triton.function import (  # noqa: E402
    chunk_gated_delta_rule_triton, gdn_forward)
from overlap_runtime.ops.gdn.triton.fused_fwd import FusedConfig  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")
STATE = "initial_state"

# (lengths or None, T, H, HV, K, V, dtype, initial_state, l2norm, tolerance)
# lengths: packed sequences (B = 1, cu_seqlens); None: one dense sequence of T tokens.
# fp32 at the dense Triton cases' bound (1e-5), bf16 at theirs (4e-2, the interpreter truncates
# fp32 -> bf16 casts).
CASES = {
    # value heads sharing a key head; a partial last chunk
    "fp32_gqa": (None, 150, 1, 2, 16, 16, torch.float32, True, True, 1e-5),
    # one value head per key head (dk's norm backward inside wy_kkt_bwd), no initial state
    "fp32_heads_no_state": (None, 130, 2, 2, 32, 16, torch.float32, False, True, 1e-5),
    # no l2norm in the op (pre-normalised keys)
    "fp32_no_norm": (None, 100, 1, 2, 16, 32, torch.float32, True, False, 1e-5),
    # packed: shorter than a chunk, equal, one past, two chunks and a bit; an empty sequence
    "fp32_packed": ((1, 63, 0, 64, 65, 130), 0, 1, 2, 16, 16, torch.float32, True, True, 1e-5),
    "bf16_gqa": (None, 192, 1, 2, 32, 32, torch.bfloat16, True, True, 4e-2),
}


def _inputs(case: str) -> tuple[dict, torch.Tensor | None, list[int] | None]:
    lengths, seq_len, heads, value_heads, key_dim, value_dim, dtype, with_state, l2, _ = (
        CASES[case])
    offsets = None
    if lengths is not None:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        seq_len = offsets[-1]
    x = make_inputs(1, seq_len, heads, value_heads, key_dim, value_dim, dtype=dtype, seed=7,
                    decay_shift=3.0)
    if not l2:  # unnormalised keys make (I + A) ill conditioned: pre-normalise
        for name in ("q", "k"):
            raw = x[name].detach().double()
            x[name] = (raw / raw.norm(dim=-1, keepdim=True)).to(dtype).requires_grad_()
    states = 1 if offsets is None else len(offsets) - 1
    h0 = torch.randn(states, value_heads, key_dim, value_dim,
                     generator=torch.Generator().manual_seed(8))
    x[STATE] = h0.requires_grad_() if with_state else None
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    return x, cu, offsets


def _reference(x: dict, offsets: list[int] | None, l2: bool, do: torch.Tensor,
               dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """float64 recurrence per sequence: (o, final states, input gradients)."""
    ref = {n: (None if t is None else t.detach().double().requires_grad_())
           for n, t in x.items()}
    offsets = offsets or [0, x["q"].shape[1]]
    o_ref, h_ref = per_sequence_reference(ref, offsets, ref[STATE], l2, do, dh)
    grads = {"d" + n: t.grad for n, t in ref.items() if t is not None}
    return o_ref.detach(), h_ref.detach(), grads


# gdn_forward's saved tuple, in order; the first group comes from the prep launches
SAVED = ("q", "k", "v", "g", "beta", "q_rstd", "k_rstd", "gamma", "ainv", "w", "m_seg",
         "states", "v_new")
WALK_SAVED = ("m_seg", "states", "v_new")


def saved_vs_chain(saved: tuple, o: torch.Tensor, final: torch.Tensor,
                   inputs: list[torch.Tensor], h0: torch.Tensor | None, scale: float, l2: bool,
                   cu: torch.Tensor | None) -> tuple[list[str], dict[str, float]]:
    """A fused forward's ``saved`` set, o and final state (2 segments, w saved) against the
    kernel chain's on the same inputs: ``(names of the other saved tensors not bitwise equal
    or not both None, {"saved_<name>": rel-L2} of the walk's tensors, o and the final
    state)``."""
    chain = gdn_forward(*inputs, h0, scale, l2, 2, cu_seqlens=cu)
    unequal, errors = [], {}
    for name, a, b in zip(SAVED, saved, chain[2], strict=True):
        if name in WALK_SAVED and a is not None and b is not None:
            errors[f"saved_{name}"] = rel_l2(a, b)
        elif not ((a is None and b is None)
                  or (a is not None and b is not None and torch.equal(a, b))):
            unequal.append(name)
    errors["saved_o"], errors["saved_final"] = rel_l2(o, chain[0]), rel_l2(final, chain[1])
    return unequal, errors


def run_case(case: str) -> dict:
    tol, l2 = CASES[case][-1], CASES[case][-2]
    x, cu, offsets = _inputs(case)
    key_dim = x["q"].shape[3]
    gen = torch.Generator().manual_seed(9)
    num_states = 1 if offsets is None else len(offsets) - 1
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(num_states, x["v"].shape[2], key_dim, x["v"].shape[3], generator=gen,
                     dtype=torch.float64)
    o_ref, h_ref, g_ref = _reference(x, offsets, l2, do, dh)
    errors, finite = {}, True
    inputs = [x[n].detach() for n in NAMES]
    h0 = None if x[STATE] is None else x[STATE].detach()
    # The fused prep (function.prepare_fused: kkt_solve, wy_fwd) does not depend on the
    # segments, nor on the save flag but for Ainv's dtype: its kernels run once per Ainv dtype
    # (SharedPrepare), every later fused forward gets clones of that output (the chain's prep
    # runs once, for the saved set's comparison).
    with SharedPrepare() as shared:
        # forward alone (nothing saved): one segment and three (summaries + chain); with three
        # also two state columns blocks of 16 per program (FusedConfig.block)
        for segments, config in ((1, None), (3, None), (3, FusedConfig(block=16))):
            with torch.no_grad():
                o, h, saved, _ = gdn_forward(*inputs, h0, key_dim ** -0.5, l2, segments,
                                             cu_seqlens=cu, fused=True, save=False,
                                             fused_config=config)
            assert saved is None
            tag = f"ns{segments}" + ("_bv16" if config else "")
            errors[f"o_{tag}"], errors[f"final_{tag}"] = rel_l2(o, o_ref), rel_l2(h, h_ref)
            finite &= bool(torch.isfinite(o).all() and torch.isfinite(h).all())
        # forward + backward through the autograd Function: the saved set (the walk's states and
        # v_new, the prep's tensors) read by the unchanged backward; with 2 segments and w saved,
        # that set against the kernel chain's
        for segments, recompute_w in ((1, True), (2, False)):
            leaves = {n: (None if t is None else t.detach().clone().requires_grad_())
                      for n, t in x.items()}
            o, h = chunk_gated_delta_rule_triton(*(leaves[n] for n in NAMES), key_dim ** -0.5,
                                                 leaves[STATE], l2, segments, cu_seqlens=cu,
                                                 recompute_w=recompute_w, fused_forward=True)
            if segments == 2:
                unequal, chain_errors = saved_vs_chain(o.grad_fn.saved_tensors, o.detach(),
                                                       h.detach(), inputs, h0, key_dim ** -0.5,
                                                       l2, cu)
            ((o.double() * do).sum() + (h.double() * dh).sum()).backward()
            tag = f"grad_ns{segments}"
            errors[f"o_{tag}"], errors[f"final_{tag}"] = rel_l2(o, o_ref), rel_l2(h, h_ref)
            for n, t in leaves.items():
                if t is not None:
                    errors[f"d{n}_{tag}"] = rel_l2(t.grad, g_ref["d" + n])
                    finite &= bool(torch.isfinite(t.grad).all())
    # the fused prep once, the chain's once (saved or not, Ainv is in k's dtype)
    assert (shared.runs, shared.reused) == (2, 4), (shared.runs, shared.reused)
    return {"errors": errors, "tolerance": tol, "finite": finite, "prep_unequal": unequal,
            "vs_chain": chain_errors}


def gates(case: str) -> dict:
    """``gates_fp32``: the extreme gate patterns of tests/support/gdn_triton_cases.py (-inf
    resets at chunk starts, middles and ends, several in a chunk, -1e38, -1e4, a partial last
    chunk summing to -96) in one sequence; the fused forward alone with one segment and with
    two against the float64 recurrence (the walks read the prep's floored gamma)."""
    from overlap_runtime.ops.gdn.reference import recurrent_gated_delta_rule

    x = make_inputs(1, GATE_T, 1, 3, 32, 32, dtype=torch.float32, seed=7, decay_shift=3.0,
                    requires_grad=False)
    for _, gate, head, positions in GATE_PATTERNS:
        x["g"][:, list(positions), head] = gate
    o_ref, h_ref = recurrent_gated_delta_rule(*(x[n].double() for n in NAMES),
                                              initial_state=x[STATE].double())
    errors, finite = {}, True
    with SharedPrepare() as shared:
        for segments in (1, 2):
            o, h, _, _ = gdn_forward(*(x[n] for n in NAMES), x[STATE], 32 ** -0.5, True,
                                     segments, fused=True, save=False)
            errors[f"o_ns{segments}"], errors[f"final_ns{segments}"] = (rel_l2(o, o_ref),
                                                                        rel_l2(h, h_ref))
            finite &= bool(torch.isfinite(o).all() and torch.isfinite(h).all())
    assert (shared.runs, shared.reused) == (1, 1), (shared.runs, shared.reused)
    return {"errors": errors, "tolerance": GATE_TOL["fp32"], "finite": finite}


def errors_name_the_rule(case: str) -> dict:
    """Misuse raises, naming the value and the rule."""
    x = make_inputs(1, 64, 1, 1, 32, 32, dtype=torch.float32, requires_grad=False)
    raised = {}
    try:
        gdn_forward(*(x[n] for n in NAMES), None, 0.25, True, None, fused=True, save=False,
                    fused_config=FusedConfig(block=24))
        raised["block"] = "no error"
    except ValueError as error:
        raised["block"] = str(error)
    try:
        gdn_forward(*(x[n] for n in NAMES), None, 0.25, True, None, save=False)
        raised["chain_no_save"] = "no error"
    except ValueError as error:
        raised["chain_no_save"] = str(error)
    return {"raised": raised}


def run(case: str) -> dict:
    if case in CASES:
        return run_case(case)
    return gates(case) if case == "gates_fp32" else errors_name_the_rule(case)


if __name__ == "__main__":
    run_cases(sys.argv[1:], run)
