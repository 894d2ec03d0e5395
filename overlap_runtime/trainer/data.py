"""Training data: real English text, byte-level tokens, a different window every step.

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
the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from overlap_runtime.context_parallel.sharding import shard_positions, shard_sequence

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "Batch",
    "ByteTokenizer",
    "TextDataset",
    "load_corpus",
]

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<sep>")
PAD_ID, BOS_ID, EOS_ID, SEP_ID = 256, 257, 258, 259
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, specials 256..259 (see :data:`SPECIAL_TOKENS`)."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> torch.Tensor:
        """``text`` -> ``[n]`` int64 token ids (``<bos>``/``<eos>`` around it if asked)."""
        ids = list(text.encode("utf-8"))
        return torch.tensor(([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else []),
                            dtype=torch.int64)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Token ids -> text; specials are dropped, invalid UTF-8 is replaced."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(v for v in values if 0 <= v < 256).decode("utf-8", errors="replace")


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


@dataclass(frozen=True)
class Batch:
    """One rank's share of a step's batch (all int64).

    Attributes:
        input_ids: ``[b, s]`` tokens (``b`` rows of this dp rank, ``s`` = this CP shard).
        labels: ``[b, s]`` next tokens.
        position_ids: ``[s]`` absolute positions of the shard's tokens.
        global_tokens: number of labelled tokens in the whole global batch (all dp, all cp).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    global_tokens: int


class TextDataset:
    """Deterministic windows of the token stream (see the module docstring).

    Args:
        seq_len: global sequence length S (tokens per row, split over CP ranks).
        batch_size: rows per data-parallel rank.
        dp: data-parallel degree (rows of the global batch = ``dp * batch_size``).
        seed: base seed; step ``s`` uses ``seed * 1_000_003 + s``.
        corpus: path of a text file, or None for the packaged corpus.
    """

    def __init__(self, seq_len: int, batch_size: int = 1, dp: int = 1, seed: int = 0,
                 corpus: str | Path | None = None) -> None:
        if seq_len < 1 or batch_size < 1 or dp < 1:
            raise ValueError(f"seq_len={seq_len}, batch_size={batch_size}, dp={dp} must be >= 1")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp = dp
        self.seed = seed
        self.tokens = ByteTokenizer().encode(load_corpus(corpus))

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, each ``[dp * batch_size, seq_len]`` int64, of step ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = self.dp * self.batch_size
        n = self.tokens.numel()
        starts = torch.randint(0, n, (rows,), generator=gen)
        idx = (starts[:, None] + torch.arange(self.seq_len + 1)) % n
        windows = self.tokens[idx]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def rank_batch(self, step: int, dp_rank: int = 0, cp_rank: int = 0, cp: int = 1) -> Batch:
        """This rank's rows (dp) and contiguous sequence shard (cp) of step ``step``."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp {self.dp}")
        inputs, labels = self.global_batch(step)
        rows = slice(dp_rank * self.batch_size, (dp_rank + 1) * self.batch_size)
        inputs, labels = inputs[rows], labels[rows]
        return Batch(
            input_ids=shard_sequence(inputs, cp, cp_rank, 1, load_balance=None).contiguous(),
            labels=shard_sequence(labels, cp, cp_rank, 1, load_balance=None).contiguous(),
            position_ids=shard_positions(self.seq_len, cp, cp_rank, load_balance=None),
            global_tokens=self.dp * self.batch_size * self.seq_len,
        )
