"""RMSNorm / RMSNormGated (layers.norm) keep only their inputs and 1/rms for backward and
compute what the plain fp32 ops compute (``rms_norm_reference``, the previous forward)."""

from __future__ import annotations

import pytest
import torch

from overlap_runtime.layers import RMSNorm, RMSNormGated
from overlap_runtime.layers.norm import rms_norm_reference
from overlap_runtime.testing import rel_l2


def _saved_bytes(fn, skip: torch.Tensor) -> int:  # noqa: ANN001
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() != skip.untyped_storage().data_ptr():
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-13),
                                       (torch.bfloat16, 1e-2)])
def test_norm_matches_plain_ops_and_saves_less(gated: bool, dtype: torch.dtype,
                                               tol: float) -> None:
    torch.manual_seed(0)
    b, t, d = 2, 7, 24
    norm = (RMSNormGated(d) if gated else RMSNorm(d)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d))
    x = (3 * torch.randn(b, t, d)).to(dtype).requires_grad_()
    z = torch.randn(b, t, d).to(dtype).requires_grad_() if gated else None
    w_ref = norm.weight.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    z_ref = z.detach().clone().requires_grad_() if gated else None
    dy = torch.randn(b, t, d).to(dtype)
    out = norm(x, z) if gated else norm(x)
    ref = rms_norm_reference(x_ref, w_ref, norm.eps, z_ref)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    assert out.dtype == dtype and rel_l2(out.double(), ref.double()) <= tol
    pairs = [(x.grad, x_ref.grad), (norm.weight.grad, w_ref.grad)]
    if gated:
        pairs.append((z.grad, z_ref.grad))
    for got, want in pairs:
        assert rel_l2(got.double(), want.double()) <= tol
    size = torch.finfo(dtype).bits // 8
    compute = max(size, 4)
    lean = _saved_bytes(lambda: norm(x, z) if gated else norm(x), norm.weight)
    plain = _saved_bytes(lambda: rms_norm_reference(x, norm.weight, norm.eps, z), norm.weight)
    inputs = b * t * d * size * (2 if gated else 1)
    assert lean == inputs + b * t * compute           # x (and gate) and 1/rms [B, T, 1]
    assert plain >= lean + b * t * d * compute         # at least one more [B, T, D] copy
