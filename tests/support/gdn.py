"""Shared helpers of the GDN tests: relative L2 error, random inputs, and the Triton
interpreter's child process."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from overlap_runtime.ops.gdn.reference import recurrent_gated_delta_rule
from overlap_runtime.testing import rel_l2  # noqa: F401  (re-exported for the GDN tests)

from tests.support.forked_child import ForkedChild


def _default_workers() -> int:
    """Two children at a time fill the two CI cores; under pytest-xdist each worker process
    already holds a core, so each runs its children one at a time."""
    return 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2


def _result(script: str, args: tuple[str, ...], returncode: int, stdout: str, stderr: str
            ) -> dict:
    assert returncode == 0, f"{script} {' '.join(args)} failed:\n{stdout}\n{stderr[-4000:]}"
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_interpreted(script: str, *args: str, timeout_s: float = 300) -> dict:
    """Run ``python -m tests.support.<script> *args`` under the Triton interpreter, forked
    (:class:`tests.support.forked_child.ForkedChild`), and return the dict of its last
    ``RESULT <json>`` line; a failing child fails the test with its output."""
    child = ForkedChild(script, *args)
    stdout, stderr = child.communicate(timeout=timeout_s)
    return _result(script, args, child.returncode, stdout, stderr)


def _selected_cases(request, case_of_test: dict[str, str]) -> list[str]:  # noqa: ANN001
    """The interpreter cases of this module's selected tests, in collection order: a test's
    ``case`` parameter, else ``case_of_test[test function name]``."""
    module = request.module.__name__
    cases = []
    for item in request.session.items:
        if getattr(item, "module", None) is None or item.module.__name__ != module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        case = params.get("case", case_of_test.get(item.originalname))
        if case is not None:
            cases.append(case)
    return cases


def children_fixture(cases: Any, case_of_test: dict[str, str]):  # noqa: ANN201
    """A module-scoped autouse fixture (assign it to a module-level name): the selected tests'
    cases start in ``cases`` (a ``tests.support.case_groups.GroupedCases``), and what still runs
    at the module's end is killed. ``case_of_test`` names the case of each test without a ``case`` parameter."""

    @pytest.fixture(scope="module", autouse=True)
    def _interpreter_children(request):  # noqa: ANN001, ANN202
        if importlib.util.find_spec("triton") is not None:
            cases.start(_selected_cases(request, case_of_test))
        yield
        cases.close()

    return _interpreter_children


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


def per_sequence_reference(ref: dict[str, torch.Tensor], offsets: list[int],
                           initial_states: torch.Tensor | None, l2: bool, do: torch.Tensor,
                           dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 recurrence run on each sequence of a packed batch alone.

    ``ref``: float64 leaves q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV];
    ``offsets``: the N + 1 sequence boundaries; ``initial_states`` [N, HV, K, V] or None (an
    empty sequence's final state is its initial state, or zeros). Backpropagates
    ``<o, do> + <h, dh>`` into the leaves and returns (o [1, T, HV, V], final states
    [N, HV, K, V])."""
    shape = (1, ref["v"].shape[2], ref["q"].shape[3], ref["v"].shape[3])
    outs, finals = [], []
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        h0 = None if initial_states is None else initial_states[i:i + 1]
        if a == b:
            finals.append(h0 if h0 is not None else torch.zeros(shape, dtype=torch.float64))
            continue
        o, h = recurrent_gated_delta_rule(*(ref[n][:, a:b] for n in ("q", "k", "v", "g", "beta")),
                                          initial_state=h0, use_qk_l2norm=l2)
        outs.append(o)
        finals.append(h)
    o_ref, h_ref = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    ((o_ref * do).sum() + (h_ref * dh).sum()).backward()
    return o_ref, h_ref
