"""Training data: the byte-level corpus sampler, the byte tokenizer and :func:`build_dataset`.

Two datasets share one interface (``rank_batch``, ``full_batch``, ``state_dict``,
``load_state_dict``; every batch a pure function of the step):

* :class:`TextDataset` (this module): random windows of one text stream - the packaged corpus
  (the default, hermetic) or ``data.corpus``. Described below.
* :class:`~overlap_runtime.trainer.packed_dataset.PackedDataset`: real documents from
  ``data.files`` (text, JSONL, Parquet; ``trainer.documents``), shuffled per epoch and packed in
  order.

Both return :class:`~overlap_runtime.trainer.batch.Batch` rows with document boundaries
(``trainer.batch``; ``data.packing``).

The corpus is ``overlap_runtime/data/corpus.txt`` (about 29 KB of self-written English prose,
shipped as package data) or any UTF-8 file named by ``data.corpus``. Tokenisation is byte-level:
token ``b`` (0..255) is the byte ``b``, and four special tokens follow (:data:`SPECIAL_TOKENS`);
the vocabulary has 260 entries. The whole corpus becomes one token stream ``<bos> bytes <eos>``.

Step ``s`` draws ``dp * batch_size`` windows of ``seq_len + 1`` tokens at offsets from a generator
seeded by ``(seed, s)``, read cyclically from the stream (so any length works; windows longer
than the corpus repeat it). Row ``j`` of the global batch belongs to data-parallel rank
``j // batch_size``. Inputs are ``window[:-1]`` and labels ``window[1:]``: labels are shifted on
the *global* sequence before it is split, so the label of a rank's last token is the first token
of the next rank's shard.

The CP split is the attention CP's rule for the hybrid model: contiguous
(``context_parallel.shard_sequence(..., load_balance=None)``), with position ids following the
tokens (``shard_positions(..., load_balance=None)``). Every rank computes the same global batch
(cheap) and takes its slice, and the single-device baseline takes all of it, so both see exactly
the same tokens. Document boundaries: each wrap of the stream starts a new document (at its
``<bos>``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from overlap_runtime.config.byte_tokenizer import (BOS_ID, EOS_ID, PAD_ID, SEP_ID,
                                                    SPECIAL_TOKENS, VOCAB_SIZE, ByteTokenizer)
from overlap_runtime.trainer.batch import Batch, Packing, make_batch
from overlap_runtime.trainer.data_state import StepPositionState
from overlap_runtime.trainer.documents import file_fingerprint
from overlap_runtime.trainer.packed_dataset import PackedDataset

if TYPE_CHECKING:
    from overlap_runtime.config.train import DataConfig

def load_corpus(path: str | Path | None = None) -> str:
    """The packaged corpus (``path=None``) or the UTF-8 text file at ``path``.

    Raises:
        FileNotFoundError: naming the path; ValueError: an empty corpus.
    """
    if path is None:
        text = resources.files("overlap_runtime").joinpath("data/corpus.txt").read_text("utf-8")
        source = "overlap_runtime/data/corpus.txt"
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data.corpus={str(path)!r}: no such file")
        text, source = p.read_text("utf-8"), str(p)
    if not text.strip():
        raise ValueError(f"corpus {source} is empty")
    return text


class TextDataset(StepPositionState):
    """Deterministic windows of the token stream (see the module docstring).

    Args:
        seq_len: global sequence length S (tokens per row, split over CP ranks).
        batch_size: rows per data-parallel rank.
        dp: data-parallel degree (rows of the global batch = ``dp * batch_size``).
        seed: base seed; step ``s`` uses ``seed * 1_000_003 + s``.
        corpus: path of a text file, or None for the packaged corpus.
        packing: ``concat`` or ``reset_at_document_boundaries`` (``trainer.batch``).
    """

    def __init__(self, seq_len: int, batch_size: int = 1, dp: int = 1, seed: int = 0,
                 corpus: str | Path | None = None, packing: Packing = "concat") -> None:
        if seq_len < 1 or batch_size < 1 or dp < 1:
            raise ValueError(f"seq_len={seq_len}, batch_size={batch_size}, dp={dp} must be >= 1")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp = dp
        self.seed = seed
        self.packing = packing
        self.corpus = corpus
        self.tokens = ByteTokenizer().encode(load_corpus(corpus))
        self.position = 0  # the next step to serve (state_dict)

    def _windows(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(window, doc_key)``, each ``[dp * batch_size, seq_len + 1]`` int64."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = self.dp * self.batch_size
        n = self.tokens.numel()
        starts = torch.randint(0, n, (rows,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.tokens[idx % n], idx // n

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, each ``[dp * batch_size, seq_len]`` int64, of step ``step``."""
        windows, _ = self._windows(step)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def rank_batch(self, step: int, dp_rank: int = 0, cp_rank: int = 0, cp: int = 1) -> Batch:
        """This rank's rows (dp) and contiguous sequence shard (cp) of step ``step``."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp {self.dp}")
        window, key = self._windows(step)
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        self.position = step + 1
        return make_batch(window[rows], key[rows], self.packing, cp, cp_rank,
                          self.dp * self.batch_size * self.seq_len)

    def full_batch(self, step: int) -> Batch:
        """Every row of step ``step``, whole sequences (the single-device baseline's batch)."""
        window, key = self._windows(step)
        self.position = step + 1
        return make_batch(window, key, self.packing, 1, 0, self.dp * self.batch_size * self.seq_len)

    def fingerprint(self) -> dict[str, Any]:
        """What step ``s`` depends on (``trainer.data_state``)."""
        if self.corpus is None:
            files: Any = "packaged:overlap_runtime/data/corpus.txt"
        else:
            files = file_fingerprint([Path(self.corpus)])
        return {"kind": "windows", "files": files, "tokenizer": "byte", "seq_len": self.seq_len,
                "rows_per_step": self.dp * self.batch_size, "packing": self.packing,
                "seed": self.seed, "tokens": int(self.tokens.numel())}


def build_dataset(data: "DataConfig", dp: int, seed: int) -> "TextDataset | Any":
    """The dataset of ``data`` (a validated ``DataConfig``) for ``dp`` data-parallel rows.

    ``data.files`` set: a :class:`~overlap_runtime.trainer.packed_dataset.PackedDataset`
    (documents tokenised here, once); otherwise a :class:`TextDataset` over ``data.corpus`` or
    the packaged corpus.
    """
    if data.files is not None:
        return PackedDataset.from_config(data, dp, seed)
    return TextDataset(data.seq_len, data.batch_size, dp, seed, data.corpus, data.packing)
