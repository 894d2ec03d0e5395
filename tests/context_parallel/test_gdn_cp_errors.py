"""Fail-fast rules of LinearAttentionContextParallel: each error names the value and the rule."""

from __future__ import annotations

import pytest
import torch
from tests.support.gdn_cp import errors_worker, make_module

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.testing import rel_l2, run_ranks


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"mode 'ring'.*'ulysses', 'p2p', 'all_gather'"):
        LinearAttentionContextParallel(mode="ring")


@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_unknown_backend(backend: str) -> None:
    with pytest.raises(ValueError, match=rf"backend '{backend}'.*no 'auto'"):
        LinearAttentionContextParallel(mode="p2p", backend=backend)


def test_all_gather_with_triton_is_accepted() -> None:
    """all_gather's summaries are eager autograd with either backend; the Triton op runs the
    local outputs from H_in (``test_gdn_cp_triton.py``, ``test_packed_cp_triton.py``)."""
    style = LinearAttentionContextParallel(mode="all_gather", backend="triton")
    assert (style.mode, style.backend) == ("all_gather", "triton")


def test_tensor_parallel_refused() -> None:
    with pytest.raises(NotImplementedError, match=r"tp_size=2.*tp_size == 1"):
        LinearAttentionContextParallel(mode="ulysses", tp_size=2)
    with pytest.raises(ValueError, match=r"tp_size=0"):
        LinearAttentionContextParallel(mode="ulysses", tp_size=0)


def test_module_without_gdn_pieces() -> None:
    with pytest.raises(TypeError, match=r"Linear lacks \['in_proj_qkv'"):
        LinearAttentionContextParallel("p2p").apply(torch.nn.Linear(4, 4), None)


def test_mesh_must_be_a_device_mesh() -> None:
    with pytest.raises(TypeError, match=r"cp_mesh must be a DeviceMesh, got NoneType"):
        LinearAttentionContextParallel("p2p").apply(make_module(), None)


def test_single_device_module_checks_cu_seqlens() -> None:
    """The single-device layer runs packed documents (``layers.segments``); a malformed
    ``cu_seqlens`` is refused. One document is the unpacked layer (to fp32 rounding: the packed
    conv is the masked shifted sum, the unpacked one ``F.conv1d``)."""
    m = make_module()
    x = torch.randn(1, 8, 32)
    assert rel_l2(m(x, cu_seqlens=torch.tensor([0, 8])), m(x)) <= 1e-6
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at B \\* T"):
        m(x, cu_seqlens=torch.tensor([0, 6]))


EXPECTED = {
    "ulysses_heads": ("ValueError", "num_value_heads % cp == 0, got num_value_heads=3, cp=2"),
    "short_local_seq": ("ValueError", "local sequence 2 is shorter than the conv halo 3"),
    "cu_seqlens": ("ValueError", "cu_seqlens must start at 0 and end at B * T = 1 * 128"),
    "mask_shape": ("ValueError", "attention_mask must be [B, S/P] = [1, 64]"),
    "apply_twice": ("RuntimeError", "already runs context-parallel ('p2p')"),
    "dtensor_replicate": ("ValueError", "placements (Shard(1),)"),
    "triton_p2p": ("NotImplementedError", "GDN backend='triton': head dim K=8 is not supported"),
    "triton_ulysses": ("NotImplementedError", "GDN backend='triton': head dim K=8 is not supported"),
    "triton_p2p_local_len": (
        "NotImplementedError",
        "local sequence 100 is not a multiple of chunk size 64 (backend='triton', mode='p2p')"),
    "triton_ulysses_local_len": (
        "NotImplementedError",
        "local sequence 100 is not a multiple of chunk size 64 (backend='triton', mode='ulysses')"),
}


def test_errors_on_live_cp_group() -> None:
    """Cases that need a CP group, on 2 gloo ranks; every rank raises at the same point (no
    rank is left waiting: later cases in the same worker still run)."""
    for rank, res in enumerate(run_ranks(errors_worker, 2)):
        for case, (exc, text) in EXPECTED.items():
            assert res[case].startswith(f"{exc}: "), f"rank {rank} {case}: {res[case]}"
            assert text in res[case], f"rank {rank} {case}: {res[case]}"
        assert res["dtensor_ok"] == "ok", f"rank {rank}: {res['dtensor_ok']}"
