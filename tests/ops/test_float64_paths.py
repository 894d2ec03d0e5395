"""float64 means float64: every public GDN op, given float64 inputs, computes and returns float64
(outputs, final states and every gradient) and agrees with its own packed (``cu_seqlens``) or
native (recurrent reference, composed summaries) path at 1e-12.

Tolerance: float64's unit roundoff is u = 2^-53 = 1.1e-16. The paths compared here sum the same
terms in other orders over T = 130 tokens (three chunks of 64) with K = 8: a relative error of
order T * K * u = 1.2e-13 at worst, under 1e-12. One float32 rounding anywhere in a path (u =
6e-8) leaves at least 1e-9, four orders above it: the bound tells float64 from a path that is
"partly fp32".
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from overlap_runtime.ops.gdn import (apply_summary, chunk_gated_delta_rule, compose,
                                     recurrent_gated_delta_rule, state_summary)
from overlap_runtime.ops.gdn import fla_compat
from overlap_runtime.testing import rel_l2

TOL = 1e-12
B, T, H, HV, K, V = 2, 130, 2, 4, 8, 6
F64 = torch.float64


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    return {"q": randn(B, T, H, K), "k": F.normalize(randn(B, T, H, K), dim=-1),
            "v": randn(B, T, HV, V), "g": -0.5 * torch.rand(B, T, HV, generator=gen, dtype=F64),
            "beta": torch.rand(B, T, HV, generator=gen, dtype=F64), "h0": randn(B, HV, K, V),
            "do": randn(B, T, HV, V), "dht": randn(B, HV, K, V),
            "A_log": randn(HV), "dt_bias": randn(HV)}


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[1, B*T, ...]``: the B sequences back to back."""
    return x.reshape(1, B * T, *x.shape[2:])


_CU = torch.tensor([0, T, 2 * T])


def _run(op: Callable[..., tuple[torch.Tensor, torch.Tensor]], packed: bool,
         leaves: tuple[str, ...] = ("q", "k", "v", "g", "beta", "h0"),
         **kwargs: Any) -> dict[str, torch.Tensor]:
    """``op`` forward and backward (loss ``<o, do> + <ht, dht>``) on fresh leaves; returns the
    output, final state and each leaf's gradient, all ``[B, T, ...]``-shaped."""
    x = _inputs()
    grads = {n: x[n].clone().requires_grad_() for n in leaves}
    t = {**x, **grads}
    seq = [t[n] for n in ("q", "k", "v", "g", "beta")]
    gate = kwargs.pop("_gate", ())
    extra = {n: t[n] for n in ("A_log", "dt_bias") if n in gate}
    if packed:
        o, ht = op(*map(_packed, seq), initial_state=t["h0"], output_final_state=True,
                   cu_seqlens=_CU, **extra, **kwargs)
        o = o.reshape(B, T, HV, V)
    else:
        o, ht = op(*seq, initial_state=t["h0"], output_final_state=True, **extra, **kwargs)
    ((o * x["do"]).sum() + (ht * x["dht"]).sum()).backward()
    return {"o": o, "ht": ht, **{f"d{n}": g.grad for n, g in grads.items()}}


def _assert_float64_and_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                              what: str) -> None:
    for name, ref_value in ref.items():
        assert got[name].dtype == F64 and ref_value.dtype == F64, \
            (what, name, got[name].dtype, ref_value.dtype)
        err = rel_l2(got[name], ref_value)
        assert err <= TOL, f"{what}: {name} rel L2 {err:.2e} > {TOL}"


def test_chunk_gated_delta_rule_float64_dense_packed_and_recurrent_agree() -> None:
    dense = _run(chunk_gated_delta_rule, False, backend="eager", use_qk_l2norm=False)
    packed = _run(chunk_gated_delta_rule, True, backend="eager", use_qk_l2norm=False)
    _assert_float64_and_close(packed, dense, "ops.gdn.chunk_gated_delta_rule packed vs dense")
    recurrent = _run(lambda *a, output_final_state, **kw: recurrent_gated_delta_rule(*a, **kw),
                     False, use_qk_l2norm=False)
    _assert_float64_and_close(dense, recurrent, "chunked vs recurrent reference")


@pytest.mark.parametrize("options", [
    {},
    {"use_qk_l2norm_in_kernel": True},
    {"use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
    {"use_gate_in_kernel": True, "_gate": ("A_log", "dt_bias")},
    {"chunk_size": 32},
], ids=["plain", "l2norm", "beta_sigmoid", "gate_in_kernel", "chunk32"])
def test_fla_drop_in_keeps_float64_end_to_end(options: dict[str, Any]) -> None:
    """fla_compat.chunk_gated_delta_rule (eager, dense, initial state, final state returned):
    float64 throughout and equal to its cu_seqlens path and to ops.gdn's own function."""
    leaves = ("q", "k", "v", "g", "beta", "h0") + tuple(options.get("_gate", ()))
    call = dict(options, backend="eager")
    dense = _run(fla_compat.chunk_gated_delta_rule, False, leaves, **dict(call))
    packed = _run(fla_compat.chunk_gated_delta_rule, True, leaves, **dict(call))
    _assert_float64_and_close(packed, dense, f"fla drop-in packed vs dense {options}")
    if not options.get("use_gate_in_kernel") and not options.get("use_beta_sigmoid_in_kernel"):
        native = _run(chunk_gated_delta_rule, False, backend="eager",
                      use_qk_l2norm=bool(options.get("use_qk_l2norm_in_kernel")),
                      chunk_size=options.get("chunk_size", 64))
        _assert_float64_and_close(dense, native, f"fla drop-in vs ops.gdn {options}")


def test_fla_drop_in_state_v_first_keeps_float64() -> None:
    x = _inputs()
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    _, ht = fla_compat.chunk_gated_delta_rule(*args, initial_state=x["h0"].transpose(-1, -2),
                                              output_final_state=True, state_v_first=True,
                                              backend="eager")
    _, ref = chunk_gated_delta_rule(*args, initial_state=x["h0"], output_final_state=True,
                                    use_qk_l2norm=False, backend="eager")
    assert ht.dtype == F64 and rel_l2(ht.transpose(-1, -2), ref) <= TOL


def test_fla_drop_in_keeps_the_float32_state_of_lower_precisions() -> None:
    """fla's convention stands for float32 and bfloat16 inputs: the final state is float32."""
    x = _inputs()
    for dtype in (torch.float32, torch.bfloat16):
        args = [x[n].to(dtype) for n in ("q", "k", "v", "beta")]
        o, ht = fla_compat.chunk_gated_delta_rule(args[0], args[1], args[2], x["g"].float(),
                                                  args[3], initial_state=x["h0"].float(),
                                                  output_final_state=True, backend="eager")
        assert o.dtype == dtype and ht.dtype == torch.float32


def test_state_summaries_float64_compose_to_the_chunked_final_state() -> None:
    """state_summary / compose / apply_summary (the CP building blocks) in float64: the summary
    of the whole sequence, and the composition of its two halves' summaries, applied to the
    initial state, give the chunked op's final state; gradients flow in float64."""
    x = _inputs()
    leaves = {n: x[n].clone().requires_grad_() for n in ("k", "v", "g", "beta")}
    t = {**x, **leaves}
    seq = [t[n] for n in ("q", "k", "v", "g", "beta")]
    _, ht = chunk_gated_delta_rule(*[s.detach() for s in seq], initial_state=x["h0"],
                                   output_final_state=True, use_qk_l2norm=False)
    m, s = state_summary(*seq, use_qk_l2norm=False)
    assert m.dtype == s.dtype == F64
    whole = apply_summary(m, s, x["h0"])
    assert whole.dtype == F64 and rel_l2(whole, ht) <= TOL
    cut = 64  # a chunk boundary: each half is prepared on its own
    first = state_summary(*[a[:, :cut] for a in seq], use_qk_l2norm=False)
    second = state_summary(*[a[:, cut:] for a in seq], use_qk_l2norm=False)
    halves = apply_summary(*compose(second, first), x["h0"])
    assert rel_l2(halves, ht) <= TOL
    (whole * x["dht"]).sum().backward()
    assert all(leaf.grad is not None and leaf.grad.dtype == F64 for leaf in leaves.values())
