"""Row-piece accumulators of ring attention: float32 only where two results meet.

(float32 stands for the accumulation dtype throughout, ``ops.attention.accumulation_dtype``:
float64 when the inputs are float64, so float64 attention is summed in float64.)

A rank's local rows are tracked in pieces (its two zigzag halves, :func:`_pieces`). Every block
plan and diagonal part covers whole pieces, so for each piece the ring knows in advance how many
contributions it will receive (:func:`_piece_counts`):

* :class:`_OutputMerger` (forward): starts from the diagonal block's ``(out, lse)`` in the
  kernel's dtype; a piece enters a float32 accumulator at its first merge and is written in the
  output dtype at its last (``merge_attention_(prev_out=..., result=...)``); a piece no other
  block touches keeps the diagonal's output as it is.
* :class:`_GradSum` (backward dq/dk/dv): per piece the first contribution is copied into a
  float32 accumulator and the last is added from it straight into the result dtype; a piece
  with a single contribution is copied into the result (no zero fill, no cast pass).

Used by ``ring.py``; nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from overlap_runtime.ops.attention import accumulation_dtype, merge_attention_


def _span(rows: slice, length: int) -> tuple[int, int]:
    """``(start, stop)`` of a contiguous row slice of a sequence of ``length`` rows."""
    start, stop, step = rows.indices(length)
    if step != 1:
        raise AssertionError(f"ring attention: row slice {rows} is not contiguous")
    return start, stop


def _pieces(length: int) -> list[tuple[int, int]]:
    """The row pieces a local shard's accumulators track: its two halves (every block plan and
    diagonal part covers whole halves), or the whole shard when it has fewer than 2 rows."""
    if length < 2:
        return [(0, length)]
    return [(0, length // 2), (length // 2, length)]


def _runs(span: tuple[int, int], pieces: list[tuple[int, int]], key: Callable[[int], Any]
          ) -> list[tuple[int, int, Any]]:
    """The non-empty pieces inside ``span`` as maximal runs ``(start, stop, key(i))`` of equal
    key. ``span`` must be a union of whole pieces (raises otherwise: a plan the trackers below
    cannot follow)."""
    runs: list[tuple[int, int, Any]] = []
    covered = 0
    for i, (a, b) in enumerate(pieces):
        if a >= span[1] or b <= span[0] or a == b:
            continue
        if a < span[0] or b > span[1]:
            raise AssertionError(f"ring attention: rows {span} cut piece {(a, b)}")
        k = key(i)
        if runs and runs[-1][2] == k and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b, k)
        else:
            runs.append((a, b, k))
        covered += b - a
    if covered != span[1] - span[0]:
        raise AssertionError(f"ring attention: rows {span} are not a union of pieces {pieces}")
    return runs


def _inside(span: tuple[int, int], pieces: list[tuple[int, int]]) -> list[int]:
    """Indices of the non-empty pieces inside ``span``."""
    return [i for i, (a, b) in enumerate(pieces) if span[0] <= a and b <= span[1] and a < b]


def _piece_counts(length: int, spans: list[slice]
                  ) -> tuple[list[tuple[int, int]], list[int]]:
    """The shard's row pieces (:func:`_pieces`) and how many of ``spans`` cover each."""
    pieces = _pieces(length)
    count = [0] * len(pieces)
    for rows in spans:
        for i in _inside(_span(rows, length), pieces):
            count[i] += 1
    return pieces, count


class _OutputMerger:
    """The forward's output rows, merged block by block, in float32 only where a merge needs it.

    Starts from the diagonal block (``diag_out`` ``[B, L, H, D]`` in its kernel's dtype, which
    covers every row; ``diag_lse`` ``[B, H, L]`` float32, updated in place). A row piece (half
    of the shard, :func:`_pieces`) enters the float32 accumulator at its first merge, which
    reads the diagonal's output directly (``merge_attention_(prev_out=...)``), and its last merge
    writes the result in ``dtype`` (``result=...``). So the first block is never copied to
    float32 and the output is never cast in a pass of its own; rows no merge touches are the
    diagonal's output as is. The result is the diagonal's own tensor when it already has
    ``dtype`` and is contiguous (the cuDNN/flash case: their output is laid out like q, and q is
    contiguous), else a new contiguous one.

    ``merges``: the rows of every later merge (only the count per piece matters). Rounding is
    that of a float32 accumulator cast once at the end.
    """

    def __init__(self, diag_out: torch.Tensor, diag_lse: torch.Tensor, dtype: torch.dtype,
                 merges: list[slice]) -> None:
        self.length = diag_out.shape[1]
        self.pieces, self.left = _piece_counts(self.length, merges)
        self.in_acc = [False] * len(self.pieces)
        self.diag, self.lse = diag_out, diag_lse
        self.acc: torch.Tensor | None = None
        if diag_out.dtype == dtype and diag_out.is_contiguous():
            self.result = diag_out
        else:
            self.result = torch.empty(diag_out.shape, dtype=dtype, device=diag_out.device)

    def merge(self, rows: slice, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
        """Merge a block's ``(out [B, n, H, D], lse [B, H, n] float32)`` into rows ``rows``."""
        span = _span(rows, self.length)
        a0 = span[0]
        if self.acc is None:
            self.acc = torch.empty(self.diag.shape, dtype=self.lse.dtype, device=self.diag.device)
        for a, b, (in_acc, last) in _runs(span, self.pieces,
                                          lambda i: (self.in_acc[i], self.left[i] == 1)):
            merge_attention_(self.acc[:, a:b], self.lse[:, :, a:b], blk_out[:, a - a0:b - a0],
                             blk_lse[:, :, a - a0:b - a0],
                             prev_out=None if in_acc else self.diag[:, a:b],
                             result=self.result[:, a:b] if last else None)
        for i in _inside(span, self.pieces):
            if self.left[i] < 1:
                raise AssertionError(f"ring attention: unplanned merge into rows {span}")
            self.in_acc[i] = True
            self.left[i] -= 1

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, L, H, D] in dtype, lse [B, H, L] float32)`` after every planned merge."""
        if any(self.left):
            raise AssertionError(f"ring attention: merges left per piece {self.left}")
        if self.result is not self.diag:
            for a, b, merged in _runs((0, self.length), self.pieces, lambda i: self.in_acc[i]):
                if not merged:
                    self.result[:, a:b].copy_(self.diag[:, a:b])
        return self.result, self.lse


class _GradSum:
    """A gradient ``[B, L, H, D]`` (``like``'s shape) summed from block contributions to rows
    (dim 1), returned in ``dtype``.

    Contributions (any float dtype: a kernel's bf16 gradients are read as is) accumulate in
    float32, without a zero fill or a cast pass: per row piece (:func:`_pieces`) the first
    contribution is copied into the float32 accumulator and the last one is added straight into
    the result (``torch.add(acc, x, out=result)``; a piece with a single contribution is copied
    there). Rounding is that of a float32 sum cast once. ``spans``: the rows of every
    contribution that will come (only the count per piece matters).
    """

    def __init__(self, like: torch.Tensor, dtype: torch.dtype, spans: list[slice]) -> None:
        self.shape, self.device = tuple(like.shape), like.device
        self.length = like.shape[1]
        self.pieces, self.left = _piece_counts(self.length, spans)
        self.seen = [False] * len(self.pieces)
        self.acc: torch.Tensor | None = None
        self.result = torch.empty(self.shape, dtype=dtype, device=self.device)

    def add(self, rows: slice, x: torch.Tensor) -> None:
        """Add ``x`` ``[B, n, H, D]`` to rows ``rows`` (one of the planned spans)."""
        span = _span(rows, self.length)
        a0 = span[0]
        runs = _runs(span, self.pieces, lambda i: (not self.seen[i], self.left[i] == 1))
        for a, b, (first, last) in runs:
            xs = x[:, a - a0:b - a0]
            if first and last:
                self.result[:, a:b].copy_(xs)
                continue
            if self.acc is None:
                self.acc = torch.empty(self.shape, dtype=accumulation_dtype(self.result.dtype),
                                       device=self.device)
            if first:
                self.acc[:, a:b].copy_(xs)
            elif last:
                torch.add(self.acc[:, a:b], xs, out=self.result[:, a:b])
            else:
                self.acc[:, a:b].add_(xs)
        for i in _inside(span, self.pieces):
            if self.left[i] < 1:
                raise AssertionError(f"ring attention: unplanned contribution to rows {span}")
            self.seen[i] = True
            self.left[i] -= 1

    def finish(self) -> torch.Tensor:
        """The sum in ``dtype``; rows no block contributed to are zero."""
        if any(self.left):
            raise AssertionError(f"ring attention: contributions left per piece {self.left}")
        for a, b, seen in _runs((0, self.length), self.pieces, lambda i: self.seen[i]):
            if not seen:
                self.result[:, a:b].zero_()
        return self.result
