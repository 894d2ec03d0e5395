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
