"""A Hugging Face model directory's safetensors, read region by region.

A directory holds ``model.safetensors``, or shards named by ``model.safetensors.index.json``
(``{"weight_map": {key: file}}``). :class:`SafetensorsDir` knows every key's file, shape and
dtype from the files' headers, and :meth:`SafetensorsDir.reader` returns a reader whose
``read(key, slices)`` copies just that region out of the memory-mapped file: a rank touches only
the pages of its share, and the mapping is closed when the reader's block ends, so its pages
leave the process's resident set (peak: the rank's share plus the region being copied).
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:  # an optional dependency of the runtime
        raise ImportError("reading Hugging Face checkpoints needs safetensors: pip install "
                          "safetensors (or overlap_runtime[hf])") from exc
    return safe_open


class SafetensorsDir:
    """The safetensors of ``directory`` (see the module docstring).

    Raises:
        FileNotFoundError: neither an index nor ``model.safetensors`` is there, or the index
            names a missing file.
        ValueError: an index without a ``weight_map``.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / _INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (KeyError, TypeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{index}: not a safetensors index with a weight_map "
                                 f"({exc})") from None
            self.file_of: dict[str, Path] = {k: self.directory / f for k, f in weight_map.items()}
        elif (self.directory / _SINGLE).is_file():
            self.file_of = {}
            safe_open = _safe_open()
            with safe_open(str(self.directory / _SINGLE), "pt") as f:
                for k in f.keys():
                    self.file_of[k] = self.directory / _SINGLE
        else:
            raise FileNotFoundError(f"{self.directory}: no {_INDEX} and no {_SINGLE} (a Hugging "
                                    f"Face model directory holds one of them)")
        for f in sorted(set(self.file_of.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{index}: names {f.name}, which does not exist")
        self._meta: dict[str, tuple[tuple[int, ...], str]] | None = None

    @property
    def keys(self) -> set[str]:
        return set(self.file_of)

    def meta(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype string)}`` from the file headers (read once)."""
        if self._meta is None:
            safe_open = _safe_open()
            out: dict[str, tuple[tuple[int, ...], str]] = {}
            for path in sorted(set(self.file_of.values())):
                with safe_open(str(path), "pt") as f:
                    for k in f.keys():
                        s = f.get_slice(k)
                        out[k] = (tuple(s.get_shape()), s.get_dtype())
            self._meta = out
        return self._meta

    def total_bytes(self) -> int:
        """Bytes of all the files."""
        return sum(p.stat().st_size for p in set(self.file_of.values()))

    @contextmanager
    def reader(self) -> Iterator["SafetensorsReader"]:
        """A reader whose files stay mapped until the block ends."""
        with ExitStack() as stack:
            yield SafetensorsReader(self, stack)


class SafetensorsReader:
    """Reads regions of stored tensors (from :meth:`SafetensorsDir.reader`)."""

    def __init__(self, owner: SafetensorsDir, stack: ExitStack) -> None:
        self._owner = owner
        self._stack = stack
        self._open: dict[Path, Any] = {}

    def read(self, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """A copy of ``stored[key][slices]`` in its stored dtype.

        Raises:
            KeyError: ``key`` is not in the checkpoint.
        """
        try:
            path = self._owner.file_of[key]
        except KeyError:
            raise KeyError(f"{self._owner.directory}: no tensor {key!r}") from None
        f = self._open.get(path)
        if f is None:
            f = self._stack.enter_context(_safe_open()(str(path), "pt"))
            self._open[path] = f
        return f.get_slice(key)[slices]
