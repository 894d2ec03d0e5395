"""GDNKernelOptions: validated values, refused where they do not apply, and reaching the backend."""

from __future__ import annotations

import pytest
import torch

from tests.support.gdn import make_inputs
from overlap_runtime.ops.gdn import (
    EagerBackend,
    GDNKernelOptions,
    TritonBackend,
    chunk_gated_delta_rule,
)

NAMES = ("q", "k", "v", "g", "beta")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"block_chunks": 0}, ValueError, r"GDNKernelOptions.block_chunks=0 must be >= 1"),
    ({"num_segments": -2}, ValueError, r"GDNKernelOptions.num_segments=-2 must be >= 1"),
    ({"block_chunks": True}, TypeError, r"block_chunks=True must be an int or None, got bool"),
    ({"num_segments": 2.0}, TypeError, r"num_segments=2.0 must be an int or None, got float"),
    ({"recompute_w": 1}, TypeError, r"recompute_w=1 must be a bool or None, got int"),
    ({"recompute_w": "yes"}, TypeError, r"recompute_w='yes' must be a bool or None, got str"),
    ({"fused_forward": 1}, TypeError, r"fused_forward=1 must be a bool or None, got int"),
])
def test_invalid_values_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        GDNKernelOptions(**kwargs)


def test_options_are_frozen():
    with pytest.raises(AttributeError):
        GDNKernelOptions().block_chunks = 2  # type: ignore[misc]


@pytest.mark.parametrize("backend, options, match", [
    ("eager", GDNKernelOptions(num_segments=4),
     r"backend='eager': num_segments=4 applies to backend='triton' only"),
    ("triton", GDNKernelOptions(block_chunks=2),
     r"backend='triton': block_chunks=2 applies to backend='eager' only"),
    # an explicit False is a set option too: refused on eager, never ignored
    ("eager", GDNKernelOptions(recompute_w=False),
     r"backend='eager': recompute_w=False applies to backend='triton' only"),
    ("eager", GDNKernelOptions(fused_forward=True),
     r"backend='eager': fused_forward=True applies to backend='triton' only"),
])
def test_an_option_of_another_backend_is_refused(backend, options, match):
    x = make_inputs(1, 10, 1, 2, 8, 8, dtype=torch.float32, requires_grad=False)
    # raised before the backend's own checks (triton would refuse the CPU tensors next)
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(*(x[n] for n in NAMES), backend=backend, options=options)


def test_options_must_be_the_dataclass():
    x = make_inputs(1, 10, 1, 2, 8, 8, dtype=torch.float32, requires_grad=False)
    with pytest.raises(TypeError, match="options must be a GDNKernelOptions or None, got dict"):
        chunk_gated_delta_rule(*(x[n] for n in NAMES), options={"block_chunks": 2})


def test_options_configure_the_backend():
    assert EagerBackend().with_options(GDNKernelOptions(block_chunks=3)).block_chunks == 3
    assert TritonBackend().with_options(GDNKernelOptions(num_segments=5)).num_segments == 5
    both = TritonBackend().with_options(GDNKernelOptions(num_segments=3, recompute_w=True))
    assert (both.num_segments, both.recompute_w) == (3, True)
    assert TritonBackend().recompute_w is False  # the default saves w
    kept = TritonBackend(num_segments=2).with_options(GDNKernelOptions(recompute_w=True))
    assert (kept.num_segments, kept.recompute_w) == (2, True)
    assert TritonBackend().fused_forward is False  # the kernel chain unless asked
    fused = kept.with_options(GDNKernelOptions(fused_forward=True))
    assert (fused.num_segments, fused.recompute_w, fused.fused_forward) == (2, True, True)
    default = EagerBackend()
    assert default.with_options(GDNKernelOptions()) is default


@pytest.mark.parametrize("block_chunks", [1, 2])
def test_block_chunks_reaches_the_eager_function(block_chunks):
    # the memory-lean Function saves one entering state per block: 320 tokens, 64-token chunks
    x = make_inputs(1, 320, 1, 2, 8, 8, dtype=torch.float32)
    o, _ = chunk_gated_delta_rule(*(x[n] for n in NAMES),
                                  options=GDNKernelOptions(block_chunks=block_chunks))
    boundaries = o.grad_fn.saved_tensors[-1]  # [B, HV, num_blocks, K, V]
    assert boundaries.shape[2] == -(-5 // block_chunks)


def test_autotune_env_keeps_all_or_first_and_refuses_others(monkeypatch):
    pytest.importorskip("triton")
    from overlap_runtime.ops.gdn.triton import common

    if common.INTERPRET:
        pytest.skip("the interpreter always runs one configuration")
    monkeypatch.delenv(common.AUTOTUNE_ENV, raising=False)
    assert len(common.autotune_configs()) == 5
    monkeypatch.setenv(common.AUTOTUNE_ENV, "first")
    (only,) = common.autotune_configs(((8, 3), (4, 1)))
    assert (only.num_warps, only.num_stages) == (8, 3)
    monkeypatch.setenv(common.AUTOTUNE_ENV, "auto")
    with pytest.raises(ValueError, match="OVERLAP_RUNTIME_GDN_AUTOTUNE='auto'"):
        common.autotune_configs()
