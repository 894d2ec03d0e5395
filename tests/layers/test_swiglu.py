"""SwiGLU keeps only gate(x) and up(x) for backward (layers.mlp) and computes exactly what the
plain ``down(silu(gate(x)) * up(x))`` computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlap_runtime.layers import SwiGLU
from overlap_runtime.testing import rel_l2


def _saved_bytes(fn, *args: torch.Tensor) -> int:  # noqa: ANN001
    storages: dict[int, int] = {}
    params = {a.untyped_storage().data_ptr() for a in args[1:]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values())


def _plain(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _check_against_plain(mlp: SwiGLU, b: int, t: int, h: int, dtype: torch.dtype, tol: float
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """mlp's output and every gradient against the plain MLP on a copy of its weights;
    returns the input and mlp's weights."""
    x = torch.randn(b, t, h, dtype=dtype, requires_grad=True)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    ref_w = [w.detach().clone().requires_grad_() for w in weights]
    ref_x = x.detach().clone().requires_grad_()
    dy = torch.randn(b, t, h, dtype=dtype)
    out, ref = mlp(x), _plain(ref_x, *ref_w)
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    assert rel_l2(out.float(), ref.float()) <= tol
    for got, want in zip((x, *weights), (ref_x, *ref_w)):
        assert rel_l2(got.grad.float(), want.grad.float()) <= tol
    return x, weights


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_swiglu_matches_plain_and_saves_less(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    b, t, h, i = 2, 9, 16, 40
    mlp = SwiGLU(h, i).to(dtype)
    x, weights = _check_against_plain(mlp, b, t, h, dtype, tol)
    size = torch.finfo(dtype).bits // 8
    lean = _saved_bytes(lambda *a: mlp(a[0]), x, *weights)
    plain = _saved_bytes(_plain, x, *weights)
    assert lean == b * t * (h + 2 * i) * size       # x, gate(x), up(x)
    assert plain == b * t * (h + 4 * i) * size      # and silu(gate(x)), the product


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_compiled_halves_match_plain_and_save_as_little(dtype: torch.dtype, tol: float) -> None:
    """``train.compile`` (layers.compile) swaps in the compiled ``silu(g) * u`` and its backward:
    same results as the plain MLP, the same lean saved set."""
    from overlap_runtime.layers.compile import compile_elementwise
    from overlap_runtime.layers.mlp import EAGER_SWIGLU

    torch.manual_seed(1)
    b, t, h, i = 2, 9, 16, 40
    mlp = SwiGLU(h, i).to(dtype)
    compile_elementwise(mlp)
    assert mlp.kernels is not EAGER_SWIGLU
    x, weights = _check_against_plain(mlp, b, t, h, dtype, tol)
    size = torch.finfo(dtype).bits // 8
    assert _saved_bytes(lambda *a: mlp(a[0]), x, *weights) == b * t * (h + 2 * i) * size
