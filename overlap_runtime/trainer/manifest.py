"""A checkpoint's manifest: every file's size and SHA-256, checked before anything is read.

A checkpoint directory (``step-00000005``) holds DCP's data files (``__<rank>_<i>.distcp``), its
``.metadata`` (a pickle), ``config.json`` and, written last, ``manifest.json``::

    {"format": 1, "algorithm": "sha256",
     "files": {".metadata": {"size": 81234, "sha256": "9f2c..."},
               "__0_0.distcp": {"size": 52428800, "sha256": "0b7a..."}, ...}}

**At save** each rank hashes the files it wrote, right after writing them (in parallel across
ranks: a rank hashes ``1 / world`` of the checkpoint) and leaves the result in a part file
(``.manifest-part-rank<r>.json``); rank 0 merges the parts, hashes ``.metadata`` and
``config.json`` and writes ``manifest.json`` through a temporary name, fsynced, renamed into place
(:func:`write_manifest`), before the directory is committed.

**At load** :func:`verify_checkpoint` compares the directory with its manifest before one byte
of it is unpickled or read into a tensor: the same set of files (a missing, an extra, a
symlinked or a non-regular file is an error), every size, then every hash (in threads: hashlib
releases the GIL). The error names the file and the rule.

Hash: SHA-256. On the machines of this project (x86 with the SHA extensions, OpenSSL) it hashes
1.4 GB/s per core against BLAKE2b's 0.8 GB/s; without those extensions BLAKE2b would be faster.
The manifest names its algorithm, so another can replace it without ambiguity.

What the manifest protects against, and what not (docs/training.md, "Trusting a checkpoint"):
it detects any change of a file after the save - a flipped bit, a truncated or half-copied
file, a file replaced by another - but it sits beside the files, so whoever can rewrite a file
can rewrite the manifest too: it is integrity, not authenticity. Loading never runs code from a
checkpoint either way (``trainer.ckpt_reader``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from overlap_runtime.trainer.errors import CheckpointError

MANIFEST_NAME = "manifest.json"
HASH_ALGORITHM = "sha256"
FORMAT = 1
PART_PREFIX = ".manifest-part-rank"
_CHUNK = 8 << 20  # bytes read per update: large enough that hashing, not Python, dominates
_MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few hundred bytes per file


def _file_digest(path: Path) -> tuple[int, str]:
    """``(size in bytes, hex SHA-256)`` of the file at ``path``, read in 8 MiB chunks."""
    h = hashlib.new(HASH_ALGORITHM)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _hash_files(root: Path, names: Iterable[str], threads: int | None = None
               ) -> dict[str, dict[str, int | str]]:
    """``{name: {"size", "sha256"}}`` of the files ``root / name``, hashed in up to ``threads``
    threads (default: the CPUs this process may use)."""
    names = sorted(set(names))
    if not names:
        return {}
    workers = max(1, min(len(names), threads or len(os.sched_getaffinity(0))))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-hash") as pool:
        digests = list(pool.map(lambda n: _file_digest(root / n), names))
    return {n: {"size": size, HASH_ALGORITHM: digest} for n, (size, digest) in zip(names, digests)}


def _write_json_atomically(path: Path, payload: dict) -> None:
    """``path`` holds ``payload`` completely or not at all (temporary name, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part(directory: Path, rank: int, names: Iterable[str]) -> None:
    """Rank ``rank``'s share of the manifest: the files it wrote in ``directory``, hashed."""
    _write_json_atomically(directory / f"{PART_PREFIX}{rank:05d}.json",
                           {"files": _hash_files(directory, names)})


def _entries(directory: Path) -> dict[str, os.stat_result]:
    """Every entry below ``directory`` by relative path (``lstat``: links are not followed)."""
    out: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in filenames + dirnames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = p.relative_to(directory).as_posix()
            if stat.S_ISDIR(st.st_mode):
                continue
            out[rel] = st
    return out


def write_manifest(directory: Path) -> None:
    """Merge the ranks' parts, hash what no part lists (``.metadata``, ``config.json``) and
    write ``manifest.json`` atomically; the parts are removed. Called by rank 0 once every rank's
    save returned, before the directory is committed.

    Raises:
        CheckpointError: a file is not a regular file.
    """
    files: dict[str, dict[str, int | str]] = {}
    parts = sorted(directory.glob(f"{PART_PREFIX}*.json"))
    for part in parts:
        files.update(json.loads(part.read_text())["files"])
    for part in parts:
        part.unlink()
    entries = _entries(directory)
    for rel, st in entries.items():
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint {directory}: {rel} is not a regular file")
    rest = [rel for rel in entries if rel not in files and rel != MANIFEST_NAME]
    files.update(_hash_files(directory, rest))
    _write_json_atomically(directory / MANIFEST_NAME,
                           {"format": FORMAT, "algorithm": HASH_ALGORITHM, "files": files})


def has_manifest(directory: str | Path) -> bool:
    """Whether ``directory`` holds a ``manifest.json`` (a regular file, not a link)."""
    try:
        return stat.S_ISREG((Path(directory) / MANIFEST_NAME).lstat().st_mode)
    except OSError:
        return False


def _read_manifest(directory: Path) -> dict[str, dict[str, int | str]]:
    """The manifest's ``files``, validated as plain JSON of the expected shape."""
    where = f"checkpoint {directory}"
    path = directory / MANIFEST_NAME
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise CheckpointError(f"{where} has no {MANIFEST_NAME}: it cannot be verified (saved by "
                              f"an older version, or not by this trainer)") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{where}: {MANIFEST_NAME} is not a regular file")
    if st.st_size > _MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where}: {MANIFEST_NAME} is {st.st_size} bytes, more than a "
                              f"manifest can be ({_MAX_MANIFEST_BYTES})")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: {MANIFEST_NAME} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {MANIFEST_NAME} is not a format-{FORMAT} manifest")
    if data.get("algorithm") != HASH_ALGORITHM:
        raise CheckpointError(f"{where}: {MANIFEST_NAME} uses the hash {data.get('algorithm')!r}"
                              f"; this version checks {HASH_ALGORITHM!r}")
    files = data.get("files")
    ok = isinstance(files, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("size"), int)
        and isinstance(v.get(HASH_ALGORITHM), str) for k, v in files.items())
    if not ok or ".metadata" not in files:
        raise CheckpointError(f"{where}: {MANIFEST_NAME} does not list every file with its "
                              f"size and {HASH_ALGORITHM} (.metadata included)")
    return files


def verify_checkpoint(path: str | Path) -> None:
    """Check the checkpoint directory ``path`` against its ``manifest.json`` before anything in
    it is read: the same files (none missing, none extra, no link, only regular files), the same
    sizes, the same SHA-256. Call it before handing a checkpoint to ``dcp.load`` or reading it
    any other way (an export): ``.metadata`` is a pickle.

    Raises:
        CheckpointError: naming the checkpoint, the file and the rule it breaks (no manifest
            included).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory}: not a directory")
    files = _read_manifest(directory)
    where = f"checkpoint {directory}"
    entries = _entries(directory)
    entries.pop(MANIFEST_NAME, None)
    missing = sorted(set(files) - set(entries))
    if missing:
        raise CheckpointError(f"{where}: {missing[0]} is missing (listed in its manifest"
                              + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else "")
                              + ")")
    extra = sorted(set(entries) - set(files))
    if extra:
        raise CheckpointError(f"{where}: {extra[0]} is not listed in its manifest (a file added "
                              f"after the save)")
    for rel in sorted(files):
        st = entries[rel]
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where}: {rel} is not a regular file (a link or a device); "
                                  f"a checkpoint holds plain files only")
        if st.st_size != files[rel]["size"]:
            raise CheckpointError(f"{where}: {rel} is {st.st_size} bytes, its manifest says "
                                  f"{files[rel]['size']} (truncated or changed after the save)")
    actual = _hash_files(directory, files)
    for rel in sorted(files):
        if actual[rel][HASH_ALGORITHM] != files[rel][HASH_ALGORITHM]:
            raise CheckpointError(f"{where}: {rel} does not match its {HASH_ALGORITHM} in the "
                                  f"manifest (its bytes changed after the save)")
