"""GDN context parallelism with hostile values: NaN in padded slots, extreme gates.

* NaN / inf hidden states at padded positions (mask 0) under CP2 p2p and ulysses: the gathered
  output, the input gradient and every parameter gradient (summed over the ranks) are exactly
  those of the same sequence with zeros there (the layer's masks select, they do not multiply;
  the p2p halo and the ulysses all-to-all carry the masked values); all_gather too. And a NaN
  at one real token reaches every later row of its sequence and nothing before it.

Workers run on real gloo ranks (``overlap_runtime.testing.run_ranks``) and return figures; the
tests assert on them here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _gdn_cp_util import _cp_run, make_inputs, make_module
from torch.distributed.device_mesh import init_device_mesh

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.testing import run_ranks

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

