"""Packed documents in one batch: ``cu_seqlens`` checks and a per-segment apply.

A packed batch ``[B, T, ...]`` holds several documents per row. ``cu_seqlens`` (int32 or int64
``[n + 1]``, flash-attention's varlen convention) lists where each segment starts in the
``B * T`` tokens of the rows flattened, then ``B * T``; every row start ``r * T`` must be one of
the starts, so no segment crosses a row::

    rows  [ d0 d0 d0 d1 d1 | d1 d2 d2 d2 d2 ]     B = 2, T = 5
    cu_seqlens = [0, 3, 5, 6, 10]                 (d1 is cut by the row start at 5)

Because every row start is a segment start, ``cu_seqlens`` is also the varlen offsets of the
rows flattened to one row ``[1, B * T, ...]``: the single-device GDN mixer
(``layers.sequence_mixer.LocalGDNMixer.forward_packed``) runs ONE causal conv over the rows with
the taps before each token's document start dropped (:func:`document_positions`) and ONE GDN op
call with ``cu_seqlens`` (``ops.gdn``, either backend).

:func:`apply_per_segment` is the simple exact way to make any other sequence mixer reset at
document boundaries: run it on each segment on its own (``[1, len, ...]``) and put the outputs
back in place, one call per segment (a Python loop). Attention uses it, and it is the default
``GDNSequenceMixer.forward_packed`` of a mixer that has no varlen path.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def segments_of(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each segment in the flattened ``batch * seq_len`` tokens.

    Raises:
        ValueError: ``cu_seqlens`` is not a 1-D integer tensor starting at 0, strictly
            increasing, ending at ``batch * seq_len`` and holding every row start.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor, got "
                         f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    cu = [int(c) for c in cu_seqlens.tolist()]
    total = batch * seq_len
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at B * T = {batch} * {seq_len} = "
                         f"{total}; got {cu[:4]}...{cu[-2:]} ({len(cu)} entries)")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError("cu_seqlens must be strictly increasing (no empty segment)")
    missing = sorted(set(range(0, total, seq_len)) - set(cu))
    if missing:
        raise ValueError(f"cu_seqlens must hold every row start (multiples of T={seq_len}); "
                         f"missing {missing[:8]}: a segment may not cross a row")
    return list(zip(cu[:-1], cu[1:]))


def document_positions(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """``[B, T]`` int64 position of each token in its segment, on ``cu_seqlens``' device (RoPE
    restarting per document; the conv's document mask). Checks ``cu_seqlens``
    (:func:`segments_of`)."""
    segments_of(cu_seqlens, batch, seq_len)
    cu = cu_seqlens.to(torch.int64)
    tokens = torch.arange(batch * seq_len, dtype=torch.int64, device=cu.device)
    start = cu[torch.searchsorted(cu, tokens, right=True) - 1]
    return (tokens - start).view(batch, seq_len)


def apply_per_segment(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor | None],
                      cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``fn`` on each segment alone, outputs concatenated back to ``[B, T, ...]``.

    Args:
        fn: ``(*segment_tensors) -> [1, len, ...]``; each segment tensor is ``[1, len, ...]``
            (None entries stay None).
        tensors: ``[B, T, ...]`` tensors (or None), all with the same ``B, T``.
        cu_seqlens: the segments (module docstring).

    Returns:
        ``[B, T, ...]``, the trailing dims of ``fn``'s output.
    """
    first = next(t for t in tensors if t is not None)
    b, t = first.shape[:2]
    flat = [None if x is None else x.reshape(1, b * t, *x.shape[2:]) for x in tensors]
    outs = [fn(*[None if x is None else x[:, s:e] for x in flat])
            for s, e in segments_of(cu_seqlens, b, t)]
    out = torch.cat(outs, dim=1)
    return out.reshape(b, t, *out.shape[2:])
