"""Packed (THD) batches under context parallelism: which tokens each rank holds.

A packed batch ``[B, T]`` holds several documents per row; ``cu_seqlens`` (``[n + 1]`` int,
flash-attention's varlen convention, ``layers.segments``) lists where each document starts in
the ``B * T`` tokens flattened, every row start included. Under CP every rank holds ``T / P``
tokens of every row; a :class:`PackedLayout` says which, by one of three rules:

``contiguous``
    rank ``r`` holds ``[r T/P, (r+1) T/P)`` of each row. The only rule the GDN modes accept
    (the state chain runs left to right across ranks) and the one the hybrid model uses.
``zigzag``
    the row's zigzag (``sharding.py``): ``2P`` chunks, rank ``r`` holds chunks ``r`` and
    ``2P-1-r``; document-blind (``T % 2P == 0``).
``document_zigzag``
    per document, as TransformerEngine: each document is cut into ``2P`` equal chunks and rank
    ``r`` holds chunks ``r`` and ``2P-1-r`` of every document, in document order. Every document
    length must be a multiple of ``2P`` (pad documents when packing). Causal work inside each
    document is balanced, so the ranks' work is balanced whatever the length mix::

        P = 2, row = [d0 d0 d0 d0 | d1 d1 d1 d1 d1 d1 d1 d1]     (chunks of 1 and 2 tokens)
        d0 chunks  a b c d     d1 chunks  A A B B C C D D
        rank 0:  a d A A D D    rank 1:  b c B B C C

Every rule keeps a rank's tokens in increasing order within a row, so a causal mask over
(document id, position in the row) is the true mask; attention needs nothing else
(``varlen_attention.py``). Positions for RoPE are per document (:meth:`document_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from overlap_runtime.layers.segments import segments_of

PackedRule = Literal["contiguous", "zigzag", "document_zigzag"]
PACKED_RULES: tuple[str, ...] = ("contiguous", "zigzag", "document_zigzag")


@dataclass(frozen=True)
class PackedLayout:
    """Documents of a packed batch and the rule that deals their tokens to ``cp_size`` ranks.

    Args:
        cu_seqlens: document starts over the ``batch * seq_len`` tokens (global, the same on
            every rank), as a tuple of ints (:meth:`from_cu_seqlens` builds it from a tensor).
        batch: ``B``; seq_len: ``T``, the whole row (not a shard).
        cp_size: ``P``; rule: one of :data:`PACKED_RULES`.

    Raises:
        ValueError: a malformed ``cu_seqlens`` (``segments_of``), ``T % P != 0``, a rule's
            divisibility (``zigzag``: ``T % 2P``; ``document_zigzag``: every document length
            ``% 2P``), naming the value.
    """

    cu_seqlens: tuple[int, ...]
    batch: int
    seq_len: int
    cp_size: int
    rule: PackedRule = "contiguous"

    def __post_init__(self) -> None:
        if self.rule not in PACKED_RULES:
            raise ValueError(f"packed layout rule {self.rule!r} is unknown (known: {PACKED_RULES})")
        p, t = self.cp_size, self.seq_len
        if p < 1 or t % p:
            raise ValueError(f"packed layout: sequence length {t} is not a multiple of "
                             f"cp_size={p} (rule={self.rule!r})")
        if self.rule == "zigzag" and t % (2 * p):
            raise ValueError(f"packed layout: sequence length {t} is not a multiple of 2 * "
                             f"cp_size = {2 * p} (rule='zigzag': rank r holds chunks r and "
                             f"2P-1-r of each row)")
        segs = self.segments  # validates cu_seqlens
        if self.rule == "document_zigzag":
            for i, (a, b) in enumerate(segs):
                if (b - a) % (2 * p):
                    raise ValueError(
                        f"packed layout: document {i} (tokens [{a}, {b})) has length {b - a}, not "
                        f"a multiple of 2 * cp_size = {2 * p} (rule='document_zigzag' cuts every "
                        f"document into 2P equal chunks; pad documents to a multiple of {2 * p})")

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, seq_len: int, cp_size: int,
                        rule: PackedRule = "contiguous") -> "PackedLayout":
        """Layout of ``cu_seqlens`` (1-D int tensor, any device; read on the host once)."""
        segments_of(cu_seqlens, batch, seq_len)  # the tensor-level checks, named errors
        return cls(tuple(int(c) for c in cu_seqlens.tolist()), batch, seq_len, cp_size, rule)

    @cached_property
    def segments(self) -> list[tuple[int, int]]:
        """``[(start, end)]`` of every document in the flattened ``B * T`` tokens."""
        return segments_of(torch.tensor(self.cu_seqlens, dtype=torch.int64), self.batch,
                           self.seq_len)

    @property
    def local_len(self) -> int:
        """Tokens of each row a rank holds: ``T / P``."""
        return self.seq_len // self.cp_size

    @cached_property
    def document_ids(self) -> torch.Tensor:
        """``[B, T]`` int64 index of each token's document (global numbering)."""
        ids = torch.empty(self.batch * self.seq_len, dtype=torch.int64)
        for i, (a, b) in enumerate(self.segments):
            ids[a:b] = i
        return ids.view(self.batch, self.seq_len)

    @cached_property
    def _row_positions(self) -> torch.Tensor:
        """``[P, B, T/P]`` int64 positions within the row of every rank's tokens."""
        p, t, n = self.cp_size, self.seq_len, self.local_len
        out = torch.empty(p, self.batch, n, dtype=torch.int64)
        if self.rule == "contiguous":
            for r in range(p):
                out[r] = torch.arange(r * n, (r + 1) * n)
        elif self.rule == "zigzag":
            c = t // (2 * p)
            for r in range(p):
                out[r] = torch.cat([torch.arange(r * c, (r + 1) * c),
                                    torch.arange((2 * p - 1 - r) * c, (2 * p - r) * c)])
        else:
            per_row: list[list[list[torch.Tensor]]] = [[[] for _ in range(self.batch)]
                                                       for _ in range(p)]
            for a, b in self.segments:
                row, start = divmod(a, t)
                c = (b - a) // (2 * p)
                for r in range(p):
                    per_row[r][row] += [torch.arange(start + r * c, start + (r + 1) * c),
                                        torch.arange(start + (2 * p - 1 - r) * c,
                                                     start + (2 * p - r) * c)]
            for r in range(p):
                for row in range(self.batch):
                    out[r, row] = torch.cat(per_row[r][row])
        return out

    def row_positions(self, rank: int) -> torch.Tensor:
        """``[B, T/P]`` int64: where rank ``rank``'s tokens sit in their rows (increasing)."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is outside the CP group of {self.cp_size}")
        return self._row_positions[rank]

    def local_document_ids(self, rank: int) -> torch.Tensor:
        """``[B, T/P]`` int64 document of each of ``rank``'s tokens."""
        return self.document_ids.gather(1, self.row_positions(rank))

    def document_positions(self, rank: int) -> torch.Tensor:
        """``[B, T/P]`` int64 position of each of ``rank``'s tokens in its document (RoPE)."""
        starts = torch.tensor([a for a, _ in self.segments], dtype=torch.int64)
        doc = self.local_document_ids(rank)
        row_start = torch.arange(self.batch, dtype=torch.int64)[:, None] * self.seq_len
        return self.row_positions(rank) + row_start - starts[doc]

    def shard(self, x: torch.Tensor, rank: int, seq_dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s tokens of a whole-row tensor ``[B, T, ...]`` (``seq_dim`` = 1)."""
        if seq_dim != 1 or x.dim() < 2 or tuple(x.shape[:2]) != (self.batch, self.seq_len):
            raise ValueError(f"PackedLayout.shard: expected [B={self.batch}, T={self.seq_len}, "
                             f"...] with seq_dim=1, got shape {tuple(x.shape)}, seq_dim={seq_dim}")
        idx = self.row_positions(rank).to(x.device)
        idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        return x.gather(1, idx)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`shard`: every rank's ``[B, T/P, ...]`` -> ``[B, T, ...]``."""
        first = shards[0]
        out = first.new_empty(self.batch, self.seq_len, *first.shape[2:])
        for r, x in enumerate(shards):
            idx = self.row_positions(r).to(x.device)
            idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
            out = out.scatter(1, idx, x)
        return out


def causal_work_per_rank(layout: PackedLayout) -> list[int]:
    """Causal attention work of each rank: the number of (query, key) pairs its queries score,
    a query at document position ``p`` scoring ``p + 1`` keys (causal within its document)."""
    return [int((layout.document_positions(r) + 1).sum()) for r in range(layout.cp_size)]
