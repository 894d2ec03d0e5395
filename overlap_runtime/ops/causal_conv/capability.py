"""What the causal-conv Triton kernels run, checked before anything is launched (no triton import).

Rules (a failure raises naming the value and the rule; there is no fallback to another conv):

* x ``[B, T, C]`` with C innermost (``stride(2) == 1``; any batch / time strides), ``T >= 1``, dtype bf16 / fp16 / fp32
  (``NotImplementedError`` for another dtype, ``ValueError`` for a shape or layout);
* weight ``[C, K]`` with ``1 <= K <= 8`` (``MAX_KERNEL_SIZE``), dtype bf16 / fp16 / fp32;
* ``dilation`` an int >= 1;
* left None or ``[B, (K - 1) * dilation, C]`` contiguous, in x's dtype;
* doc_positions None or ``[B, T]`` int32 / int64 (packed documents' positions);
* every tensor on one device: ``cuda``, or ``cpu`` only under ``TRITON_INTERPRET=1`` (set before
  triton is first imported);
* the ``triton`` package importable.
"""

from __future__ import annotations

import importlib.util
import os

import torch

MAX_KERNEL_SIZE = 8
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _unsupported(message: str) -> None:
    raise NotImplementedError(f"causal_conv_silu (conv_backend='triton'): {message} (there is no "
                              "automatic fallback; use conv_backend='torch' explicitly)")


def check_causal_conv_inputs(x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None,
                             dilation: int, doc_positions: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` (shapes, layout) or ``NotImplementedError`` (dtype, device, kernel
    size, triton missing) unless the Triton kernels can run these inputs (module docstring)."""
    where = "causal_conv_silu (conv_backend='triton')"
    if x.dim() != 3:
        raise ValueError(f"{where}: x must be [B, T, C], got shape {tuple(x.shape)}")
    batch, seq_len, channels = x.shape
    if seq_len < 1 or batch < 1 or channels < 1:
        raise ValueError(f"{where}: x shape {tuple(x.shape)} has an empty dim (B, T, C >= 1)")
    if x.stride(2) != 1:
        raise ValueError(f"{where}: x of shape {tuple(x.shape)} and strides {x.stride()} does not "
                         "have C innermost (stride(2) == 1): the kernels read [B, T, C] rows")
    if x.dtype not in SUPPORTED_DTYPES:
        _unsupported(f"x dtype {x.dtype} is not supported: use bf16, fp16 or fp32")
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"{where}: weight must be [C={channels}, K], got shape "
                         f"{tuple(weight.shape)}")
    kernel = weight.shape[1]
    if not 1 <= kernel <= MAX_KERNEL_SIZE:
        _unsupported(f"kernel size K={kernel} is not supported: 1 <= K <= {MAX_KERNEL_SIZE}")
    if weight.dtype not in SUPPORTED_DTYPES:
        _unsupported(f"weight dtype {weight.dtype} is not supported: use bf16, fp16 or fp32")
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"{where}: dilation={dilation!r} must be an int >= 1")
    halo = (kernel - 1) * dilation
    if left is not None:
        expected = (batch, halo, channels)
        if tuple(left.shape) != expected:
            raise ValueError(f"{where}: left must be [B, (K-1)*dilation, C] = {list(expected)} "
                             f"(K={kernel}, dilation={dilation}), got {list(left.shape)}")
        if left.dtype != x.dtype:
            raise ValueError(f"{where}: left dtype {left.dtype} differs from x dtype {x.dtype}")
        if not left.is_contiguous():
            raise ValueError(f"{where}: left of strides {left.stride()} is not contiguous")
    if doc_positions is not None:
        if (tuple(doc_positions.shape) != (batch, seq_len)
                or doc_positions.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{where}: doc_positions must be [B, T] = {[batch, seq_len]} int32 "
                             f"or int64, got {doc_positions.dtype} {list(doc_positions.shape)}")
    devices = {t.device for t in (x, weight, left, doc_positions) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{where}: x, weight, left and doc_positions are on different devices "
                         f"{sorted(str(d) for d in devices)}")
    device = x.device.type
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            _unsupported("inputs are on the cpu: the kernels need a cuda device, or "
                         "TRITON_INTERPRET=1 set before triton is imported (the interpreter)")
    elif device != "cuda":
        _unsupported(f"device {device!r} is not supported: use cuda, or cpu under "
                     "TRITON_INTERPRET=1")
    if importlib.util.find_spec("triton") is None:
        _unsupported("the triton package is not installed (pip install 'overlap_runtime[triton]')")
