"""Helpers of the data tests: a tiny tokenizer trained here and tiny document files."""

from __future__ import annotations

import json
from pathlib import Path

DOCS = [
    "the cat sat on the mat",
    "a dog ran in the park and the dog sat",
    "birds sing in the morning",
    "the sun is warm and the sky is blue",
    "fish swim in the cold river",
    "a cat and a dog play in the sun",
    "the river runs to the sea",
]
SPECIALS = ["<unk>", "<pad>", "<bos>", "<eos>"]


def make_tokenizer(path: Path, texts: list[str] = DOCS) -> Path:
    """Train a word-level tokenizer on ``texts`` (plus specials) and save it to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    tok.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str] = DOCS, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def write_text(path: Path, texts: list[str] = DOCS) -> Path:
    """One document per blank-line-separated block (blocks of one or two lines)."""
    blocks = [t.replace(" and ", "\nand ", 1) for t in texts]
    path.write_text("\n\n \n".join(blocks) + "\n")
    return path


def write_parquet(path: Path, texts: list[str] = DOCS, field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), str(path))
    return path
