"""The resumable state of a dataset: its position and a fingerprint of the data.

Every dataset's batch is a pure function of the step, so the position is one number, the next
step to serve. The fingerprint records what makes step ``s`` mean the same tokens: the files
(resolved path, size, mtime), the tokenizer (file hash), the format and text field, the special
ids, ``seq_len``, rows per step, packing and seed. :func:`_check_state` compares a checkpoint's
fingerprint with the current one and names every field that changed, so a resume on different
data fails instead of silently reading other tokens.

::

    {"version": 1, "next_step": 120,
     "fingerprint": {"kind": "packed", "files": [{"path", "size", "mtime_ns"}, ...],
                     "tokenizer": "<sha256>", "seq_len": 256, "packing": "concat", ...}}
"""

from __future__ import annotations

from typing import Any

STATE_VERSION = 1


class DataStateMismatch(ValueError):
    """A dataset state from a checkpoint does not describe the data of this run."""


def _make_state(next_step: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The state dict: ``{"version", "next_step", "fingerprint"}`` (module docstring)."""
    return {"version": STATE_VERSION, "next_step": int(next_step), "fingerprint": fingerprint}


def _describe_files(old: Any, new: Any) -> str:
    if not isinstance(old, list) or not isinstance(new, list):
        return f"{old!r} -> {new!r}"
    old_by_path = {f.get("path"): f for f in old if isinstance(f, dict)}
    new_by_path = {f.get("path"): f for f in new if isinstance(f, dict)}
    parts = [f"{p} removed" for p in old_by_path if p not in new_by_path]
    parts += [f"{p} added" for p in new_by_path if p not in old_by_path]
    for p, f in new_by_path.items():
        o = old_by_path.get(p)
        if o is None:
            continue
        changed = [f"{k} {o.get(k)} -> {f.get(k)}" for k in ("size", "mtime_ns")
                   if o.get(k) != f.get(k)]
        if changed:
            parts.append(f"{p} changed ({', '.join(changed)})")
    if not parts and [f.get("path") for f in old] != [f.get("path") for f in new]:
        parts.append("the order of the files changed")
    return "; ".join(parts)


def _check_state(state: dict[str, Any], fingerprint: dict[str, Any]) -> int:
    """The ``next_step`` of ``state`` once its fingerprint matches ``fingerprint``.

    Raises:
        DataStateMismatch: naming each fingerprint field that differs (files: which file was
            added, removed or changed size/mtime), or a malformed / other-version state.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise DataStateMismatch(f"data state: expected version {STATE_VERSION}, got {got!r}")
    step = state.get("next_step")
    if not isinstance(step, int) or step < 0:
        raise DataStateMismatch(f"data state: next_step={step!r} must be an int >= 0")
    old = state.get("fingerprint")
    if not isinstance(old, dict):
        raise DataStateMismatch("data state: no fingerprint")
    diffs = []
    for key in sorted(set(old) | set(fingerprint)):
        a, b = old.get(key), fingerprint.get(key)
        if a == b:
            continue
        what = _describe_files(a, b) if key == "files" else f"{a!r} -> {b!r}"
        diffs.append(f"{key}: {what}")
    if diffs:
        raise DataStateMismatch("the checkpoint's data differs from this run's, so its position "
                                "would read other tokens:\n  " + "\n  ".join(diffs))
    return step


class StepPositionState:
    """``state_dict`` / ``load_state_dict`` of a dataset whose batch is a pure function of the
    step: ``position`` (the next step to serve) and ``fingerprint()`` (what a step's tokens
    depend on) make the state (``{"version", "next_step", "fingerprint"}``)."""

    position: int

    def fingerprint(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "next_step", "fingerprint"}``: the next step to serve and the data."""
        return _make_state(self.position, self.fingerprint())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["next_step"]`` after checking the fingerprint.

        Raises:
            DataStateMismatch: naming every field of the data that changed.
        """
        self.position = _check_state(state, self.fingerprint())
