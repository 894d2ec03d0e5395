"""Reading a DCP checkpoint without running code from it.

``torch.distributed.checkpoint`` reads ``.metadata`` with ``pickle.load`` and every non-tensor
value (the step, the optimizer's ``lr`` and ``betas``, the data position) with
``torch.load(weights_only=False)``: a crafted file runs whatever it names. The two classes here
replace both reads:

* :class:`SafeFileSystemReader` unpickles ``.metadata`` through an allow-list: DCP's metadata
  classes, ``torch.Size``, dtypes, layouts, ``pathlib`` paths; any other global (``os.system``,
  ``builtins.eval``, a class with a ``__reduce__``) raises :class:`CheckpointError` naming it;
* :class:`SafeLoadPlanner` reads non-tensor values with ``torch.load(weights_only=True)``
  (primitives, containers, tensors).

Tensors are already read with ``weights_only=True`` by DCP. This is the second wall: the first is
the manifest (``trainer.manifest``), checked before either read.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from overlap_runtime.trainer.errors import CheckpointError

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_META, "Metadata"), (_DCP_META, "MetadataIndex"), (_DCP_META, "StorageMeta"),
    (_DCP_META, "TensorStorageMetadata"), (_DCP_META, "BytesStorageMetadata"),
    (_DCP_META, "ChunkStorageMetadata"), (_DCP_META, "TensorProperties"),
    (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.source} names {module}.{name}, which a checkpoint's "
                              f"metadata never holds: refusing to unpickle it (it could run "
                              f"code)")


def _safe_load_metadata(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata ``data`` through the allow-list (``source`` names it in errors)."""
    try:
        return _AllowListUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled pickle
        raise CheckpointError(f"{source} is not readable DCP metadata: "
                              f"{type(exc).__name__}: {exc}") from None


class SafeFileSystemReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose ``.metadata`` goes through :func:`_safe_load_metadata`,
    read when the reader is made: a bad file is a :class:`CheckpointError` here, before DCP
    (which would log a traceback and retry other files) ever reads it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        meta = Path(path) / ".metadata"
        try:
            data = meta.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read .metadata: "
                                  f"{exc.strerror}") from None
        self._metadata = _safe_load_metadata(data, str(meta))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:  # DCP's per-rank fallback: never written here
            raise CheckpointError(f"checkpoint {self.path}: no per-rank metadata")
        metadata = copy.copy(self._metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        else:
            metadata.storage_meta = copy.copy(metadata.storage_meta)
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn!r} is not plain "
                                  f"data (refused by torch.load(weights_only=True)): "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        # what DefaultLoadPlanner.load_bytes does with the value it loaded
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
