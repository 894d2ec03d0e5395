"""Local training documents: text, JSONL and Parquet files, tokenised once at start-up.

Formats (``data.format``; None: from the files' extensions, which must agree):

* ``text`` (``.txt``): UTF-8. **A document is a block of lines separated by one or more blank
  (whitespace-only) lines**; each block is stripped, so a file without blank lines is one
  document. Read with Python (no extra package).
* ``jsonl`` (``.jsonl``, ``.json``): one JSON object per line; the document is the string in
  ``data.text_field`` (default ``"text"``). Read through Hugging Face ``datasets`` (the
  packaged ``json`` builder: local files only, nothing is downloaded).
* ``parquet`` (``.parquet``): the string column ``data.text_field``, through ``datasets``.

``data.files`` lists files or directories; a directory contributes the files with its format's
extensions below it (recursively, sorted by path). Documents keep the order of the list, then of
the rows. Empty or whitespace-only documents are skipped.

Tokenizers: the byte tokenizer (``data.tokenizer: null``, :class:`ByteTokenizer`, vocabulary 260)
or a Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``
(:func:`load_tokenizer`). Each document becomes ``[bos] ids <eos>`` (``bos`` only when
``data.bos_token`` is set); the tokenizer's own post-processor is not applied
(``add_special_tokens=False``), so the config alone says which specials surround a document.

Limit (documented in docs/training.md): every rank reads and tokenises the whole dataset at
start-up and keeps it in memory as one int32 token array (4 bytes a token) plus int64 document
offsets (8 bytes a document). That suits local datasets up to a few hundred million tokens;
larger corpora need pre-tokenised shards (not implemented).

``datasets`` and ``tokenizers`` are imported only when a JSONL/Parquet file or a tokenizer file
is used; a missing one raises ImportError naming ``pip install overlap_runtime[data]``.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import torch

from overlap_runtime.trainer.byte_tokenizer import ByteTokenizer

__all__ = [
    "FORMAT_EXTENSIONS",
    "ByteTokenizer",
    "DataTokenizer",
    "HFTokenizer",
    "TokenizedDocuments",
    "file_fingerprint",
    "load_tokenizer",
    "read_documents",
    "require_extra",
    "resolve_files",
    "tokenize_documents",
]

FORMAT_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
}
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")  # one or more blank lines (after \n-normalising)
_ENCODE_BATCH = 1024


def require_extra(module: str, what: str) -> Any:
    """Import the optional package ``module`` (``datasets``, ``tokenizers``) for ``what``.

    Raises:
        ImportError: naming ``pip install overlap_runtime[data]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs the optional package {module!r}, which is not "
                          f"importable ({exc}); pip install overlap_runtime[data]") from None


def resolve_files(files: list[str], fmt: str | None) -> tuple[str, list[Path]]:
    """``data.files`` -> ``(format, sorted files)``: directories expanded, format inferred.

    Raises:
        ValueError: naming ``data.files[i]`` (missing, not a file/directory, an empty directory,
            an unknown extension) or ``data.format`` (extensions that disagree with it).
    """
    if not files:
        raise ValueError("data.files is empty: list at least one file or directory")
    known = {ext: name for name, exts in FORMAT_EXTENSIONS.items() for ext in exts}
    wanted = FORMAT_EXTENSIONS[fmt] if fmt is not None else tuple(known)
    out: list[Path] = []
    for i, entry in enumerate(files):
        p = Path(entry)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in wanted)
            if not found:
                raise ValueError(f"data.files[{i}]={entry!r} is a directory without files ending "
                                 f"in {', '.join(wanted)}")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise ValueError(f"data.files[{i}]={entry!r} is neither a regular file nor a "
                             f"directory")
        else:
            raise ValueError(f"data.files[{i}]={entry!r}: no such file or directory")
    formats = set()
    for f in out:
        ext = f.suffix.lower()
        if ext not in known:
            raise ValueError(f"data.files: {str(f)!r} has the unknown extension {ext!r} (known: "
                             f"{', '.join(sorted(known))}); set data.format to read it anyway")
        formats.add(known[ext])
    if fmt is None:
        if len(formats) > 1:
            raise ValueError(f"data.files mixes formats {sorted(formats)}; use one format per "
                             f"run (data.format)")
        fmt = formats.pop()
    return fmt, out


def file_fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """``[{"path", "size", "mtime_ns"}]`` of each file (resolved path) for the data state."""
    out = []
    for p in paths:
        st = p.stat()
        out.append({"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


class DataTokenizer(Protocol):
    """What the data pipeline needs of a tokenizer."""

    name: str          # "byte" or the tokenizer file's path
    sha256: str        # "byte" or the tokenizer file's hash (the data fingerprint)
    vocab_size: int    # ids are in [0, vocab_size)

    def token_id(self, token: str) -> int | None:
        """The id of a special/vocabulary token, None if the tokenizer lacks it."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no specials added."""


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` read from a local ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        tokenizers = require_extra("tokenizers", f"data.tokenizer={str(path)!r}")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises its own Exception type
            raise ValueError(f"data.tokenizer={str(path)!r} is not a tokenizers JSON file: "
                             f"{exc}") from None
        self.name = str(path)
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(path: str | None) -> DataTokenizer:
    """The byte tokenizer (``None``) or the ``tokenizer.json`` at ``path`` (cached per file
    content: size and mtime).

    Raises:
        ValueError: naming ``data.tokenizer`` (missing, unreadable or not a tokenizer file);
        ImportError: ``tokenizers`` is not installed.
    """
    if path is None:
        return ByteTokenizer()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data.tokenizer={path!r}: no such file (a local tokenizer.json of "
                         f"Hugging Face tokenizers)")
    st = p.stat()
    return _load_hf(str(p.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _load_hf(path: str, size: int, mtime_ns: int) -> HFTokenizer:
    return HFTokenizer(Path(path))


def _text_documents(path: Path) -> list[str]:
    try:
        text = path.read_text("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"data.files: {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    text = text.replace("\r\n", "\n")
    return [block.strip() for block in _BLANK_LINES.split(text)]


def _hf_documents(fmt: str, paths: list[Path], text_field: str) -> list[str]:
    """The ``text_field`` column of JSONL/Parquet files through ``datasets`` (in memory; its
    Arrow cache goes to a temporary directory removed afterwards)."""
    datasets = require_extra("datasets", f"data.format={fmt!r}")
    builder = "json" if fmt == "jsonl" else "parquet"
    out: list[str] = []
    cache = tempfile.mkdtemp(prefix="overlap_runtime_data_")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per file and rank at start-up is noise
    try:
        for path in paths:  # one file at a time: errors name the file
            try:
                ds = datasets.load_dataset(builder, data_files=[str(path)], split="train",
                                           cache_dir=cache, keep_in_memory=True)
            except Exception as exc:
                raise ValueError(f"data.files: cannot read {str(path)!r} as {fmt}: "
                                 f"{type(exc).__name__}: {exc}") from None
            if text_field not in ds.column_names:
                raise ValueError(f"data.text_field={text_field!r} is not a field of "
                                 f"{str(path)!r} (fields: {', '.join(ds.column_names)})")
            column = ds[text_field]
            for row, value in enumerate(column):
                if not isinstance(value, str):
                    raise ValueError(f"data.text_field={text_field!r}: row {row} of "
                                     f"{str(path)!r} holds {type(value).__name__}, not a string")
            out.extend(column)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()
    return out


def read_documents(fmt: str, paths: list[Path], text_field: str = "text") -> list[str]:
    """Every non-empty document of ``paths`` in order (see the module docstring).

    Raises:
        ValueError: naming the file (undecodable, unreadable), ``data.text_field`` (absent, not a
            string) or ``data.files`` (no document at all).
    """
    if fmt not in FORMAT_EXTENSIONS:
        raise ValueError(f"data.format={fmt!r} is unknown (known: "
                         f"{', '.join(FORMAT_EXTENSIONS)})")
    if fmt == "text":
        docs = [d for p in paths for d in _text_documents(p)]
    else:
        docs = _hf_documents(fmt, paths, text_field)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"data.files: no non-empty document in {len(paths)} {fmt} file(s)")
    return docs


@dataclass(frozen=True)
class TokenizedDocuments:
    """Every document's tokens, concatenated.

    Attributes:
        tokens: ``[N]`` int32, documents back to back, each ``[bos] ids <eos>``.
        offsets: ``[D + 1]`` int64; document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_documents(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """``[D]`` int64 tokens per document."""
        return self.offsets[1:] - self.offsets[:-1]

    def document(self, d: int) -> torch.Tensor:
        """Document ``d``'s tokens ``[n]`` int64."""
        return self.tokens[int(self.offsets[d]):int(self.offsets[d + 1])].long()


def tokenize_documents(texts: list[str], tokenizer: DataTokenizer, bos_id: int | None,
                       eos_id: int) -> TokenizedDocuments:
    """Tokenise ``texts`` in batches into ``[bos] ids <eos>`` documents (module docstring)."""
    pieces: list[torch.Tensor] = []
    lengths: list[int] = []
    head = [bos_id] if bos_id is not None else []
    for i in range(0, len(texts), _ENCODE_BATCH):
        for ids in tokenizer.encode_batch(texts[i:i + _ENCODE_BATCH]):
            doc = torch.tensor(head + list(ids) + [eos_id], dtype=torch.int32)
            pieces.append(doc)
            lengths.append(doc.numel())
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return TokenizedDocuments(torch.cat(pieces), offsets)
