"""Real documents, shuffled per epoch and packed in order into fixed-length rows.

::

    documents d_0 .. d_{D-1}  (tokenised once at start-up, trainer.documents; each [bos] ids <eos>)
    epoch e:  order_e = a permutation of the D documents drawn from seed (seed, e)
    stream:   order_0 documents back to back ++ order_1 ... ++ order_2 ...   (L tokens an epoch)
    window w: stream[w * S : w * S + S + 1]     (S = seq_len; consecutive windows share one
                                                 token, so every token is a label exactly once)
    step s:   global rows j = 0 .. R-1 (R = dp * batch_size) are windows s * R + j;
              data-parallel rank r takes rows r * batch_size .. (r + 1) * batch_size - 1

So the data position is a pure function of the step (a checkpoint stores the step: see
``trainer.data_state``), epochs follow each other without a gap (a window may span two epochs),
and each rank computes only its own rows: token ``p`` of epoch ``e`` is found by a binary search
over the cumulative lengths of ``order_e`` (no epoch stream is materialised; the permutations
of the epochs in use are cached).

Every row keeps its document boundaries (``trainer.batch.make_batch``): a document is identified
by ``(epoch, index in order_e)``, so the same document meeting itself across an epoch boundary is
still two documents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from overlap_runtime.config.data_sources import special_ids
from overlap_runtime.trainer.batch import Batch, Packing, make_batch
from overlap_runtime.trainer.data_state import StepPositionState
from overlap_runtime.trainer.documents import (DataTokenizer, TokenizedDocuments,
                                               file_fingerprint, load_tokenizer, read_documents,
                                               resolve_files, tokenize_documents)

if TYPE_CHECKING:
    from overlap_runtime.config.train import DataConfig

_EPOCH_CACHE = 4  # epochs whose order is kept (a step touches one or two)


class PackedDataset(StepPositionState):
    """Shuffled, packed documents (see the module docstring).

    Args:
        documents: the tokenised documents.
        seq_len: S, tokens per row (split over CP ranks).
        batch_size: rows per data-parallel rank.
        dp: data-parallel degree.
        seed: base seed of the per-epoch shuffles.
        packing: ``concat`` or ``reset_at_document_boundaries`` (``trainer.batch``).
        fingerprint: what the data is (files, tokenizer, ...), merged into :meth:`fingerprint`.
    """

    def __init__(self, documents: TokenizedDocuments, seq_len: int, batch_size: int = 1,
                 dp: int = 1, seed: int = 0, packing: Packing = "concat",
                 fingerprint: dict[str, Any] | None = None) -> None:
        if seq_len < 1 or batch_size < 1 or dp < 1:
            raise ValueError(f"seq_len={seq_len}, batch_size={batch_size}, dp={dp} must be >= 1")
        if documents.num_documents < 1:
            raise ValueError("PackedDataset needs at least one document")
        self.documents = documents
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp = dp
        self.seed = seed
        self.packing = packing
        self.epoch_tokens = int(documents.offsets[-1])  # L
        self._source = dict(fingerprint or {})
        self._orders: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.position = 0  # the next step to serve (state_dict)

    @classmethod
    def from_config(cls, data: "DataConfig", dp: int, seed: int) -> "PackedDataset":
        """Read and tokenise ``data.files`` (all of it, now) with ``data.tokenizer``."""
        assert data.files is not None
        fmt, paths = resolve_files(data.files, data.format)
        tokenizer = load_tokenizer(data.tokenizer)
        bos_id, eos_id = special_ids(tokenizer, data.bos_token, data.eos_token)
        docs = tokenize_documents(read_documents(fmt, paths, data.text_field), tokenizer,
                                  bos_id, eos_id)
        source = {"files": file_fingerprint(paths), "format": fmt,
                  "text_field": data.text_field if fmt != "text" else None,
                  "tokenizer": tokenizer.sha256, "bos_id": bos_id, "eos_id": eos_id}
        return cls(docs, data.seq_len, data.batch_size, dp, seed, data.packing, source)

    @property
    def num_documents(self) -> int:
        return self.documents.num_documents

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """``[D]`` int64: the documents of ``epoch`` in stream order."""
        return self._order(epoch)[0]

    def _order(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(order [D], ends [D])``: the permutation and cumulative lengths of ``epoch``."""
        hit = self._orders.get(epoch)
        if hit is None:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
            order = torch.randperm(self.num_documents, generator=gen)
            hit = (order, self.documents.lengths[order].cumsum(0))
            if len(self._orders) >= _EPOCH_CACHE:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = hit
        return hit

    def _gather(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stream positions ``offsets`` (int64, any shape) -> ``(tokens, doc_key)`` int64."""
        epoch = offsets // self.epoch_tokens
        within = offsets % self.epoch_tokens
        tokens = torch.empty_like(offsets)
        key = torch.empty_like(offsets)
        d = self.num_documents
        for e in torch.unique(epoch).tolist():
            sel = epoch == e
            order, ends = self._order(e)
            p = within[sel]
            k = torch.searchsorted(ends, p, right=True)        # index in order_e
            doc = order[k]
            start_in_doc = p - (ends[k] - self.documents.lengths[doc])
            tokens[sel] = self.documents.tokens[self.documents.offsets[doc] + start_in_doc].long()
            key[sel] = e * d + k
        return tokens, key

    def _rows(self, step: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global rows ``first .. first + count - 1`` of ``step``: ``[count, S + 1]`` each."""
        rows = self.dp * self.batch_size
        w = step * rows + first + torch.arange(count, dtype=torch.int64)
        offsets = w[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        return self._gather(offsets)

    def rank_batch(self, step: int, dp_rank: int = 0, cp_rank: int = 0, cp: int = 1) -> Batch:
        """This rank's rows (dp) and contiguous sequence shard (cp) of step ``step``."""
        if step < 0:
            raise ValueError(f"step {step} must be >= 0")
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp {self.dp}")
        window, key = self._rows(step, dp_rank * self.batch_size, self.batch_size)
        self.position = step + 1
        return make_batch(window, key, self.packing, cp, cp_rank, self._global_tokens)

    def full_batch(self, step: int) -> Batch:
        """Every row of step ``step``, whole sequences (the single-device baseline's batch)."""
        if step < 0:
            raise ValueError(f"step {step} must be >= 0")
        window, key = self._rows(step, 0, self.dp * self.batch_size)
        self.position = step + 1
        return make_batch(window, key, self.packing, 1, 0, self._global_tokens)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, each ``[dp * batch_size, seq_len]`` int64, of step ``step``."""
        b = self.full_batch(step)
        return b.input_ids, b.labels

    @property
    def _global_tokens(self) -> int:
        return self.dp * self.batch_size * self.seq_len

    def fingerprint(self) -> dict[str, Any]:
        """What step ``s`` depends on (``trainer.data_state``)."""
        return {"kind": "packed", **self._source, "seq_len": self.seq_len,
                "rows_per_step": self.dp * self.batch_size, "packing": self.packing,
                "seed": self.seed, "documents": self.num_documents,
                "tokens": self.epoch_tokens}
