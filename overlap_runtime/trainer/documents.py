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

A file that cannot be read is a :class:`~overlap_runtime.trainer.errors.DataError` naming the file
and, where there is one, the line (JSONL, text) or row (Parquet). :func:`check_first_records`
reads the first records of every file (the first 100 lines or rows, the first MiB of text)
before any rank starts, so the common mistakes - an empty file, a file that is not UTF-8, a
malformed JSON line, a corrupt Parquet file, a missing or non-string text field - are one line
from the launcher instead of a failure inside every rank.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from overlap_runtime.config.byte_tokenizer import ByteTokenizer
from overlap_runtime.config.data_sources import (FORMAT_EXTENSIONS, DataTokenizer, HFTokenizer,
                                                 load_tokenizer, require_extra, resolve_files)
from overlap_runtime.trainer.errors import DataError

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")  # one or more blank lines (after \n-normalising)
_ENCODE_BATCH = 1024


def file_fingerprint(paths: list[Path]) -> list[dict[str, Any]]:
    """``[{"path", "size", "mtime_ns"}]`` of each file (resolved path) for the data state."""
    out = []
    for p in paths:
        st = p.stat()
        out.append({"path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


_FIRST_LINES = 100       # JSONL lines / Parquet rows read per file before the ranks start
_FIRST_BYTES = 1 << 20   # bytes of a text file decoded before the ranks start


def _not_utf8(path: Path, data: bytes, exc: UnicodeDecodeError, line0: int = 0) -> DataError:
    line = line0 + data[:exc.start].count(b"\n") + 1
    return DataError(f"data.files: {str(path)!r} line {line} is not UTF-8 text ({exc.reason} at "
                     f"byte {exc.start})")


def _text_documents(path: Path) -> list[str]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data, exc) from None
    text = text.replace("\r\n", "\n")
    return [block.strip() for block in _BLANK_LINES.split(text)]


def _jsonl_problem(path: Path, text_field: str, max_lines: int | None) -> str | None:
    """The first problem of JSONL file ``path`` within its first ``max_lines`` non-blank lines
    (None: all), naming the line; None when those lines are objects holding a string
    ``text_field``. A file starting with ``[`` (one JSON array, which ``datasets`` also reads)
    is only checked for UTF-8 here."""
    import codecs
    import json

    name = repr(str(path))
    seen = 0
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        if head.lstrip()[:1] == b"[":
            try:
                codecs.getincrementaldecoder("utf-8")().decode(head)
            except UnicodeDecodeError as exc:
                return str(_not_utf8(path, head, exc))
            return None
        f.seek(0)
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            seen += 1
            if max_lines is not None and seen > max_lines:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return (f"data.files: {name} line {number} is not UTF-8 text ({exc.reason} at "
                        f"byte {exc.start} of the line)")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                return (f"data.files: {name} line {number} is not valid JSON ({exc.msg} at "
                        f"column {exc.colno})")
            if not isinstance(record, dict):
                return (f"data.files: {name} line {number} is a JSON "
                        f"{type(record).__name__}, not an object (one object per line)")
            if text_field not in record:
                return (f"data.text_field={text_field!r} is not a field of {name} line {number} "
                        f"(fields: {', '.join(map(str, record)) or 'none'})")
            if not isinstance(record[text_field], str):
                return (f"data.text_field={text_field!r}: {name} line {number} holds "
                        f"{type(record[text_field]).__name__}, not a string")
    if seen == 0:
        return f"data.files: {name} is empty (no JSON line)"
    return None


def _parquet_problem(path: Path, text_field: str, max_rows: int) -> str | None:
    """The first problem of Parquet file ``path``: unreadable footer, ``text_field`` missing or
    not a string column, no rows, or a null among its first ``max_rows`` values."""
    pq = require_extra("pyarrow.parquet", f"data.files: {str(path)!r}")
    import pyarrow as pa

    name = repr(str(path))
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError... for a corrupt file
        return f"data.files: {name} is not a readable Parquet file ({type(exc).__name__}: {exc})"
    schema = pf.schema_arrow
    if text_field not in schema.names:
        return (f"data.text_field={text_field!r} is not a field of {name} (fields: "
                f"{', '.join(schema.names)})")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f"data.text_field={text_field!r}: column of {name} is {kind}, not a string"
    if pf.metadata.num_rows == 0:
        return f"data.files: {name} is empty (no row)"
    try:
        first = next(pf.iter_batches(batch_size=max_rows, columns=[text_field]))
    except Exception as exc:
        return f"data.files: {name}: cannot read its first rows ({type(exc).__name__}: {exc})"
    for row, value in enumerate(first.column(0).to_pylist()):
        if not isinstance(value, str):
            return (f"data.text_field={text_field!r}: row {row} of {name} holds "
                    f"{type(value).__name__}, not a string")
    return None


def _text_problem(path: Path) -> str | None:
    """The first MiB of text file ``path`` is UTF-8 and the file holds a non-blank line."""
    import codecs

    with open(path, "rb") as f:
        head = f.read(_FIRST_BYTES)
        whole = not f.read(1)
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as exc:
        return str(_not_utf8(path, head, exc))
    if whole and not text.strip():
        return f"data.files: {str(path)!r} is empty (no document)"
    return None


def check_first_records(data: Any) -> None:
    """Read the first records of every file of ``data.files`` (``DataConfig``): the first 100
    JSONL lines / Parquet rows, the first MiB of text; raise on the first problem.

    Raises:
        DataError: naming the file and the line or row (module docstring).
    """
    fmt, paths = resolve_files(data.files, data.format)
    for path in paths:
        try:
            if fmt == "text":
                problem = _text_problem(path)
            elif fmt == "jsonl":
                problem = _jsonl_problem(path, data.text_field, _FIRST_LINES)
            else:
                problem = _parquet_problem(path, data.text_field, _FIRST_LINES)
        except OSError as exc:
            problem = f"data.files: cannot read {str(path)!r}: {exc.strerror}"
        if problem is not None:
            raise DataError(problem)


def _hf_documents(fmt: str, paths: list[Path], text_field: str) -> list[str]:
    """The ``text_field`` column of JSONL/Parquet files through ``datasets`` (in memory; its
    Arrow cache goes to a temporary directory removed afterwards)."""
    datasets = require_extra("datasets", f"data.format={fmt!r}")
    builder = "json" if fmt == "jsonl" else "parquet"
    out: list[str] = []
    cache = tempfile.mkdtemp(prefix="overlap_runtime_data_")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per file and rank at start-up is noise
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are raised, named
    try:
        for path in paths:  # one file at a time: errors name the file
            problem = (_jsonl_problem(path, text_field, _FIRST_LINES) if fmt == "jsonl"
                       else _parquet_problem(path, text_field, _FIRST_LINES))
            if problem is not None:
                raise DataError(problem)
            try:
                ds = datasets.load_dataset(builder, data_files=[str(path)], split="train",
                                           cache_dir=cache, keep_in_memory=True)
            except Exception as exc:
                # datasets names neither line nor row: find the first bad line ourselves
                problem = _jsonl_problem(path, text_field, None) if fmt == "jsonl" else None
                raise DataError(problem or f"data.files: cannot read {str(path)!r} as {fmt}: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
            if text_field not in ds.column_names:
                raise DataError(f"data.text_field={text_field!r} is not a field of "
                                f"{str(path)!r} (fields: {', '.join(ds.column_names)})")
            column = ds[text_field]
            for row, value in enumerate(column):
                if not isinstance(value, str):
                    raise DataError(f"data.text_field={text_field!r}: row {row} of "
                                    f"{str(path)!r} holds {type(value).__name__}, not a string")
            out.extend(column)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        datasets.logging.set_verbosity(verbosity)
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
        raise DataError(f"data.files: no non-empty document in {len(paths)} {fmt} file(s)")
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
