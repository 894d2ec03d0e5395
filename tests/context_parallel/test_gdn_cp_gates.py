"""GDN context parallelism with hostile values: NaN in padded slots, extreme gates.

* NaN / inf hidden states at padded positions (mask 0) under CP2 (p2p, ulysses, all_gather):
  the gathered output, the input gradient and every parameter gradient (summed over the ranks)
  are exactly those of the same sequence with zeros there (the layer's masks select, they do
  not multiply; the p2p halo and the ulysses all-to-all carry the masked values). And a NaN at
  one real token reaches every later row of its sequence and nothing before it.
* Extreme gates (a reset ``g = -inf`` and ``g = -1e38``) just before a rank boundary, on it and
  inside a shard, on 2 and 4 ranks in float64, every mode (eager): output and every gradient
  against the float64 recurrence within 1e-10 (measured <= 1.4e-15). The local op is exact on
  its own (tests/ops/test_gdn_gates.py); this checks what CP adds: the p2p chain and the
  all_gather prefix compose of the summaries (``M = 0`` after a reset on a rank's last token),
  the ulysses all-to-all and the conv halo. With the chunk summaries' ``Ktail`` formed from a gate
  difference (``exp(gamma_C - gamma_j)``) while the local op stays exact, p2p and all_gather fail
  it (NaN) and ulysses passes.

Workers run on real gloo ranks (``overlap_runtime.testing.run_ranks``) and return figures; the
tests assert on them here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.gdn_cp import HEAD_DIM, HIDDEN, KEY_HEADS, VALUE_HEADS, _cp_run, make_inputs, make_module
from torch.distributed.device_mesh import init_device_mesh

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.layers import GatedDeltaNet, GDNProjections
from overlap_runtime.ops.gdn import recurrent_gated_delta_rule
from overlap_runtime.testing import rel_l2, run_ranks

# -- NaN in padded slots -----------------------------------------------------------------------

NAN_LOCAL = 70  # two partial chunks per rank


def _nan_pads(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``(x with zeros at the pads, x with NaN / inf there, mask, loss weights)``, B = 2.

    Row 0: pads at the end of rank 0's shard and across the rank-0/1 boundary (the p2p halo
    carries them), in the middle of rank 1 and at the end; row 1: left padding (rank 0 holds
    nothing else).
    """
    seq = world * NAN_LOCAL
    x, w = make_inputs(2, seq, seed=11)
    keep = torch.ones(2, seq, dtype=torch.bool)
    keep[0, NAN_LOCAL - 4 : NAN_LOCAL + 6] = False
    keep[0, NAN_LOCAL + 30] = False
    keep[0, seq - 9 :] = False
    keep[1, : NAN_LOCAL + 3] = False
    pad = ~keep[..., None]
    poison = torch.full_like(x, float("nan"))
    poison[1, :4] = float("inf")
    poison[1, 4:8] = -float("inf")
    return (torch.where(pad, 0.0, x), torch.where(pad, poison, x), keep.to(torch.float32), w)


def _cp_run_forward(module: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, rank: int,
                    world: int) -> torch.Tensor:
    """Forward only: this rank's shard through the CP module, gathered to the full sequence."""
    import torch.distributed as dist

    local = x.shape[1] // world
    sl = slice(rank * local, (rank + 1) * local)
    y = module(x[:, sl].contiguous(), attention_mask=mask[:, sl].contiguous())
    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=1)


def _nan_worker(rank: int, world: int, mode: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    cp = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(make_module()), mesh)
    x_zero, x_bad, mask, w = _nan_pads(world)
    y0, dx0, g0 = _cp_run(cp, x_zero, w, mask, rank, world, False)
    y1, dx1, g1 = _cp_run(cp, x_bad, w, mask, rank, world, False)
    # A NaN at one real token t (row 0, on rank 1) reaches every row of row 0 from t on and
    # nothing before t or in row 1 (forward; docs/gdn.md "What a NaN may touch").
    t = NAN_LOCAL + 40
    x_real = x_zero.clone()
    x_real[0, t, 3] = float("nan")
    with torch.no_grad():
        y2 = _cp_run_forward(cp, x_real, mask, rank, world)
    nan_rows = (~torch.isfinite(y2[0])).any(-1)
    return {
        "real_nan_rows_before_t_equal": torch.equal(y2[0, :t], y0[0, :t]),
        "real_nan_rows_from_t_all_nan": bool(nan_rows[t:][mask[0, t:] != 0].all()),
        "real_nan_other_row_equal": torch.equal(y2[1], y0[1]),
        "zeros_finite": bool(torch.isfinite(y0).all() and torch.isfinite(dx0).all()),
        "out_equal": torch.equal(y1, y0),
        "nonfinite_rows": int((~torch.isfinite(y1)).any(-1).sum()),
        "rows": y1.shape[0] * y1.shape[1],
        "dx_equal": torch.equal(dx1, dx0),
        "param_grads_differ": sorted(n for n in g0 if not torch.equal(g1[n], g0[n])),
    }


@pytest.mark.parametrize("mode", ["p2p", "ulysses", "all_gather"])
def test_nan_in_padded_slots_cp2(mode: str) -> None:
    results = run_ranks(_nan_worker, 2, args=(mode,))
    for rank, res in enumerate(results):
        what = f"mode={mode} cp=2 rank={rank}: {res}"
        assert res["real_nan_rows_before_t_equal"], what
        assert res["real_nan_rows_from_t_all_nan"], what
        assert res["real_nan_other_row_equal"], what
        assert res["zeros_finite"], what
        assert res["out_equal"] and res["nonfinite_rows"] == 0, what
        assert res["dx_equal"], what
        assert res["param_grads_differ"] == [], what


# -- extreme gates across ranks ----------------------------------------------------------------

GATE_TOL = 1e-10
GATE_LOCAL = 80  # a full 64-token chunk and a partial one per rank


class _GateProbe(GatedDeltaNet):
    """The layer with pass-through gates (``g = a``, ``beta = b``), so the test sets ``g``
    exactly (``-inf``, ``-1e38``); the conv, its CP halo and every CP mode's path are the
    layer's own."""

    def gates(self, a: torch.Tensor, b: torch.Tensor, value_heads: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert mask is None
        return a, b


def _gate_positions(world: int, local: int) -> dict[str, list[int]]:
    """Where the extremes go: just before every rank boundary (the last token of rank r - 1,
    so that rank's summary has ``M = 0`` after a reset), on the boundary (a rank's first
    token), and inside shards (mid-chunk, a chunk's last and first token)."""
    bounds = [r * local for r in range(1, world)]
    return {
        "before_boundary": [b - 1 for b in bounds],
        "on_boundary": bounds,
        "inside": [r * local + d for r in range(world) for d in (30, 63, 64) if r * local + d > 0],
    }


def _gate_case(world: int, local: int, seed: int) -> dict[str, torch.Tensor]:
    """Float64 global inputs of the mixer (B = 2, 4 value heads) with slow decay elsewhere.

    Heads 0 / 1: ``-inf`` / ``-1e38`` just before every rank boundary; head 2: ``-inf`` inside
    the shards and ``-1e38`` on the boundaries; head 3: ordinary gates only. Row 1 swaps
    ``-inf`` and ``-1e38``, and adds a reset on the very last token.
    """
    seq = world * local
    gen = torch.Generator().manual_seed(seed)
    conv_dim = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
    mixed = torch.randn(2, seq, conv_dim, generator=gen, dtype=torch.float64)
    g = -torch.empty(2, seq, VALUE_HEADS, dtype=torch.float64).uniform_(5e-4, 3e-2, generator=gen)
    beta = torch.rand(2, seq, VALUE_HEADS, generator=gen, dtype=torch.float64)
    do = torch.randn(2, seq, VALUE_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    pos = _gate_positions(world, local)
    inf, big = -float("inf"), -1e38
    for row, (x0, x1) in enumerate([(inf, big), (big, inf)]):
        g[row, pos["before_boundary"], 0] = x0
        g[row, pos["before_boundary"], 1] = x1
        g[row, pos["inside"], 2] = x0
        g[row, pos["on_boundary"], 2] = x1
    g[1, seq - 1, :3] = inf
    return {"mixed": mixed, "g": g, "beta": beta, "do": do}


def _gate_reference(layer: GatedDeltaNet, case: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 recurrence (``ops.gdn.reference``) after the single-device conv."""
    layer.zero_grad(set_to_none=True)
    mixed, g, beta = (case[n].clone().requires_grad_(True) for n in ("mixed", "g", "beta"))
    q, k, v = layer.split_qkv(layer.causal_conv(mixed))
    o, _ = recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    (o * case["do"]).sum().backward()
    return {"o": o.detach(), "d_mixed": mixed.grad, "dg": g.grad, "dbeta": beta.grad,
            "d_conv_weight": layer.conv1d.weight.grad.clone()}


def _gate_cp(layer: GatedDeltaNet, case: dict[str, torch.Tensor], rank: int, world: int
             ) -> dict[str, torch.Tensor]:
    """This rank's shard through the CP mixer (what the layer's forward calls), gathered."""
    import torch.distributed as dist

    def gather(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    local = case["mixed"].shape[1] // world
    sl = slice(rank * local, (rank + 1) * local)
    layer.zero_grad(set_to_none=True)
    mixed, g, beta = (case[n][:, sl].clone().requires_grad_(True) for n in ("mixed", "g", "beta"))
    proj = GDNProjections(mixed_qkv=mixed, z=None, b=beta, a=g)  # z: the layer's, unused here
    o = layer.sequence_mixer(layer, proj, None)
    (o * case["do"][:, sl]).sum().backward()
    dw = layer.conv1d.weight.grad.clone()
    dist.all_reduce(dw)  # each rank holds its share
    return {"o": gather(o.detach()), "d_mixed": gather(mixed.grad), "dg": gather(g.grad),
            "dbeta": gather(beta.grad), "d_conv_weight": dw}


def _gates_worker(rank: int, world: int, mode: str) -> dict[str, float]:
    """Worst rel-L2 (and max-abs error over the reference's max-abs) of each tensor."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref_layer = _GateProbe(HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM).double()
    cp_layer = LinearAttentionContextParallel(mode=mode).apply(copy.deepcopy(ref_layer), mesh)
    worst: dict[str, float] = {}
    for seed in (0, 1):
        case = _gate_case(world, GATE_LOCAL, seed)
        ref = _gate_reference(ref_layer, case)
        got = _gate_cp(cp_layer, case, rank, world)
        for name, r in ref.items():
            assert torch.isfinite(r).all(), f"reference {name} not finite"
            err = (got[name] - r).abs().max().item() / r.abs().max().item()
            for key, val in ((name, rel_l2(got[name], r)), (f"{name}:max", err)):
                val = val if val == val else float("inf")  # NaN -> inf, so it fails the bound
                worst[key] = max(worst.get(key, 0.0), val)
    return worst


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["p2p", "ulysses", "all_gather"])
def test_extreme_gates_across_ranks_float64(mode: str, cp: int) -> None:
    """Resets (``g = -inf``) and ``g = -1e38`` just before a rank boundary, on it and inside a
    shard: output and the gradients of the mixer's inputs (``mixed_qkv``, ``g``, ``beta``) and
    of the conv weight (summed over ranks) equal the float64 recurrence to 1e-10. This checks
    the CP state chain / summaries (``M = 0`` after a reset) and the conv halo; the local op is
    exact on its own (tests/ops/test_gdn_gates.py)."""
    results = run_ranks(_gates_worker, cp, args=(mode,))
    for rank, worst in enumerate(results):
        assert len(worst) == 10, worst
        bad = {k: v for k, v in worst.items() if not v <= GATE_TOL}
        assert not bad, f"mode={mode} cp={cp} rank={rank}: above {GATE_TOL:g}: {bad} (all: {worst})"
