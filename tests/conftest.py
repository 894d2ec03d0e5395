"""Shared pytest settings: CPU only, one intra-op thread in the test process; ranks start with
pytest imported.

A rank function defined in a test module makes each rank import that module, and with it
pytest: ~0.4 s of CPU per rank, ~1.8 s of wall for four ranks on two cores, paid by every
spawn. The forkserver the ranks fork from imports it once per test process instead."""

import os

import torch

from overlap_runtime import rank_start

rank_start.preload_in_forkserver("pytest")

os.environ.setdefault("OVERLAP_RUNTIME_COMM_TIMEOUT_S", "60")
# torch.compile's C++ builds run in this process (and in each rank) instead of a pool of fresh
# worker interpreters: on two cores the pool's start-up (torch imported per worker) cost more
# than its parallel builds saved (tests/layers/test_elementwise.py's compiled run, cold cache:
# 41.5 s -> 34.9 s of wall)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch.set_num_threads(1)

#: The longest test files first (seconds of one fresh-clone run on two cores, summed over each
#: file's tests), then the rest in collection order. pytest-xdist (``--dist loadfile
#: --no-loadscope-reorder``, the Makefile's) hands whole files to the workers in this order, so
#: the last files a worker takes are short ones and the workers finish together; its own default
#: order (most tests per file first) left files of few long tests for the end. A stale figure
#: only costs balance. test_elementwise.py is left out: it runs after test_trainer_alignment.py
#: has compiled the same single-device graphs (a cache hit instead of a second build).
LONGEST_FILES = {
    "trainer/test_trainer_alignment.py": 80, "context_parallel/test_packed_cp_triton.py": 72,
    "test_examples.py": 56, "trainer/test_checkpoint.py": 53, "ops/test_gdn_triton.py": 48,
    "ops/test_gdn_triton_varlen.py": 44, "ops/test_gdn_triton_fused.py": 38,
    "trainer/test_trainer_cli.py": 37, "context_parallel/test_packed_cp.py": 32,
    "trainer/test_trainer_4d.py": 31, "test_launch.py": 28, "trainer/test_error_lines.py": 26,
    "context_parallel/test_gdn_cp_prefix_scan.py": 26, "context_parallel/test_gdn_cp_triton.py": 26,
    "test_demo.py": 25, "ops/test_comm.py": 19, "context_parallel/test_gdn_cp_modes.py": 18,
    "trainer/test_trainer_failures.py": 18, "trainer/test_bf16_numerics.py": 18,
}


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001
    """Reorder: the files of :data:`LONGEST_FILES` first, longest first (a stable sort: the
    tests of a file keep their order)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))

    def weight(item) -> float:  # noqa: ANN001
        rel = os.path.relpath(str(item.path), tests_dir).replace(os.sep, "/")
        return -LONGEST_FILES.get(rel, 0)

    items.sort(key=weight)
