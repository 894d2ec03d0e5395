"""Balance of causal attention work per CP rank for packed batches (issue #23, item 5).

Pure computation, no ranks: documents with lengths drawn log-uniformly from 128 to 32K fill one
row of 128K tokens (the last one cut to fit); for CP8 each rule's per-rank work is the number of
(query, key) pairs its queries score, causal within each document
(``context_parallel.packed.causal_work_per_rank``). ``document_zigzag`` needs every document
length to be a multiple of 2P, so its documents are padded up (the padding counts as tokens and
work; its share is reported). Prints max/mean per rule, the mean and worst over seeds::

    python -m benchmarks.packed_cp_balance [--seeds 20] [--cp 8] [--tokens 131072]
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from overlap_runtime.context_parallel.packed import PackedLayout, causal_work_per_rank


def draw_lengths(total: int, lo: int, hi: int, rnd: random.Random, multiple: int = 1
                 ) -> list[int]:
    """Log-uniform lengths filling ``total``; each rounded up to ``multiple``."""
    out: list[int] = []
    left = total
    while left:
        n = int(math.exp(rnd.uniform(math.log(lo), math.log(hi))))
        n = -(-n // multiple) * multiple
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def imbalance(lengths: list[int], total: int, cp: int, rule: str) -> float:
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    work = causal_work_per_rank(PackedLayout.from_cu_seqlens(cu, 1, total, cp, rule))
    return max(work) / (sum(work) / len(work))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=131072)
    args = ap.parse_args()
    cp, total = args.cp, args.tokens
    rows: dict[str, list[float]] = {"contiguous": [], "zigzag": [], "document_zigzag": []}
    pad = []
    for seed in range(args.seeds):
        raw = draw_lengths(total, 128, 32768, random.Random(seed))
        rows["contiguous"].append(imbalance(raw, total, cp, "contiguous"))
        rows["zigzag"].append(imbalance(raw, total, cp, "zigzag"))
        # document_zigzag: the same documents, each padded up to a multiple of 2P (as TE);
        # those that still fit, then one document with the rest (a multiple of 2P too)
        padded, used = [], 0
        for n in raw:
            m = -(-n // (2 * cp)) * 2 * cp
            if sum(padded) + m > total:
                break
            padded.append(m)
            used += n
        if total - sum(padded):
            used += total - sum(padded)
            padded.append(total - sum(padded))
        pad.append(1 - used / total)
        rows["document_zigzag"].append(imbalance(padded, total, cp, "document_zigzag"))
    print(f"CP{cp}, {total} tokens per row, lengths log-uniform in [128, 32768], "
          f"{args.seeds} seeds: max/mean causal work per rank")
    print(f"{'rule':<18}{'mean':>8}{'worst':>8}")
    for rule, vals in rows.items():
        print(f"{rule:<18}{sum(vals) / len(vals):>8.3f}{max(vals):>8.3f}")
    print(f"document_zigzag padding: {100 * sum(pad) / len(pad):.2f}% of the tokens on average")


if __name__ == "__main__":
    main()
