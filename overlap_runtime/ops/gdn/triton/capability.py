"""What the Triton backend runs, checked before anything is launched (imports no triton).

Rules (each failure raises ``NotImplementedError`` naming the value and the rule; the backend
never falls back to another):

* chunk size 64;
* q, k, v one of bf16 / fp16 / fp32 (bf16 is the production dtype; fp32 runs the same kernels
  with fp32 storage, tf32 products on NVIDIA GPUs); beta bf16 / fp16 / fp32; g fp32;
  initial_state fp32;
* K and V in {64, 128}; 16 and 32 are accepted too, for tests under the CPU interpreter
  (they run, they are not tuned);
* device ``cuda``; ``npu`` with triton-ascend >= 3.2.1, < 3.3; ``cpu`` only under
  ``TRITON_INTERPRET=1`` (set before triton is first imported);
* every per-token tensor below 2^31 elements: ``B * T * max(H, HV) * max(K, V, 64) < 2^31``
  (the kernels index tokens with int32 offsets; split the batch to go beyond);
* the ``triton`` package importable.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
TEST_HEAD_DIMS = (16, 32)
_IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ASCEND_RANGE = ((3, 2, 1), (3, 3, 0))
_MAX_ELEMENTS = 2**31


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _fail(message: str) -> None:
    raise NotImplementedError(f"GDN backend='triton': {message} (there is no automatic fallback; "
                              "use backend='eager' explicitly)")


def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, initial_state: torch.Tensor | None,
                        chunk_size: int) -> None:
    """Raise ``NotImplementedError`` with the reason if the Triton kernels cannot run these
    inputs. Called after the shared layout validation (shapes are consistent)."""
    if chunk_size != 64:
        _fail(f"chunk_size={chunk_size} is not supported: the kernels use chunk size 64")
    if q.dtype not in _IO_DTYPES:
        _fail(f"q/k/v dtype {q.dtype} is not supported: use bf16, fp16 or fp32")
    if beta.dtype not in _IO_DTYPES:
        _fail(f"beta dtype {beta.dtype} is not supported: use bf16, fp16 or fp32")
    if g.dtype != torch.float32:
        _fail(f"g dtype {g.dtype} is not supported: the log decay must be float32")
    if initial_state is not None and initial_state.dtype != torch.float32:
        _fail(f"initial_state dtype {initial_state.dtype} is not supported: use float32")
    # head dims below 64 give column blocks below 64: they run under the CPU interpreter (the
    # tests' sizes) and have never run on a GPU, where a forced block of 32 hit an illegal
    # memory access (docs/gdn.md): refused there
    interpreted = q.device.type == "cpu"
    allowed = SUPPORTED_HEAD_DIMS + (TEST_HEAD_DIMS if interpreted else ())
    for name, dim in (("K", q.shape[-1]), ("V", v.shape[-1])):
        if dim not in allowed:
            _fail(f"head dim {name}={dim} is not supported on {q.device.type}: {name} must be "
                  f"one of {SUPPORTED_HEAD_DIMS} ({TEST_HEAD_DIMS} only under the CPU "
                  f"interpreter, for tests: column blocks below 64 have not run on a GPU)")
    batch, seq_len, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    elements = batch * seq_len * max(heads, value_heads) * max(key_dim, value_dim, 64)
    if elements >= _MAX_ELEMENTS:
        _fail(f"B*T*max(H, HV)*max(K, V, 64) = {batch}*{seq_len}*{max(heads, value_heads)}*"
              f"{max(key_dim, value_dim, 64)} = {elements} elements is not supported: the kernels "
              f"index tokens with int32 offsets (below 2^31); split the batch")
    device = q.device.type
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            _fail("inputs are on the cpu: the kernels need a cuda or npu device, or "
                  "TRITON_INTERPRET=1 set before triton is imported (the interpreter)")
    elif device == "npu":
        try:
            version = importlib.metadata.version("triton-ascend")
        except importlib.metadata.PackageNotFoundError:
            _fail("inputs are on an npu but triton-ascend is not installed "
                  "(needs triton-ascend >= 3.2.1, < 3.3)")
        low, high = _ASCEND_RANGE
        if not low <= _version_tuple(version) < high:
            _fail(f"triton-ascend {version} is not supported: needs >= 3.2.1, < 3.3")
    elif device != "cuda":
        _fail(f"device {device!r} is not supported: use cuda, npu, or cpu under "
              "TRITON_INTERPRET=1")
    if importlib.util.find_spec("triton") is None:
        _fail("the triton package is not installed (pip install 'overlap_runtime[triton]')")
