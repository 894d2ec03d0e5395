"""Chunk and segment tables of packed variable-length sequences (``cu_seqlens``).

The packed batch ``[1, T, ...]`` holds ``N`` sequences, sequence ``i`` being the tokens
``[cu_seqlens[i], cu_seqlens[i + 1])``. Every kernel works on chunks of up to 64 tokens that
never straddle two sequences: sequence ``i`` of length ``L_i`` owns ``ceil(L_i / 64)`` chunks,
the last one cut at the sequence's end (``eos``), and the kernels mask the rows ``>= eos`` as
the dense path masks the rows ``>= T`` of its last chunk (``common.chunk_span``). No token is
copied or padded: the per-token tensors stay packed, the per-chunk ones (states, state
gradients) are ``[1, NT, HV, K, V]`` with ``NT`` the total of the chunk counts. Example, lengths
``(1, 63, 64, 65, 130)``::

    cu_seqlens  0  1  64  128  193  323
    chunks      (0, 1) (1, 64) (64, 128) (128, 192) (192, 193) (193, 257) (257, 321) (321, 323)
    sequence    0      1       2         3          3          4          4          4

The state scans walk segments of consecutive chunks of one sequence. Each sequence is cut into
``max(1, ceil(n_i / L))`` segments of ``L`` chunks (an empty sequence keeps one empty segment,
whose walk leaves its initial state unchanged); with one segment per sequence (``single``) the
scans start from the ``[N, HV, K, V]`` initial states and end in the final states directly;
otherwise the segments' affine summaries are chained per sequence first (``chain_kernel`` with
``VARLEN``), as the dense path's segmented scan does for one long sequence.

Built once per forward call on the host (one device-to-host copy of ``cu_seqlens``) and reused
by the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import CHUNK, choose_segments


@dataclass(frozen=True)
class VarlenLayout:
    """Tables of one varlen call (all int32 on the inputs' device).

    Attributes:
        chunks: ``[NT, 2]`` first token and sequence end of every chunk.
        segments: ``[NS, 2]`` first chunk and end chunk (exclusive) of every scan segment.
        seq_segments: ``[N + 1]`` segment offsets of the sequences.
        num_seqs, num_chunks, num_segments: ``N``, ``NT``, ``NS``.
    """

    chunks: torch.Tensor
    segments: torch.Tensor
    seq_segments: torch.Tensor
    num_seqs: int
    num_chunks: int
    num_segments: int

    @property
    def single(self) -> bool:
        """One segment per sequence: no summaries, no chain."""
        return self.num_segments == self.num_seqs


def _offsets(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 offsets, got shape "
                         f"{list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens dtype {cu_seqlens.dtype} is not supported: use int32 or "
                         "int64")
    offsets = cu_seqlens.detach().to("cpu", torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != seq_len or bool((lengths < 0).any()):
        shown = offsets.tolist() if offsets.numel() <= 16 else f"{offsets[:16].tolist()}..."
        raise ValueError(f"cu_seqlens must rise from 0 to T={seq_len} (never decreasing), got "
                         f"{shown}")
    return offsets


def varlen_layout(cu_seqlens: torch.Tensor, seq_len: int, programs_per_sequence: int,
                  device: torch.device, num_segments: int | None) -> VarlenLayout:
    """The chunk and segment tables of ``cu_seqlens``.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 offsets, 0 first and ``T`` last, never decreasing.
        seq_len: ``T``, the packed length.
        programs_per_sequence: programs of one segment of one sequence (``HV * V / BV``).
        num_segments: segments of the longest sequence (None: chosen from the machine, as the
            dense path chooses them for one sequence, with every sequence's programs counted).

    Returns:
        The :class:`VarlenLayout` (tables on ``device``).
    """
    offsets = _offsets(cu_seqlens, seq_len)
    num_seqs = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    seq_chunks = (lengths + CHUNK - 1) // CHUNK
    num_chunks = int(seq_chunks.sum())
    longest = int(seq_chunks.max())
    if num_segments is None:
        wanted = choose_segments(longest, programs_per_sequence * num_seqs, device)
    else:
        wanted = int(num_segments)
    per_segment = max(1, -(-longest // max(1, min(wanted, max(1, longest)))))
    # chunk table: sequence of each chunk, its rank inside the sequence
    seq_of_chunk = torch.repeat_interleave(torch.arange(num_seqs), seq_chunks)
    first_chunk = torch.cumsum(seq_chunks, 0) - seq_chunks
    rank = torch.arange(num_chunks) - first_chunk[seq_of_chunk]
    chunks = torch.stack([offsets[:-1][seq_of_chunk] + CHUNK * rank,
                          offsets[1:][seq_of_chunk]], dim=1)
    # segment table: every sequence keeps at least one (possibly empty) segment
    seq_segs = torch.clamp((seq_chunks + per_segment - 1) // per_segment, min=1)
    total_segments = int(seq_segs.sum())
    seq_of_seg = torch.repeat_interleave(torch.arange(num_seqs), seq_segs)
    first_seg = torch.cumsum(seq_segs, 0) - seq_segs
    seg_rank = torch.arange(total_segments) - first_seg[seq_of_seg]
    seq_end = (first_chunk + seq_chunks)[seq_of_seg]
    seg_start = torch.minimum(first_chunk[seq_of_seg] + per_segment * seg_rank, seq_end)
    segments = torch.stack([seg_start, torch.minimum(seg_start + per_segment, seq_end)], dim=1)
    seq_segments = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(seq_segs, 0)])

    def table(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int32).contiguous().to(device)

    return VarlenLayout(table(chunks), table(segments), table(seq_segments), num_seqs,
                        num_chunks, total_segments)
