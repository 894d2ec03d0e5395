"""Cases of tests/ops/test_gdn_triton_memory.py, run as ``python -m tests.support.gdn_triton_memory_cases
CASE`` in a child process with ``TRITON_INTERPRET=1`` (as tests/support/gdn_triton_cases.py, for the same
reason). Prints one JSON object per case.

``all``, per config: what the autograd Function keeps for backward (``grad_fn.saved_tensors``)
with and without ``recompute_w``, found by content against the forward's own normalised q, k,
u and w (``prepare``), and its bytes against what the forward kept before (those as well); the
backward's recomputed w (from the raw keys, normalised in the kernel) against the forward's own,
bitwise; the output, the
final state and every gradient with ``recompute_w`` against without, bitwise; both against the
float64 eager backend (rel-L2). ``prepare`` (the forward's first kernels: l2norm, kkt_solve,
wy_fwd) runs once per config: both forwards get clones of the explicit call's outputs, their
arguments being the same bits (``SharedPrepare``, tests/support/gdn_triton_cases.py); the
backward's recomputation runs its own kernels.
"""

from __future__ import annotations

import json
import sys

import torch

from tests.support.interpreter import require_interpreter  # noqa: E402

require_interpreter()
torch.set_num_threads(1)

from tests.support.gdn import make_inputs, rel_l2, upcast  # noqa: E402
from overlap_runtime.ops.gdn import GDNKernelOptions, chunk_gated_delta_rule  # noqa: E402
from overlap_runtime.ops.gdn.triton import function as fn  # noqa: E402
from tests.support.gdn_triton_cases import SharedPrepare  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta")
STATE = "initial_state"

# (T, H, HV, K, V, num_segments, l2norm, lengths or None), fp32 (bitwise comparisons and the
# 1e-5 bound of the other fp32 interpreter cases); lengths: packed sequences (cu_seqlens).
CONFIGS = {
    "gqa_norm_chained": (130, 1, 2, 32, 16, 2, True, None),
    "varlen_gqa_norm": (200, 1, 2, 32, 16, 2, True, (1, 63, 65, 71)),
}
TOLERANCE = 1e-5


def _inputs(config: str) -> tuple[dict, torch.Tensor | None]:
    seq_len, heads, value_heads, key_dim, value_dim, _, l2, lengths = CONFIGS[config]
    x = make_inputs(1, seq_len, heads, value_heads, key_dim, value_dim, dtype=torch.float32,
                    seed=3, decay_shift=3.0)
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x[STATE] = make_inputs(len(lengths), 1, 1, value_heads, key_dim, value_dim,
                               dtype=torch.float32, seed=4)[STATE]
    if not l2:  # unnormalised keys of norm ~sqrt(K) make (I + A) ill conditioned: pre-normalise
        for name in ("q", "k"):
            raw = x[name].detach().double()
            x[name] = (raw / raw.norm(dim=-1, keepdim=True)).float().requires_grad_()
    return x, cu


def _run(x: dict, cu: torch.Tensor | None, config: str, backend: str,
         recompute_w: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, _, _, _, segments, l2, _ = CONFIGS[config]
    options = (GDNKernelOptions(num_segments=segments, recompute_w=recompute_w)
               if backend == "triton" else None)
    return chunk_gated_delta_rule(*(x[n] for n in NAMES), initial_state=x[STATE],
                                  output_final_state=True, use_qk_l2norm=l2, backend=backend,
                                  cu_seqlens=cu, options=options)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _saved_report(kept: tuple, x: dict, prep: dict, l2: bool) -> dict:
    """What ``kept`` (``grad_fn.saved_tensors``) holds, found by content (shapes may coincide:
    q and w when H == HV): the raw inputs, the tensors the forward no longer saves, bytes."""
    kept = [t for t in kept if t is not None]

    def count(ref: torch.Tensor) -> int:
        return sum(1 for t in kept if t.shape == ref.shape and torch.equal(t, ref))

    total = sum(_nbytes(t) for t in kept)
    return {
        "q_k_inputs": sum(1 for t in kept if t.data_ptr() in (x["q"].data_ptr(),
                                                               x["k"].data_ptr())),
        # the normalised copies (q, k themselves without the norm), u, w: 0, 0, 0, 0 or 1
        "qn": count(prep["qn"]) if l2 else 0, "kn": count(prep["kn"]) if l2 else 0,
        "u": count(prep["u"]), "w": count(prep["w"]),
        "rstd": sum(count(prep[n]) for n in ("q_rstd", "k_rstd")) if l2 else 0,
        "bytes": total,
        # the forward used to keep the normalised q, k, u and w as well
        "bytes_before": total + sum(_nbytes(prep[n]) for n in (("qn", "kn") if l2 else ()))
        + _nbytes(prep["u"]) + (0 if count(prep["w"]) else _nbytes(prep["w"])),
    }


def run_all() -> dict:
    report = {}
    for config, (*_, segments, l2, _lengths) in CONFIGS.items():
        x, cu = _inputs(config)
        layout = None if cu is None else fn._varlen(x["q"], x["v"], segments, None, cu)
        chunks = None if layout is None else layout.chunks
        # the forward's own normalised q, k (and 1/norm), w, u: both forwards get clones of
        # these (their prepare's arguments are the same bits: SharedPrepare)
        with SharedPrepare() as shared:
            with torch.no_grad():
                prep = fn.prepare(*(x[n].detach() for n in NAMES), l2, chunks)
            gen = torch.Generator().manual_seed(5)
            results, saved, same = {}, {}, {}
            for tag, backend, recompute_w in (("saved_w", "triton", False),
                                              ("recompute_w", "triton", True),
                                              ("ref", "eager", None)):
                inp = upcast(x) if backend == "eager" else {
                    n: t.detach().clone().requires_grad_() for n, t in x.items()}
                o, h = _run(inp, cu, config, backend, recompute_w)
                if backend == "triton":
                    kept = o.grad_fn.saved_tensors
                    saved[tag] = _saved_report(kept, inp, prep, l2)
                    if recompute_w:  # what the backward recomputes, against the forward's own
                        # (gdn_forward's saved order: q, k, v, g, beta, 1/norms, gamma, Ainv, w)
                        q, k, v, _, beta, q_rstd, k_rstd, gamma, ainv, w = kept[:10]
                        # (the backward reads the raw q, k and normalises its tiles itself)
                        w = fn._recompute_w(k, v, beta, k_rstd, gamma, ainv, chunks)
                        same = {"w": torch.equal(w, prep["w"])}
                    del kept
                if tag == "saved_w":
                    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
                    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64)
                ((o.double() * do).sum() + (h.double() * dh).sum()).backward()
                results[tag] = {"o": o.detach(), "h": h.detach(),
                                **{"d" + n: inp[n].grad for n in NAMES + (STATE,)}}
        assert (shared.runs, shared.reused) == (1, 2), (config, shared.runs, shared.reused)
        bitwise = {n: torch.equal(results["saved_w"][n], results["recompute_w"][n])
                   for n in results["ref"]}
        errors = {f"{tag}/{n}": rel_l2(results[tag][n], results["ref"][n])
                  for tag in ("saved_w", "recompute_w") for n in results["ref"]}
        report[config] = {"saved": saved, "recomputed_equal": same, "bitwise": bitwise,
                          "errors": errors, "l2norm": l2}
    return {"configs": report, "tolerance": TOLERANCE}


if __name__ == "__main__":
    assert sys.argv[1] == "all", f"unknown case {sys.argv[1]!r} (one case: all)"
    print("RESULT " + json.dumps(run_all()))
