"""Local attention blocks that return ``(out, lse)``, their backward, and the online-softmax merge.

Every context-parallel attention algorithm (``overlap_runtime.context_parallel``) is a loop over
*blocks*: one slice of the local queries against one slice of some keys/values. This module is
the only place that computes a block; the CP files only decide which blocks to run and move
K/V around.

Layout and dtypes
-----------------
* ``q``: ``[B, Sq, Hq, D]``; ``k``, ``v``: ``[B, Sk, Hkv, D]`` (batch, sequence, heads, head
  dim; the layout the projections produce and flash-attention's). ``Hq % Hkv == 0`` (grouped-query
  attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``). Any float dtype.
* The *accumulation dtype* (:func:`accumulation_dtype`) is float32 for bf16, fp16 and fp32
  inputs and float64 for float64 inputs: float64 attention is computed in float64 throughout
  (blocks, lse, merges, gradient sums), never silently in float32.
* ``lse``: ``[B, Hq, Sq]`` in the accumulation dtype, natural-log ``logsumexp`` over the block's
  keys of the scaled scores ``q . k * scale`` (the layout fused kernels return).
* Block outputs and gradients are in the accumulation dtype whatever the input dtype; callers
  accumulate in it and cast back to the input dtype once, at the end. With
  ``cast_float32=False`` a block returns its kernel's own dtype instead (q's dtype for
  ``flash``/``cudnn``, whose kernels accumulate in float32 and round once; the accumulation
  dtype for ``math``): widening that to float32 adds no information, so a caller that
  accumulates with mixed-dtype float32 ops (``acc += x``, ``torch.add(acc, x, out=...)``,
  :func:`merge_attention_`) gets the same numbers without a cast kernel per block.

Masks
-----
A block is ``causal=False`` (every query sees every key) or ``causal=True`` (square, ``Sq ==
Sk``, query ``i`` sees keys ``0..i``). The CP algorithms split their masks into these two kinds
(see ``context_parallel/ring.py``), so no block ever has a fully masked row and ``lse`` is finite.

Backward of a block
-------------------
Given the *final* ``(out, lse)`` of the whole attention row (after every block was merged) and
``dout``, each block's contribution to ``dq``, ``dk``, ``dv`` is exact on its own::

    P  = exp(q k^T * scale - lse)          (this block's columns of the final softmax)
    dV = P^T dout
    dS = P * (dout v^T - rowsum(dout * out))
    dQ = dS k * scale,   dK = dS^T q * scale

so ring backward recomputes blocks from ``(q, k, v, out, lse, dout)`` and keeps no per-block
autograd graph.

Backends
--------
``math`` (plain PyTorch in the accumulation dtype; the CPU path and the reference) and two CUDA
kernels that
return the logsumexp and take it back in their backward op (fp16/bf16, head dim a multiple of 8
up to 256 here): ``flash`` (``aten._scaled_dot_product_flash_attention``, FlashAttention-2) and
``cudnn`` (``aten._scaled_dot_product_cudnn_attention``, the kernel SDPA itself prefers on
Hopper). :func:`select_backend` picks ``cudnn`` on sm90+ when cuDNN is available, ``flash`` on
other qualifying CUDA tensors, ``math`` otherwise; ``backend=`` forces one.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch.autograd.function import FunctionCtx

Backend = Literal["math", "flash", "cudnn"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def default_scale(head_dim: int) -> float:
    """The softmax scale used when none is given: ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(head_dim)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where attention of ``dtype`` inputs accumulates: float64 for float64, else float32."""
    return torch.promote_types(dtype, torch.float32)


def _check_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    """Validate a block's shapes; return the GQA group size ``Hq // Hkv``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention block: q, k, v must be [B, S, H, D], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention block: k {tuple(k.shape)} and v {tuple(v.shape)} must have "
                         f"the same shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention block: q {tuple(q.shape)} and k {tuple(k.shape)} differ in "
                         f"batch or head dim")
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"attention block: query heads {hq} must be a multiple of key/value "
                         f"heads {hkv}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"attention block: a causal block must be square, got {q.shape[1]} "
                         f"queries and {k.shape[1]} keys")
    return hq // hkv


def _cudnn_preferred(device: torch.device) -> bool:
    return (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def select_backend(q: torch.Tensor, backend: Backend = "math") -> Literal["math", "flash", "cudnn"]:
    """Check that ``backend`` can run ``q``'s device, dtype and head dim, and return it.

    There is no ``auto``: the caller chooses. ``math`` (plain PyTorch, any device and dtype) is
    the CPU path; ``cudnn`` (fastest on Hopper) and ``flash`` need CUDA fp16/bf16 tensors with a
    head dim that is a multiple of 8 up to 256, and raise otherwise, naming the device, dtype and
    head dim.
    """
    if backend not in ("math", "flash", "cudnn"):
        raise ValueError(f"attention backend must be 'math', 'flash' or 'cudnn' (no 'auto'), got "
                         f"{backend!r}")
    ok = q.is_cuda and q.dtype in _FLASH_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    if backend != "math" and not ok:
        raise ValueError(f"attention backend {backend!r} needs cuda fp16/bf16 tensors with head "
                         f"dim a multiple of 8 up to 256; got device {q.device}, dtype {q.dtype}, "
                         f"head dim {q.shape[-1]}")
    if backend == "cudnn" and not _cudnn_preferred(q.device):
        raise ValueError(f"attention backend 'cudnn' needs cuDNN SDPA on an sm90+ GPU; "
                         f"{q.device} is sm{''.join(map(str, torch.cuda.get_device_capability(q.device)))}")
    return backend


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, S, Hkv, D]`` -> ``[B, S, Hkv * group, D]``, each kv head repeated for its q heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _reduce_kv(grad: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of :func:`_expand_kv` for gradients: sum the ``group`` copies of each kv head.

    ``[B, S, Hkv * group, D]`` (any float dtype) -> ``[B, S, Hkv, D]``; the sum is in the
    accumulation dtype (read in the input dtype, accumulated and written in float32, or float64
    for float64: no separate cast) when ``group > 1``, the input itself otherwise.
    """
    if group == 1:
        return grad
    b, s, h, d = grad.shape
    return grad.reshape(b, s, h // group, group, d).sum(dim=3, dtype=accumulation_dtype(grad.dtype))


# --------------------------------------------------------------------------- math backend


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scores ``[B, H, Sq, Sk]`` in q's accumulation dtype, masked entries ``-inf``; q and k
    already expanded."""
    acc = accumulation_dtype(q.dtype)
    s = torch.matmul(q.to(acc).transpose(1, 2), k.to(acc).permute(0, 2, 3, 1)) * scale
    if causal:
        n = s.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool, device=s.device).tril_()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    s = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                                   # [B, H, Sq]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.to(s.dtype).transpose(1, 2))               # [B, H, Sq, D]
    return out.transpose(1, 2).contiguous(), lse


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    s = _math_scores(q, k, causal, scale)
    acc = s.dtype                                                      # float32 or float64
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))                       # [B, H, Sq, Sk]
    do = dout.to(acc).transpose(1, 2)                                  # [B, H, Sq, D]
    dv = torch.matmul(p.transpose(-1, -2), do)                         # [B, H, Sk, D]
    dp = torch.matmul(do, v.to(acc).permute(0, 2, 3, 1))               # [B, H, Sq, Sk]
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)       # [B, H, Sq]
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.to(acc).transpose(1, 2)) * scale           # [B, H, Sq, D]
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).transpose(1, 2)) * scale
    return (dq.transpose(1, 2).contiguous(), _reduce_kv(dk.transpose(1, 2), group).contiguous(),
            _reduce_kv(dv.transpose(1, 2), group).contiguous())


# --------------------------------------------------------------------------- flash backend (CUDA)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float, group: int, cast_float32: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    # The aten op takes [B, H, S, D] views; a transpose of [B, S, H, D] keeps the last dim
    # contiguous, which is all the kernel needs.
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, False, scale=scale)
    out, lse = res[0].transpose(1, 2), res[1]
    return (out.float() if cast_float32 else out), lse.float()


def _philox_placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Dropout is 0, so the kernel never reads the RNG state; it still wants tensors of the
    # forward op's kind (see torch's meta registration of the flash forward).
    return (torch.zeros(2, dtype=torch.uint64, device=device),
            torch.zeros((), dtype=torch.uint64, device=device))


def _flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                    group: int, cast_float32: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    seed, offset = _philox_placeholders(q.device)
    t = lambda x: x.to(q.dtype).transpose(1, 2)  # noqa: E731 - [B, S, H, D] -> [B, H, S, D]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        t(dout), t(q), t(ke), t(ve), t(out), lse.float().contiguous(), None, None,
        q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale)
    return _bshd_grads(dq, dk, dv, group, cast_float32)


# --------------------------------------------------------------------------- cuDNN backend (CUDA)


def _bshd_grads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, group: int,
                cast_float32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A kernel's ``[B, H, S, D]`` gradients -> ``[B, S, H, D]`` views, kv heads reduced.

    float32 when ``cast_float32``; else the kernel's dtype (dk, dv float32 when ``group > 1``:
    :func:`_reduce_kv` sums in float32).
    """
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    if cast_float32:
        dq = dq.float()
        if group == 1:
            dk, dv = dk.float(), dv.float()
    return dq, _reduce_kv(dk, group), _reduce_kv(dv, group)


def _bhsd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, S, H, D]`` -> a ``[B, H, S, D]`` view of a contiguous BSHD tensor (cuDNN wants the
    same layout for q, k, v, out and dout)."""
    return x.to(dtype).contiguous().transpose(1, 2)


def _cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float, group: int, cast_float32: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _expand_kv(k, group), _expand_kv(v, group)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q, q.dtype), _bhsd(k, q.dtype), _bhsd(v, q.dtype), None, True, 0.0, causal, False,
        scale=scale)
    out, lse = res[0].transpose(1, 2), res[1]                  # lse [B, H, Sq, 1]
    b, sq, h, _ = q.shape
    return (out.float() if cast_float32 else out), lse.reshape(b, h, sq).float()


def _cudnn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                    group: int, cast_float32: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ke, ve = _expand_kv(k, group), _expand_kv(v, group)
    b, sq, h, _ = q.shape
    seed = torch.zeros((), dtype=torch.long, device=q.device)  # dropout 0: never read
    offset = torch.zeros((), dtype=torch.long, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout, q.dtype), _bhsd(q, q.dtype), _bhsd(ke, q.dtype), _bhsd(ve, q.dtype),
        _bhsd(out, q.dtype), lse.float().reshape(b, h, sq, 1).contiguous(), seed, offset, None,
        None, None, sq, k.shape[1], 0.0, causal, scale=scale)
    return _bshd_grads(dq, dk, dv, group, cast_float32)


# --------------------------------------------------------------------------- public block API


def attention_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            scale: float | None = None, backend: Backend = "math", *,
                            cast_float32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block.

    Args:
        q: ``[B, Sq, Hq, D]``; k, v: ``[B, Sk, Hkv, D]``; one float dtype.
        causal: square causal mask (``Sq == Sk``) or none.
        scale: softmax scale, default ``D ** -0.5``.
        cast_float32: return ``out`` in the accumulation dtype (default: float32, float64 for
            float64 inputs); False: in the kernel's own dtype (q's dtype for ``flash``/``cudnn``,
            the accumulation dtype for ``math``), saving a cast kernel when the caller
            accumulates in float32 anyway (module docstring).

    Returns:
        ``(out, lse)``: ``out`` ``[B, Sq, Hq, D]`` in the accumulation dtype or the kernel's
        (normalised within this block; laid out like q, so contiguous for a contiguous q),
        ``lse`` ``[B, Hq, Sq]`` in the accumulation dtype.
    """
    group = _check_block(q, k, v, causal)
    sc = default_scale(q.shape[-1]) if scale is None else float(scale)
    chosen = select_backend(q, backend)
    if chosen == "flash":
        return _flash_forward(q, k, v, causal, sc, group, cast_float32)
    if chosen == "cudnn":
        return _cudnn_forward(q, k, v, causal, sc, group, cast_float32)
    return _math_forward(q, k, v, causal, sc, group)


def attention_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             scale: float | None = None, backend: Backend = "math", *,
                             cast_float32: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of the gradients, recomputed from the *final* ``(out, lse)``.

    Args:
        dout, out: ``[B, Sq, Hq, D]`` (any float dtype; the CUDA kernels cast them to q's).
        q: ``[B, Sq, Hq, D]``; k, v: ``[B, Sk, Hkv, D]``.
        lse: ``[B, Hq, Sq]`` (float32, float64 for float64 inputs), the row's logsumexp over
            *all* its blocks.
        cast_float32: return gradients in the accumulation dtype (default); False: the kernel's
            own dtype (q's for ``flash``/``cudnn``, except dk, dv are float32 when kv heads are
            shared: their copies are summed in float32; the accumulation dtype for ``math``).

    Returns:
        ``(dq, dk, dv)`` with q's, k's and v's shapes, in the accumulation dtype or as
        ``cast_float32`` says.
    """
    group = _check_block(q, k, v, causal)
    sc = default_scale(q.shape[-1]) if scale is None else float(scale)
    chosen = select_backend(q, backend)
    if chosen == "flash":
        return _flash_backward(dout, q, k, v, out, lse, causal, sc, group, cast_float32)
    if chosen == "cudnn":
        return _cudnn_backward(dout, q, k, v, out, lse, causal, sc, group, cast_float32)
    return _math_backward(dout, q, k, v, out, lse, causal, sc, group)


def merge_attention_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                     block_lse: torch.Tensor, *, prev_out: torch.Tensor | None = None,
                     result: torch.Tensor | None = None) -> None:
    """Online-softmax merge of a block into an accumulator, in place, in the accumulators' dtype.

    Args:
        out: accumulator ``[B, S, H, D]`` float32 (float64 for float64 attention; a view is
            fine: it is written in place).
        lse: accumulator ``[B, H, S]``, out's dtype; ``-inf`` rows mean "nothing merged yet".
        block_out: ``[B, S, H, D]``, any float dtype (a kernel's bf16/fp16 output is read as is:
            the arithmetic is float32, no cast kernel); block_lse: ``[B, H, S]``.
        prev_out: the accumulator's current value when it is not (yet) in ``out``, e.g. the
            first block's output in its kernel dtype: read instead of ``out``, which is then
            written without being read (no float32 copy of the first block is needed).
        result: where the merged output goes, any float dtype (e.g. the final output in the
            input dtype, on a row's last merge: computed in float32, rounded once). ``out`` then
            only serves as float32 scratch and holds ``w_old * prev`` afterwards, not the merge.

    After the call ``lse = log(exp(lse) + exp(block_lse))`` and ``out`` (or ``result``) is the
    softmax-weighted mix ``w_old * prev + w_new * block_out`` with ``w_new = sigmoid(block_lse -
    lse)``, ``w_old = sigmoid(lse - block_lse)`` (``= exp(lse_i - new_lse)``, summing to 1). Rows
    where both are ``-inf`` keep ``w_old = 1, w_new = 0``: ``out`` stays 0, ``lse`` ``-inf``.
    Device work: a few ``[B, H, S]`` ops and two passes over the rows (``mul``, ``addcmul``).
    """
    if out.dtype != lse.dtype or out.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"merge_attention_: accumulators must be both float32 or both float64, "
                         f"got out {out.dtype}, lse {lse.dtype}")
    inf = float("inf")
    d = block_lse.to(lse.dtype) - lse                                  # [B, H, S]
    torch.logaddexp(lse, block_lse, out=lse)
    d.nan_to_num_(nan=-inf, posinf=inf, neginf=-inf)   # both -inf (nan): keep the accumulator
    w_new = torch.sigmoid(d).transpose(1, 2).unsqueeze(-1)             # [B, S, H, 1]
    w_old = torch.sigmoid(d.neg_()).transpose(1, 2).unsqueeze(-1)
    torch.mul(out if prev_out is None else prev_out, w_old, out=out)
    torch.addcmul(out, block_out, w_new, out=out if result is None else result)


# --------------------------------------------------------------------------- differentiable


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float, backend: Backend) -> torch.Tensor:
        out32, lse = attention_block_forward(q, k, v, causal, scale, backend)
        out = out32.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale,
                                              ctx.backend)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, backend: Backend = "math") -> torch.Tensor:
    """Differentiable single-device attention over one block (the whole local sequence).

    Args:
        q: ``[B, S, Hq, D]``; k, v: ``[B, S, Hkv, D]`` (``Sk`` may differ when not causal).

    Returns:
        ``[B, S, Hq, D]`` in q's dtype. Backward recomputes the block from the saved
        ``(q, k, v, out, lse)`` (no score matrix is kept).
    """
    sc = default_scale(q.shape[-1]) if scale is None else float(scale)
    return _LocalAttention.apply(q, k, v, bool(causal), sc, backend)
