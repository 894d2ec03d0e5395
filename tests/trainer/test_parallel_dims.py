"""ParallelDims: the layout rules (no process group) and the meshes on real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer.parallel_dims import ParallelDims


def test_dp_shard_takes_the_rest_of_the_world() -> None:
    dims = ParallelDims(world_size=8, pp=2, cp=2)
    assert dims.dp_shard == 2 and dims.dp == 2 and dims.efsdp == 4


@pytest.mark.parametrize("kwargs, needle", [
    ({"world_size": 8, "dp_shard": 2, "cp": 2, "pp": 1}, "must equal world_size=8"),
    ({"world_size": 4, "dp_shard": 1, "cp": 2, "pp": 2, "ep": 4}, "ep=4 must divide dp_shard x cp"),
    ({"world_size": 6, "dp_shard": -1, "cp": 4}, "cp=4 does not divide world_size=6"),
    ({"world_size": 4, "cp": 0}, "cp=0 must be a positive integer"),
])
def test_invalid_layouts_name_the_fields(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match="invalid parallel layout") as info:
        ParallelDims(**kwargs)
    assert needle in str(info.value)


def test_coordinates_cover_the_world_once() -> None:
    dims = ParallelDims(world_size=16, pp=2, dp_replicate=2, dp_shard=2, cp=2, ep=4)
    seen = {tuple(dims.coordinates(r)[k] for k in ("pp", "dp_replicate", "dp_shard", "cp"))
            for r in range(16)}
    assert len(seen) == 16
    # ep groups: consecutive ranks of one (pp, dp_replicate) block of dp_shard x cp = 4 ranks
    assert [dims.coordinates(r)["ep"] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [dims.coordinates(r)["efsdp"] for r in range(8)] == [0] * 4 + [0] * 4
    dims = ParallelDims(world_size=8, dp_shard=4, cp=2, ep=2)  # efsdp = 4
    assert [dims.coordinates(r)["ep"] for r in range(8)] == [0, 1] * 4
    assert [dims.coordinates(r)["efsdp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def _mesh_worker(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    dims = ParallelDims(world_size=world, **kwargs)
    dims.build_meshes("cpu")
    coords = dims.coordinates(rank)
    out: dict[str, Any] = {}
    for name in ("pp", "cp", "ep", "efsdp", "dp", "dp_shard_cp", "dp_cp"):
        mesh = dims.mesh(name)
        ranks = sorted(dist.get_process_group_ranks(mesh.get_group()))
        out[name] = (mesh.get_local_rank(), ranks)
    out["coords"] = coords
    return out


@pytest.mark.timeout(120)
def test_meshes_match_the_coordinates() -> None:
    kwargs = {"pp": 2, "dp_shard": 2, "cp": 1, "ep": 2}
    results = run_ranks(_mesh_worker, 4, args=(kwargs,))
    _check_meshes(results)
    # pp outermost: ranks 0,1 are pipeline stage 0, ranks 2,3 stage 1; EP pairs share a stage
    assert results[0]["pp"][1] == [0, 2] and results[0]["ep"][1] == [0, 1]


@pytest.mark.timeout(120)
def test_expert_meshes_when_ep_is_a_part_of_dp_shard_cp() -> None:
    results = run_ranks(_mesh_worker, 4, args=({"dp_shard": 2, "cp": 2, "ep": 2},))
    _check_meshes(results)
    assert results[0]["ep"][1] == [0, 1] and results[0]["efsdp"][1] == [0, 2]
    assert results[0]["cp"][1] == [0, 1] and results[0]["dp"][1] == [0, 2]


def _check_meshes(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        c = res["coords"]
        for name in ("pp", "cp", "ep", "efsdp", "dp"):
            assert res[name][0] == c[name], (rank, name, res[name], c)
        # every member of a group agrees on its members, and the group has the degree's size
        for name in ("pp", "ep", "efsdp", "dp_shard_cp", "dp_cp"):
            for other in res[name][1]:
                assert results[other][name][1] == res[name][1]
