"""Ranks that disagree on what they pass to a CP call get a named error on every rank.

Before the agreement check, a rank whose shard had another length, dtype, batch or head count
than its peers reached the first collective with a message of another size, and gloo killed
the process with SIGABRT ("Received data size doesn't match expected size"), or the call
silently went on with a wrong layout. Now every CP entry point (ring, Ulysses, all_gather_kv;
the GDN mixers of all three modes) gathers a few int64 describing its call on the CP group
before any other collective, and every rank raises the same ``ValueError`` naming every rank's
value. Each worker runs several disagreeing cases in a row: a later case only runs if no rank
was left waiting by an earlier one; then one agreeing call checks the group is still usable.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.support.cp import make_qkv
from tests.support.gdn_cp import HIDDEN, make_inputs, make_module
from overlap_runtime.context_parallel import (
    LinearAttentionContextParallel,
    all_gather_kv_attention,
    ring_attention,
    ulysses_attention,
)
from overlap_runtime.testing import RankFailedError, run_ranks

FUNCS: dict[str, Callable[..., torch.Tensor]] = {
    "ring_attention": ring_attention, "ulysses_attention": ulysses_attention,
    "all_gather_kv_attention": all_gather_kv_attention}


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def _attention_cases(rank: int) -> dict[str, tuple[dict[str, Any], str]]:
    """Per case: rank 1's deviation from (b=1, s=64 local, hq=4, hkv=2, d=8, float32, causal
    zigzag), and the expected message after the function's name."""
    return {
        "length": (dict(s=32), "the local sequence length: rank 0 has 64, rank 1 has 32"),
        "batch": (dict(b=2), "the batch size: rank 0 has 1, rank 1 has 2"),
        "kv_heads": (dict(hkv=4), "the key/value heads: rank 0 has 2, rank 1 has 4"),
        "head_dim": (dict(d=16), "the head dim: rank 0 has 8, rank 1 has 16"),
        "dtype": (dict(dtype=torch.float64),
                  "the dtype: rank 0 has torch.float32, rank 1 has torch.float64"),
        "causal": (dict(causal=False), "causal: rank 0 has True, rank 1 has False"),
        "load_balance": (dict(lb=None), "load_balance: rank 0 has 'zigzag', rank 1 has None"),
    }


def _attention_worker(rank: int, world: int, name: str) -> dict[str, str]:
    group = init_device_mesh("cpu", (world,)).get_group()
    fn = FUNCS[name]
    out = {}
    for case, (change, _) in _attention_cases(rank).items():
        cfg = dict(b=1, s=64, hq=4, hkv=2, d=8, dtype=torch.float32, causal=True, lb="zigzag")
        if rank == 1:
            cfg.update(change)
        q, k, v, _ = make_qkv(0, cfg["b"], cfg["s"], cfg["hq"], cfg["hkv"], cfg["d"],
                              cfg["dtype"])
        out[case] = _outcome(lambda: fn(q, k, v, group=group, causal=cfg["causal"],
                                        load_balance=cfg["lb"]))
    q, k, v, _ = make_qkv(0, 1, 64, 4, 2, 8)  # the group still works after the refusals
    out["agreeing call"] = str(tuple(fn(q, k, v, group=group).shape))
    return out


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_attention_ranks_disagreeing_raise_named_error_on_every_rank(name: str) -> None:
    results = run_ranks(_attention_worker, 2, args=(name,))
    for rank, res in enumerate(results):
        for case, (_, text) in _attention_cases(rank).items():
            want = f"ValueError: {name}: ranks disagree on {text} (cp group of 2)"
            assert res[case].startswith(want), f"rank {rank} {case}: {res[case]}"
        assert res["agreeing call"] == "(1, 64, 4, 8)", f"rank {rank}: {res['agreeing call']}"


def _uncaught_worker(rank: int, world: int) -> None:
    group = init_device_mesh("cpu", (world,)).get_group()
    q, k, v, _ = make_qkv(0, 1, 64 if rank == 0 else 32, 4, 2, 8)
    ring_attention(q, k, v, group=group)


def test_uncaught_disagreement_is_a_rank_error_not_a_crash() -> None:
    """The harness sees a rank raise (RankFailedError with the message), not a rank die."""
    with pytest.raises(RankFailedError) as info:
        run_ranks(_uncaught_worker, 2)
    text = str(info.value)
    assert "raised ValueError: ring_attention: ranks disagree on the local sequence length: " \
           "rank 0 has 64, rank 1 has 32 (cp group of 2)" in text, text
    assert "died" not in text and "signal" not in text, text


def _cp4_worker(rank: int, world: int) -> str:
    group = init_device_mesh("cpu", (world,)).get_group()
    q, k, v, _ = make_qkv(0, 1, 32 if rank == 2 else 64, 4, 4, 8)
    return _outcome(lambda: ulysses_attention(q, k, v, group=group))


def test_cp4_message_groups_ranks_by_value() -> None:
    for rank, res in enumerate(run_ranks(_cp4_worker, 4)):
        assert res == ("ValueError: ulysses_attention: ranks disagree on the local sequence "
                       "length: ranks 0, 1, 3 have 64, rank 2 has 32 (cp group of 4); also on "
                       "the shapes of q, k, v"), f"rank {rank}: {res}"


# --------------------------------------------------------------------------- GDN


GDN_CASES = {
    "length": (dict(local_len=32), "the local sequence length: rank 0 has 64, rank 1 has 32"),
    "batch": (dict(batch=2), "the batch size: rank 0 has 1, rank 1 has 2"),
    "dtype": (dict(dtype=torch.float64),
              "the dtype: rank 0 has torch.float32, rank 1 has torch.float64"),
    "mask": (dict(mask=True), "attention_mask: rank 0 has None, rank 1 has (1, 64)"),
}


def _gdn_worker(rank: int, world: int, mode: str) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for case, (change, _) in GDN_CASES.items():
        cfg: dict[str, Any] = dict(batch=1, local_len=64, dtype=torch.float32, mask=False)
        if rank == 1:
            cfg.update(change)
        layer = LinearAttentionContextParallel(mode).apply(
            make_module().to(cfg["dtype"]), mesh)
        x, _ = make_inputs(cfg["batch"], cfg["local_len"], seed=rank)
        mask = torch.ones(cfg["batch"], cfg["local_len"]) if cfg["mask"] else None
        out[case] = _outcome(lambda: layer(x.to(cfg["dtype"]), attention_mask=mask))
    layer = LinearAttentionContextParallel(mode).apply(make_module(), mesh)
    out["agreeing call"] = str(tuple(layer(make_inputs(1, 64, seed=rank)[0]).shape))
    return out


@pytest.mark.parametrize("mode", ["ulysses", "p2p", "all_gather"])
def test_gdn_ranks_disagreeing_raise_named_error_on_every_rank(mode: str) -> None:
    for rank, res in enumerate(run_ranks(_gdn_worker, 2, args=(mode,))):
        for case, (_, text) in GDN_CASES.items():
            want = (f"ValueError: GatedDeltaNet context parallelism (mode={mode!r}): ranks "
                    f"disagree on {text} (cp group of 2)")
            assert res[case].startswith(want), f"rank {rank} {case}: {res[case]}"
        assert res["agreeing call"] == f"(1, 64, {HIDDEN})", f"rank {rank}: {res}"
