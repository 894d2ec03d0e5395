"""Shared helpers of the GDN tests: relative L2 error, random inputs, and the Triton
interpreter's child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from overlap_runtime.testing import rel_l2  # noqa: F401  (re-exported for the GDN tests)

_HERE = Path(__file__).resolve().parent


def run_interpreted(script: str, *args: str, timeout_s: float = 300) -> dict:
    """Run ``tests/ops/<script> *args`` in a child process with ``TRITON_INTERPRET=1`` (triton
    reads it when the kernels are first imported, so it must be set before) and return the dict
    of its last ``RESULT <json>`` line; a failing child fails the test with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(_HERE), str(_HERE.parents[1]),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(_HERE / script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s, cwd=str(_HERE))
    assert proc.returncode == 0, (f"{script} {' '.join(args)} failed:\n{proc.stdout}\n"
                                  f"{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def make_inputs(
    batch: int,
    seq_len: int,
    heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    requires_grad: bool = True,
    decay_shift: float = 2.0,
    beta_max: float = 1.0,
) -> dict[str, torch.Tensor]:
    """q, k, v, g (log decay < 0), beta in (0, beta_max) and an initial state, as leaf tensors.

    ``g = logsigmoid(randn + decay_shift)``. The defaults forget fast (beta up to 1 stresses the
    triangular solve); ``decay_shift=4, beta_max=0.2`` keeps ``||M H|| ~ ||S||`` over ~100 tokens
    at K=8, for tests whose assertions must be sensitive to the initial state through M.
    g is fp32 when the other inputs are a half type (the contract), else the same dtype.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    tensors = {
        "q": randn(batch, seq_len, heads, key_dim).to(dtype),
        "k": randn(batch, seq_len, heads, key_dim).to(dtype),
        "v": randn(batch, seq_len, value_heads, value_dim).to(dtype),
        "g": F.logsigmoid(randn(batch, seq_len, value_heads) + decay_shift).to(g_dtype),
        "beta": (beta_max * torch.sigmoid(randn(batch, seq_len, value_heads))).to(dtype),
        "initial_state": randn(batch, value_heads, key_dim, value_dim).to(g_dtype),
    }
    return {name: x.requires_grad_(requires_grad) for name, x in tensors.items()}


def upcast(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 leaf copies of the inputs (for the reference)."""
    return {name: x.detach().double().requires_grad_(x.requires_grad) for name, x in inputs.items()}


def output_grads(
    o: torch.Tensor, state: torch.Tensor, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random cotangents for o and the final state (float64)."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dstate = torch.randn(state.shape, generator=gen, dtype=torch.float64)
    return do, dstate


def loss_of(o: torch.Tensor, state: torch.Tensor, do: torch.Tensor, dstate: torch.Tensor):
    """Scalar ``<o, do> + <state, dstate>`` so every gradient is a fixed linear functional."""
    return (o.double() * do).sum() + (state.double() * dstate).sum()
