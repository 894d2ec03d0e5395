"""Shared pytest settings: CPU only, one intra-op thread in the test process."""

import os

import torch

os.environ.setdefault("OVERLAP_RUNTIME_COMM_TIMEOUT_S", "60")
torch.set_num_threads(1)
