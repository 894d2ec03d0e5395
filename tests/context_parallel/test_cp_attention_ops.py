"""ops.attention: blocks return the right (out, lse), their backward matches autograd, and
merging blocks by online softmax equals attention over their union."""

from __future__ import annotations

import pytest
import torch

from tests.support.cp import make_qkv, reference_attention, reference_grads
from overlap_runtime.ops.attention import (
    attention,
    attention_block_backward,
    attention_block_forward,
    merge_attention_,
    select_backend,
)
from overlap_runtime.testing import rel_l2

TOL = 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_block_forward_backward_match_reference(causal: bool, hq: int, hkv: int) -> None:
    q, k, v, dout = make_qkv(1, 2, 16, hq, hkv, 8)
    out, lse = attention_block_forward(q, k, v, causal)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (2, hq, 16)
    ref_out, dq_ref, dk_ref, dv_ref = reference_grads(q, k, v, dout, causal)
    assert rel_l2(out, ref_out) <= TOL
    # lse against an independent logsumexp of the masked scores.
    kk = k.double().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * 8 ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    assert rel_l2(lse, torch.logsumexp(s, -1)) <= TOL
    dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, causal)
    for got, ref, name in ((dq, dq_ref, "dq"), (dk, dk_ref, "dk"), (dv, dv_ref, "dv")):
        assert got.shape == ref.shape, name
        assert rel_l2(got, ref) <= TOL, f"{name}: {rel_l2(got, ref)}"


def test_merge_of_key_blocks_equals_full_attention_and_block_grads_sum() -> None:
    """Split the keys of a causal row set into [0, p) (full) and [p, p+L) (causal): the merged
    (out, lse) is the full answer, and each block's backward from the merged (out, lse) sums to
    the full gradient (the identity ring and all-gather-kv backward rely on)."""
    q_all, k, v, dout_all = make_qkv(2, 1, 24, 4, 2, 8)
    p, n = 16, 8
    q, dout = q_all[:, p:p + n], dout_all[:, p:p + n]
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((1, 4, n), float("-inf"))
    blocks = [(slice(0, p), False), (slice(p, p + n), True)]
    for kr, causal in blocks:
        merge_attention_(out, lse, *attention_block_forward(q, k[:, kr], v[:, kr], causal))
    # reference: the rows p..p+n of causal attention over 24 tokens, as a rectangular problem
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k[:, :p + n], v[:, :p + n])]
    ref = reference_attention(*leaves, causal=True)
    ref.backward(dout.double())
    assert rel_l2(out, ref.detach()) <= TOL
    dq = torch.zeros(q.shape)
    dk = torch.zeros(1, p + n, 2, 8)
    dv = torch.zeros(1, p + n, 2, 8)
    for kr, causal in blocks:
        a, b, c = attention_block_backward(dout, q, k[:, kr], v[:, kr], out, lse, causal)
        dq += a
        dk[:, kr] += b
        dv[:, kr] += c
    for got, leaf in zip((dq, dk, dv), leaves):
        assert rel_l2(got, leaf.grad) <= TOL


def test_merge_into_empty_rows_and_slices() -> None:
    out = torch.zeros(1, 4, 2, 3)
    lse = torch.full((1, 2, 4), float("-inf"))
    blk = torch.randn(1, 2, 2, 3)
    blk_lse = torch.randn(1, 2, 2)
    merge_attention_(out[:, 2:], lse[:, :, 2:], blk, blk_lse)
    assert torch.equal(out[:, :2], torch.zeros(1, 2, 2, 3))          # untouched, no NaN
    assert torch.isinf(lse[:, :, :2]).all()
    assert torch.allclose(out[:, 2:], blk) and torch.allclose(lse[:, :, 2:], blk_lse)
    with pytest.raises(ValueError, match="accumulators must be both float32 or both float64, "
                                         "got out torch.float64, lse torch.float32"):
        merge_attention_(out.double(), lse, blk, blk_lse)
    with pytest.raises(ValueError, match="got out torch.bfloat16, lse torch.bfloat16"):
        merge_attention_(out.bfloat16(), lse.bfloat16(), blk, blk_lse)
    # float64 accumulators merge in float64 (float64 attention): the merge identity holds to
    # float64 rounding, blk is read as is
    out64, lse64 = out.double(), lse.double()
    b64, bl64 = torch.randn(1, 2, 2, 3, dtype=torch.float64), torch.randn(1, 2, 2, dtype=torch.float64)
    prev, prev_lse = out64[:, 2:].clone(), lse64[:, :, 2:].clone()
    merge_attention_(out64[:, 2:], lse64[:, :, 2:], b64, bl64)
    new = torch.logaddexp(prev_lse, bl64)
    want = (prev * torch.exp(prev_lse - new).transpose(1, 2).unsqueeze(-1)
            + b64 * torch.exp(bl64 - new).transpose(1, 2).unsqueeze(-1))
    assert lse64.dtype == torch.float64 and rel_l2(out64[:, 2:], want) <= 1e-14


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_attention_autograd_keeps_dtype(dtype: torch.dtype) -> None:
    """float64 is computed in float64 (within 1e-12 of the float64 reference; it used to run in
    float32 and come back cast, ~1e-7); the others in float32, cast once."""
    q, k, v, dout = make_qkv(3, 1, 16, 4, 2, 8, dtype)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = attention(*leaves, causal=True)
    out.backward(dout)
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in leaves)
    ref_out, *ref_grads = reference_grads(q, k, v, dout, True)
    tol = {torch.float64: 1e-12, torch.float32: TOL}.get(dtype, 1e-2)
    assert rel_l2(out, ref_out) <= tol
    for x, g in zip(leaves, ref_grads):
        assert rel_l2(x.grad, g) <= tol


def test_block_errors_name_values() -> None:
    q, k, v, _ = make_qkv(4, 1, 8, 4, 3, 8)
    with pytest.raises(ValueError, match="query heads 4 must be a multiple of key/value heads 3"):
        attention_block_forward(q, k, v, False)
    q, k, v, _ = make_qkv(4, 1, 8, 4, 4, 8)
    with pytest.raises(ValueError, match="causal block must be square, got 8 queries and 4 keys"):
        attention_block_forward(q, k[:, :4], v[:, :4], True)
    assert select_backend(q) == "math"
    for forced in ("flash", "cudnn"):
        with pytest.raises(ValueError, match=f"backend '{forced}' needs cuda fp16/bf16 tensors .* "
                                             f"got device cpu, dtype torch.float32, head dim 8"):
            select_backend(q, forced)  # type: ignore[arg-type]
    for bad in ("triton", "auto"):
        with pytest.raises(ValueError, match=r"backend must be 'math', 'flash' or 'cudnn' \(no "
                                             f"'auto'\\), got '{bad}'"):
            select_backend(q, bad)  # type: ignore[arg-type]


def test_block_kernel_dtype_and_merge_into_result() -> None:
    """``cast_float32=False`` returns the kernel's dtype (float32 for math) with the same values;
    merging a block into a first block held in bf16 (``prev_out``) and writing the row's last
    merge straight into a bf16 result gives exactly the float32-accumulator path cast once."""
    q, k, v, dout = make_qkv(5, 1, 16, 4, 2, 8)
    out, lse = attention_block_forward(q, k, v, True)
    out_k, lse_k = attention_block_forward(q, k, v, True, cast_float32=False)
    assert out_k.dtype == torch.float32 and torch.equal(out_k, out) and torch.equal(lse_k, lse)
    grads = attention_block_backward(dout, q, k, v, out, lse, True)
    grads_k = attention_block_backward(dout, q, k, v, out, lse, True, cast_float32=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_k))

    first = torch.randn(1, 16, 4, 8).bfloat16()
    blk = torch.randn(1, 16, 4, 8).bfloat16()
    lse0, blk_lse = torch.randn(1, 4, 16), torch.randn(1, 4, 16)
    acc, lse_a = first.float(), lse0.clone()
    merge_attention_(acc, lse_a, blk, blk_lse)
    scratch, lse_b = torch.empty(1, 16, 4, 8), lse0.clone()
    result = torch.empty(1, 16, 4, 8, dtype=torch.bfloat16)
    merge_attention_(scratch, lse_b, blk, blk_lse, prev_out=first, result=result)
    assert torch.equal(result, acc.to(torch.bfloat16)) and torch.equal(lse_a, lse_b)
    ref = (first.float() * torch.exp(lse0 - lse_a).transpose(1, 2).unsqueeze(-1)
           + blk.float() * torch.exp(blk_lse - lse_a).transpose(1, 2).unsqueeze(-1))
    assert rel_l2(acc, ref) <= TOL


def test_merge_keeps_rows_empty_on_both_sides() -> None:
    out = torch.zeros(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    blk = torch.randn(1, 3, 2, 4)
    blk_lse = torch.randn(1, 2, 3)
    blk_lse[:, :, 0] = float("-inf")
    merge_attention_(out, lse, blk, blk_lse)
    assert torch.equal(out[:, 0], torch.zeros(1, 2, 4)) and torch.isinf(lse[:, :, 0]).all()
    assert torch.allclose(out[:, 1:], blk[:, 1:]) and torch.equal(lse[:, :, 1:], blk_lse[:, :, 1:])
