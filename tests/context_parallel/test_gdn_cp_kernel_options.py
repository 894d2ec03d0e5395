"""A GDN layer's kernel options under context parallelism: refused where a mode cannot take
them (before the layer changes), passed to every op call where it can.

* build time: ``num_segments`` below the Triton p2p chain's / prefix scan's 2 segments per rank,
  and options of the other backend, raise naming the option, the mode and the rule;
* Triton plumbing, in this process: the p2p chain and the prefix scan hand ``num_segments``,
  ``recompute_w`` and ``fused_forward`` to the op's ``gdn_forward`` (a recording stand-in for the kernels, on a
  one-rank plan: no process group, no interpreter);
* eager, 2 gloo ranks: ``block_chunks`` reaches every op call of every mode, dense and packed,
  and the results equal the run without options (float64, rel-L2 <= 1e-12).
* triton under the interpreter (marked ``triton``, ~15 s): the chain and the scan run the
  kernels with ``num_segments=2, recompute_w=True, fused_forward=True`` (the fused forward
  under the state link) and still equal the eager layer.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from tests.support.gdn_cp_options import MODES, options_worker, triton_options_worker

from overlap_runtime.context_parallel import LinearAttentionContextParallel
from overlap_runtime.context_parallel.gdn.common import GDNCPPlan
from overlap_runtime.layers import GatedDeltaNet
from overlap_runtime.layers.sequence_mixer import LocalGDNMixer
from overlap_runtime.ops.gdn import GDNKernelOptions
from overlap_runtime.testing import run_ranks
from tests.support.interpreter import INTERPRETED_RANK_ENV, Interpreted


@pytest.mark.parametrize("mode", ["p2p", "prefix_scan"])
def test_triton_state_passing_modes_refuse_one_segment(mode: str) -> None:
    style = LinearAttentionContextParallel(mode=mode, backend="triton")
    with pytest.raises(ValueError) as info:
        style.check_kernel_options(GDNKernelOptions(num_segments=1))
    msg = str(info.value)
    assert f"num_segments=1 with mode={mode!r}, backend='triton'" in msg, msg
    assert "at least 2 segments per rank" in msg, msg
    style.check_kernel_options(GDNKernelOptions(num_segments=2, recompute_w=True))


@pytest.mark.parametrize("mode", ["ulysses", "all_gather"])
def test_modes_running_the_plain_op_take_one_segment(mode: str) -> None:
    style = LinearAttentionContextParallel(mode=mode, backend="triton")
    style.check_kernel_options(GDNKernelOptions(num_segments=1, recompute_w=True))


@pytest.mark.parametrize("mode", MODES)
def test_options_of_the_other_backend_are_refused(mode: str) -> None:
    with pytest.raises(ValueError) as info:
        LinearAttentionContextParallel(mode=mode, backend="eager").check_kernel_options(
            GDNKernelOptions(recompute_w=True))
    msg = str(info.value)
    assert f"mode={mode!r}, backend='eager'" in msg, msg
    assert "recompute_w=True applies to backend='triton' only" in msg, msg
    with pytest.raises(TypeError, match="got dict"):
        LinearAttentionContextParallel(mode=mode).check_kernel_options({"block_chunks": 2})


def test_apply_refuses_before_changing_the_layer() -> None:
    layer = GatedDeltaNet(32, 2, 4, 16, 16, backend="triton",
                          kernel_options=GDNKernelOptions(num_segments=1))
    with pytest.raises(ValueError, match=r"num_segments=1 with mode='p2p', backend='triton'"):
        LinearAttentionContextParallel(mode="p2p", backend="triton").apply(layer, None)
    assert type(layer.sequence_mixer) is LocalGDNMixer


class _OneRankPlan(GDNCPPlan):
    """A plan of one CP rank that needs no process group (the links post no message)."""

    @property
    def rank(self) -> int:
        return 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("mode", ["p2p", "prefix_scan"])
@pytest.mark.parametrize("options, expected", [
    (GDNKernelOptions(num_segments=3, recompute_w=True, fused_forward=True),
     {"num_segments": 3, "recompute_w": True, "fused": True}),
    (None, {"num_segments": None, "recompute_w": False, "fused": False}),
])
def test_triton_chain_and_scan_pass_the_options_to_the_op(
        monkeypatch: pytest.MonkeyPatch, mode: str, options: GDNKernelOptions | None,
        expected: dict[str, Any]) -> None:
    import overlap_runtime.ops.gdn.triton.function as kernels
    from overlap_runtime.context_parallel.gdn.p2p import ChainLink
    from overlap_runtime.context_parallel.gdn.prefix_scan import ScanLink
    from overlap_runtime.context_parallel.gdn.state_passing import (apply_state_passing,
                                                                    local_backend)
    from overlap_runtime.context_parallel.gdn.varlen import ShardTable

    calls: list[dict[str, Any]] = []

    def forward(q, k, v, g, beta, h0, scale, use_qk_l2norm, *args, **kwargs):
        calls.append({"args": args, **{n: kwargs.get(n) for n in expected}})
        return torch.zeros_like(v), None, (q, k, v, g, beta), "meta"

    def backward(saved, meta, do, dht, link=None):
        assert meta == "meta"
        return (*(torch.zeros_like(x) for x in saved), None)

    monkeypatch.setattr(kernels, "gdn_forward", forward)
    monkeypatch.setattr(kernels, "gdn_backward", backward)
    plan = _OneRankPlan(mode=mode, backend="triton", group=None, cp_size=1, mesh=None,
                        options=options)
    q, k = (torch.randn(1, 64, 2, 16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 64, 4, 16, requires_grad=True)
    g, beta = (torch.rand(1, 64, 4, requires_grad=True) for _ in range(2))
    link = ChainLink if mode == "p2p" else ScanLink
    apply_state_passing(q, k, v, g, beta, local_backend(plan, 0.25, 64),
                        ShardTable.dense(1, 64), plan, link).sum().backward()
    assert calls == [{"args": (), **expected}], calls


def test_block_chunks_reaches_every_op_call_of_every_mode() -> None:
    results = run_ranks(options_worker, 2, timeout_s=120.0)
    for rank, res in enumerate(results):
        assert sorted(res) == sorted(f"{m}/{p}" for m in MODES for p in ("dense", "packed"))
        for path, fig in res.items():
            what = f"rank {rank} {path}: {fig}"
            assert fig["calls"] >= 1, what
            assert fig["tuned_calls_carry_options"], what
            assert fig["plain_calls_carry_none"], what
            assert fig["worst"] <= 1e-12, what


@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_chain_and_scan_run_the_options() -> None:
    """The kernels under the interpreter (2 gloo ranks, ~12 s): the options reach
    ``gdn_forward``, which runs the fused forward with 2 segments per rank and leaves w
    unsaved, and the outputs and input gradients still equal the single-process eager layer
    (fp32, rel-L2 <= 1e-5)."""
    results = run_ranks(Interpreted(triton_options_worker), 2, timeout_s=300.0,
                        env=INTERPRETED_RANK_ENV)
    for rank, res in enumerate(results):
        for mode, fig in res.items():
            what = f"rank {rank} mode={mode}: {fig}"
            assert fig["seen"] == [{"num_segments": 2, "recompute_w": True, "fused": True,
                                    "segments_run": 2, "w_saved": False}], what
            assert fig["out"] <= 1e-5 and fig["dx"] <= 1e-5, what
