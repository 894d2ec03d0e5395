"""Launch-ahead (trainer.launch_ahead): step n+1's forward and backward are launched before step
n's numbers are read; no update is launched before the previous step was checked; drained steps
are finished before the next launch; runs with and without it train identically (real gloo
ranks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from overlap_runtime.testing import run_ranks
from overlap_runtime.trainer import config_from_dict
from overlap_runtime.trainer.launch_ahead import queue_scalars, to_device, wait_for
from overlap_runtime.trainer.loop import _run


def _loop(steps: int, launch_ahead: bool, drained: set[int], nan_at: int | None = None
          ) -> tuple[list[str], Any]:
    """Run the loop on a tiny linear model; returns (the order of what happened, optimizer)."""
    torch.manual_seed(0)
    config = config_from_dict({"train": {"steps": steps}, "metrics": {"progress": "off"}})
    lin = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    log: list[str] = []
    opt.register_step_post_hook(lambda *_: log.append(f"opt{len(opt_steps) + 1}")
                                or opt_steps.append(1))
    opt_steps: list[int] = []
    x = torch.randn(8, 4)

    def step_fn(batch: Any) -> torch.Tensor:
        log.append(f"fwd{batch.step}")
        loss = lin(x).pow(2).mean()
        if batch.step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        return loss.detach()

    def norm_fn() -> torch.Tensor:
        log.append(f"norm{len(opt_steps) + 1}")
        return torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)

    _run(config, opt, sched, torch.device("cpu"),
         lambda s: SimpleNamespace(step=s + 1, global_tokens=8), step_fn, norm_fn,
         distributed=False, log=None, on_step=lambda m: log.append(f"done{m.step}"),
         after_step=lambda s, total: log.append(f"after{s}"), launch_ahead=launch_ahead,
         drain_after=lambda s: s in drained)
    return log, opt_steps


def test_next_forward_is_launched_before_the_step_is_finished() -> None:
    log, _ = _loop(4, True, drained={2})
    assert log == ["fwd1", "norm1", "opt1",
                   "fwd2", "done1", "after1", "norm2", "opt2", "done2", "after2",  # drained
                   "fwd3", "norm3", "opt3",
                   "fwd4", "done3", "after3", "norm4", "opt4", "done4", "after4"]  # last


def test_without_launch_ahead_each_step_is_finished_first() -> None:
    log, _ = _loop(3, False, drained=set())
    assert log == ["fwd1", "norm1", "opt1", "done1", "after1",
                   "fwd2", "norm2", "opt2", "done2", "after2",
                   "fwd3", "norm3", "opt3", "done3", "after3"]


def test_update_count_when_a_step_is_not_finite() -> None:
    captured: dict[str, Any] = {}
    original = torch.optim.SGD.step

    def counting(self: Any, *a: Any, **k: Any) -> Any:
        captured["n"] = captured.get("n", 0) + 1
        return original(self, *a, **k)

    torch.optim.SGD.step = counting  # type: ignore[method-assign]
    try:
        with pytest.raises(FloatingPointError, match="step 2"):
            _loop(4, True, drained=set(), nan_at=2)
    finally:
        torch.optim.SGD.step = original  # type: ignore[method-assign]
    assert captured["n"] == 2  # steps 1 and 2 updated; step 3 never reached its update


def test_wait_is_bounded_and_names_the_step() -> None:
    class Never:
        def query(self) -> bool:
            return False

    with pytest.raises(TimeoutError, match="training step 7"):
        wait_for(Never(), 0.05, "training step 7")


def test_cpu_tensors_and_scalars_stay_put() -> None:
    x = torch.arange(3)
    assert to_device(x, torch.device("cpu")) is x
    host, done = queue_scalars(torch.tensor([2.5]), torch.tensor(0.5), torch.device("cpu"))
    assert done.query() and host.tolist() == [2.5, 0.5]


def _config(launch_ahead: bool, ckpt: str) -> dict[str, Any]:
    return {
        "model": {"hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
                  "full_attention_interval": 2},
        "data": {"seq_len": 16, "batch_size": 2},
        "train": {"steps": 4, "launch_ahead": launch_ahead,
                  "accelerator": {"device": "cpu", "world_size": 2, "cp": 1}},
        "checkpoint": {"dir": ckpt, "interval": 2},
        "metrics": {"progress": "off"},
    }


def _both(rank: int, world: int, root: str) -> list[tuple[list[tuple[float, float]], list[str]]]:
    """Train with and without launch-ahead; per run the (loss, grad norm) of each step and the
    order of forwards, finished steps and checkpoint saves on this rank."""
    from overlap_runtime.trainer import train_distributed
    from overlap_runtime.trainer.checkpoint import Checkpointer
    from overlap_runtime.trainer.observe import RunObserver

    order: list[str] = []
    save, observe = Checkpointer.save, RunObserver.__call__

    def saving(self: Any, step: int) -> None:
        order.append(f"save{step}")
        save(self, step)

    def observing(self: Any, m: Any) -> None:
        order.append(f"done{m.step}")
        observe(self, m)

    def on_model(pm: Any) -> None:
        model = pm.parts[0]
        forward = model.forward
        model.forward = lambda *a, **k: order.append("fwd") or forward(*a, **k)

    Checkpointer.save, RunObserver.__call__ = saving, observing  # type: ignore[method-assign]
    runs = []
    for ahead in (True, False):
        order.clear()
        cfg = config_from_dict(_config(ahead, f"{root}/{ahead}"))
        res = train_distributed(cfg, torch.device("cpu"), log=lambda s: None, on_model=on_model)
        runs.append(([(m.loss, m.grad_norm) for m in res.steps], list(order)))
    return runs


def test_runs_with_and_without_launch_ahead_are_equal(tmp_path: Any) -> None:
    out = run_ranks(_both, 2, args=(str(tmp_path),), timeout_s=180)
    for (ahead, ahead_order), (plain, plain_order) in out:
        assert len(ahead) == 4 and ahead == plain
        # the checkpoint step is drained: its save comes before the next forward
        assert ahead_order == ["fwd", "fwd", "done1", "done2", "save2",
                               "fwd", "fwd", "done3", "done4", "save4"]
        assert plain_order == ["fwd", "done1", "fwd", "done2", "save2",
                               "fwd", "done3", "fwd", "done4", "save4"]
