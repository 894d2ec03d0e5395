"""One rank's batch, with the document boundaries of its packed rows.

Every dataset (``trainer.data``, ``trainer.packed_dataset``) cuts rows of ``seq_len + 1`` tokens
out of a token stream and labels every token of the stream with the document it belongs to (a
``doc_key``: any int64 that changes exactly where a new document starts). :func:`make_batch`
turns those rows into a :class:`Batch`::

    window  [b, S+1]  ->  input_ids = window[:, :-1],  labels = window[:, 1:]
    doc_key [b, S+1]  ->  a document starts at input position i when i == 0 or
                          key[i] != key[i-1] (a row start is always a boundary)
    cu_seqlens  [n+1] int32: starts of the n segments over the b rows flattened (b * S tokens),
                             then b * S  (flash-attention's varlen convention)
    document_position_ids [b, S]: i - (start of i's segment)

A document cut by a row start is a new segment whose positions start at 0 (the model never saw
its beginning). Labels are *not* masked at boundaries: the label of a document's last token
(``<eos>``) is the next document's first token (``<bos>`` when ``data.bos_token`` is set, so it
stays predictable even when the model resets at the boundary).

Packing (``data.packing``):

* ``concat``: the model sees one stream; ``position_ids`` are the absolute positions of the
  shard's tokens ``[s]``, and the boundaries are metadata only (:meth:`Batch.model_kwargs` is
  empty).
* ``reset_at_document_boundaries``: ``position_ids`` are the per-document positions ``[b, s]``
  and :meth:`Batch.model_kwargs` passes ``cu_seqlens`` to the model, which then attends, convolves
  and carries the GDN state within each document only (``layers.segments``).

Under context parallelism ``input_ids``, ``labels``, ``position_ids`` and
``document_position_ids`` are this rank's contiguous shard, while ``cu_seqlens`` and
``max_seqlen`` describe the rows' *whole* sequences (a CP implementation needs the global
boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from overlap_runtime.context_parallel.sharding import shard_positions, shard_sequence
from overlap_runtime.trainer.launch_ahead import to_device

Packing = Literal["concat", "reset_at_document_boundaries"]
PACKING_MODES: tuple[str, ...] = ("concat", "reset_at_document_boundaries")


@dataclass(frozen=True)
class Batch:
    """One rank's share of a step's batch (see the module docstring).

    Attributes:
        input_ids: ``[b, s]`` int64 tokens (``b`` rows of this dp rank, ``s`` = this CP shard).
        labels: ``[b, s]`` int64 next tokens.
        position_ids: ``[s]`` int64 absolute positions (``concat``) or ``[b, s]`` per-document
            positions (``reset_at_document_boundaries``) of the shard's tokens.
        global_tokens: labelled tokens in the whole global batch (all dp, all cp).
        cu_seqlens: ``[n + 1]`` int32 document starts over the ``b`` whole rows flattened
            (``b * seq_len`` tokens, every row start included), then ``b * seq_len``; None for a
            hand-made batch without boundaries.
        document_position_ids: ``[b, s]`` int64 position of each shard token in its document.
        max_seqlen: the longest segment of ``cu_seqlens``.
        packing: what the model is told (:meth:`model_kwargs`).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    global_tokens: int
    cu_seqlens: torch.Tensor | None = None
    document_position_ids: torch.Tensor | None = None
    max_seqlen: int = 0
    packing: Packing = "concat"

    def model_kwargs(self, device: torch.device | str | None = None) -> dict[str, Any]:
        """Extra keyword arguments of the model's forward: ``{}`` for ``concat``,
        ``{"cu_seqlens": cu_seqlens}`` (on ``device``) for ``reset_at_document_boundaries``."""
        if self.packing == "concat":
            return {}
        if self.cu_seqlens is None:
            raise ValueError("packing='reset_at_document_boundaries' needs a batch with "
                             "cu_seqlens (document boundaries)")
        return {"cu_seqlens": to_device(self.cu_seqlens, torch.device(device))
                if device is not None else self.cu_seqlens}


def _document_boundaries(doc_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``doc_key [b, S]`` -> ``(cu_seqlens [n+1] int32, document positions [b, S] int64,
    max_seqlen)`` (module docstring)."""
    b, s = doc_key.shape
    starts = torch.ones_like(doc_key, dtype=torch.bool)
    starts[:, 1:] = doc_key[:, 1:] != doc_key[:, :-1]
    flat = starts.flatten().nonzero().squeeze(1)
    cu = torch.cat([flat, torch.tensor([b * s])]).to(torch.int32)
    idx = torch.arange(s).expand(b, s)
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return cu, idx - last_start, int((cu[1:] - cu[:-1]).max())


def make_batch(window: torch.Tensor, doc_key: torch.Tensor, packing: Packing, cp: int,
               cp_rank: int, global_tokens: int) -> Batch:
    """This rank's :class:`Batch` of rows ``window [b, S+1]`` int64 with ``doc_key [b, S+1]``
    int64, contiguous CP shard ``cp_rank`` of ``cp``."""
    if packing not in PACKING_MODES:
        raise ValueError(f"data.packing={packing!r} is unknown (known: "
                         f"{', '.join(PACKING_MODES)})")
    inputs, labels = window[:, :-1], window[:, 1:]
    seq_len = inputs.shape[1]
    cu, doc_pos, max_seqlen = _document_boundaries(doc_key[:, :-1])

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, cp, cp_rank, 1, load_balance=None).contiguous()

    doc_pos = shard(doc_pos)
    if packing == "concat":
        position_ids = shard_positions(seq_len, cp, cp_rank, load_balance=None)
    else:
        position_ids = doc_pos
    return Batch(input_ids=shard(inputs), labels=shard(labels), position_ids=position_ids,
                 global_tokens=global_tokens, cu_seqlens=cu, document_position_ids=doc_pos,
                 max_seqlen=max_seqlen, packing=packing)
