"""The data sources the ``data`` section names, as far as loading the configuration checks them:
``data.files`` resolved to one format (:func:`resolve_files`), the tokenizer (the byte tokenizer
or a local ``tokenizer.json``, :func:`load_tokenizer`) and its special tokens
(:func:`special_ids`). The trainer's ``documents`` / ``packed_dataset`` read and pack the
documents with the same functions.

The optional ``tokenizers`` package is imported only when a ``tokenizer.json`` is loaded.
"""

from __future__ import annotations

import hashlib
import importlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from overlap_runtime.config.byte_tokenizer import ByteTokenizer

FORMAT_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "text": (".txt",),
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
}


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


def special_ids(tokenizer: DataTokenizer, bos_token: str | None,
                eos_token: str) -> tuple[int | None, int]:
    """``(bos_id, eos_id)`` of ``data.bos_token`` / ``data.eos_token`` in ``tokenizer``.

    Raises:
        ValueError: naming the field whose token the tokenizer lacks.
    """
    ids: dict[str, int | None] = {}
    for field, token in (("bos_token", bos_token), ("eos_token", eos_token)):
        if token is None:
            ids[field] = None
            continue
        tid = tokenizer.token_id(token)
        if tid is None:
            raise ValueError(f"data.{field}={token!r} is not a token of the tokenizer "
                             f"{tokenizer.name!r} (add it as a special token, or name one it "
                             f"has)")
        ids[field] = tid
    eos = ids["eos_token"]
    assert eos is not None
    return ids["bos_token"], eos
