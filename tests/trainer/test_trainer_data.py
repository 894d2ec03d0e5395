"""Training data: the packaged corpus, byte-level tokens, per-step windows, contiguous CP split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overlap_runtime.trainer import VOCAB_SIZE, ByteTokenizer, TextDataset, load_corpus
from overlap_runtime.trainer.data import BOS_ID, EOS_ID


def test_packaged_corpus_is_real_english_text() -> None:
    text = load_corpus()
    assert 20_000 <= len(text.encode()) <= 100_000
    words = text.split()
    assert len(words) > 4000
    common = sum(w.lower() in {"the", "and", "of", "a", "to", "in"} for w in words)
    assert common / len(words) > 0.1          # ordinary prose, not random bytes
    assert text.isascii()


def test_tokenizer_round_trip_and_vocab() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo, world")
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and ids.dtype == torch.int64
    assert int(ids.max()) < VOCAB_SIZE == 260
    assert tok.decode(ids) == "héllo, world"
    assert len(ids) == len("héllo, world".encode()) + 2


def test_each_step_draws_a_different_deterministic_window() -> None:
    data = TextDataset(seq_len=64, batch_size=2, dp=2, seed=7)
    x0, y0 = data.global_batch(0)
    x1, _ = data.global_batch(1)
    assert x0.shape == y0.shape == (4, 64)
    assert not torch.equal(x0, x1)
    assert torch.equal(x0, TextDataset(64, 2, 2, seed=7).global_batch(0)[0])
    assert not torch.equal(x0, TextDataset(64, 2, 2, seed=8).global_batch(0)[0])
    # labels are the inputs shifted by one token of the stream
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    steps = {tuple(data.global_batch(s)[0][0, :8].tolist()) for s in range(20)}
    assert len(steps) == 20


def test_rank_batches_tile_the_global_batch_contiguously() -> None:
    data = TextDataset(seq_len=64, batch_size=2, dp=2, seed=1)
    inputs, labels = data.global_batch(3)
    cp = 4
    for dp_rank in range(2):
        shards = [data.rank_batch(3, dp_rank, r, cp) for r in range(cp)]
        rows = slice(2 * dp_rank, 2 * dp_rank + 2)
        assert torch.equal(torch.cat([b.input_ids for b in shards], 1), inputs[rows])
        assert torch.equal(torch.cat([b.labels for b in shards], 1), labels[rows])
        assert torch.equal(torch.cat([b.position_ids for b in shards]), torch.arange(64))
        assert all(b.global_tokens == 4 * 64 for b in shards)
    # the label of a shard's last token is the next shard's first input token
    b0, b1 = data.rank_batch(3, 0, 0, cp), data.rank_batch(3, 0, 1, cp)
    assert torch.equal(b0.labels[:, -1], b1.input_ids[:, 0])


def test_long_windows_wrap_around_the_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("abc")
    data = TextDataset(seq_len=20, corpus=corpus)
    x, _ = data.global_batch(0)
    assert x.shape == (1, 20)
    assert set(x.flatten().tolist()) <= {BOS_ID, EOS_ID, ord("a"), ord("b"), ord("c")}


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data.corpus"):
        load_corpus(tmp_path / "nope.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(empty)
    with pytest.raises(ValueError, match="dp_rank 2"):
        TextDataset(16, dp=2).rank_batch(0, dp_rank=2)
