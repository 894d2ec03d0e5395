"""Issue #24 item 4: the simulator prices every CP mode (the chain hop by hop, the prefix scan
round by round, hierarchical attention on its two groups) and the crossover computation picks
what docs/benchmarks.md's table says. Pure Python, no ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlap_runtime.stepgraph.costs import h200_profile
from overlap_runtime.stepgraph.crossover import (crossover_cp, layer_config, predict_grid,
                                                 predict_mode, winner)
from overlap_runtime.stepgraph.layer_program import stage_program
from overlap_runtime.stepgraph.scale import priced_ops
from overlap_runtime.config.train import AcceleratorConfig, load_config

BASE = load_config(Path(__file__).resolve().parents[2] / "configs" / "gpu_cp2_16k.yaml")
PROF = h200_profile()
STATE = 32 * 128 * 128 * 4  # one Qwen3.5 GDN state, fp32 (2 MiB)


def test_state_chain_and_scan_are_priced_per_hop_and_per_round() -> None:
    hop_intra, hop_inter = PROF.intra.time(STATE), PROF.inter.time(STATE)
    # CP16 over two nodes: 14 NVLink hops + 1 inter-node hop
    assert PROF.state_chain(STATE, 16) == pytest.approx(14 * hop_intra + hop_inter)
    # CP8 in one node: 3 rounds on NVLink, the first two carry pairs, the last a state
    pair = 2 * STATE
    assert PROF.prefix_scan(STATE, pair, 8) == pytest.approx(
        2 * PROF.intra.time(pair) + PROF.intra.time(STATE))
    # CP64: 6 rounds, every one with a message between nodes (and a pair until the last)
    assert PROF.prefix_scan(STATE, pair, 64) == pytest.approx(
        5 * PROF.inter.time(pair) + PROF.inter.time(STATE))
    assert PROF.prefix_scan(STATE, pair, 2) == pytest.approx(hop_intra)


def _priced(kind: str, mode: str, cp: int, a2a: int | None = None, direction: str = "F"
            ) -> dict[str, float]:
    cfg = layer_config(BASE, kind, mode, cp, 8192, a2a)  # type: ignore[arg-type]
    prog = stage_program(cfg, [0], direction, cp_rank=1, first=True, last=True)  # type: ignore[arg-type]
    ops = priced_ops(prog, PROF, cp=cp, ep=1, cp_a2a=a2a)
    return {o.name: o.cost for o in ops if o.task_kind == "comm"}


def test_the_representative_rank_waits_for_the_whole_scan_and_chain() -> None:
    scan = _priced("gdn", "prefix_scan", 64, direction="B")  # rank 1 receives every round
    waits = {k: v for k, v in scan.items() if k.startswith("gdn.scan")}
    assert len(waits) == 1  # every round on the first receive, the others not double-counted
    assert list(waits.values())[0] > 6 * PROF.inter.latency_s
    chain = _priced("gdn", "p2p", 64)["gdn.chain.recv_H"]
    assert chain > 63 * PROF.intra.time(STATE)
    assert list(waits.values())[0] < chain / 2


def test_hierarchical_attention_is_priced_on_its_groups() -> None:
    """Its all-to-alls on cp_a2a (inside a node), its ring on cp_ring (ranks a2a apart)."""
    ops = _priced("attention", "hierarchical", 16, a2a=8)
    assert ops["attn.a2a_in"] > 0 and ops["attn.ring.agree"] > 0
    a2a = layer_config(BASE, "attention", "hierarchical", 16, 8192, 8)
    n = next(o.nbytes for _, o in stage_program(a2a, [0], "F", cp_rank=1)
             if o.name == "attn.a2a_in")
    assert ops["attn.a2a_in"] == pytest.approx(PROF.all_to_all(n, 8) + PROF.copy(n))
    assert ops["attn.ring.agree"] == pytest.approx(PROF.all_gather(80, 2, 8))
    with pytest.raises(ValueError, match="cp_a2a was not given"):
        cfg = layer_config(BASE, "attention", "hierarchical", 16, 8192, 8)
        priced_ops(stage_program(cfg, [0], "F", cp_rank=1), PROF, cp=16, ep=1)


def test_crossover_picks_what_the_table_says() -> None:
    """docs/benchmarks.md "Where each CP mode wins": GDN local 8K, the tree (prefix_scan)
    beats the chain by > 1% from CP4, the chain beats all_gather; Ulysses is refused at CP64
    (32 value heads); attention: ring is the fastest at every CP size."""
    gdn = predict_grid(BASE, "gdn", [4, 64], [8192], PROF)
    assert crossover_cp(gdn, 8192, "p2p", "prefix_scan", margin=0.01) == 4
    assert crossover_cp(gdn, 8192, "all_gather", "p2p", margin=0.01) == 4
    assert crossover_cp(gdn, 8192, "p2p", "all_gather") is None
    assert {winner(gdn, 8192, cp).mode for cp in (4, 64)} == {"prefix_scan"}
    refused = next(r for r in gdn if r.mode == "ulysses" and r.cp == 64)
    assert refused.ms is None and "linear_num_value_heads % cp" in (refused.refused or "")
    assert predict_mode(BASE, "gdn", "prefix_scan", 64, 8192, PROF).ms < 0.7 * next(
        r.ms for r in gdn if r.mode == "p2p" and r.cp == 64)  # type: ignore[operator]
    att = predict_grid(BASE, "attention", [4, 16], [8192], PROF)
    assert {winner(att, 8192, cp).mode for cp in (4, 16)} == {"ring"}
    assert next(r for r in att if r.mode == "hierarchical" and r.cp == 16).split == (2, 8)


def test_the_trainer_default_is_the_table_winner() -> None:
    """The explicit defaults (docs/context_parallel.md "Default modes") follow the table."""
    acc = AcceleratorConfig()
    assert acc.linear_attention_cp_mode == "prefix_scan"
    assert acc.full_attention_cp_mode == "ring"
