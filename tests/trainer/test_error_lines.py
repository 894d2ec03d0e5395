"""One line per failure: ``overlap-runtime train`` prints every error as one line naming what
and where, exits 2 for a configuration, data or checkpoint error and 1 for a runtime fault, and
puts the traceback in a log file the line names (``overlap_runtime.failure``).

What can be checked before a rank starts is checked then (``spawning`` is never printed): the
configuration's rules (duplicate YAML keys, finite and bounded waits, the seed's range, a
bounded learning rate, writable output paths, file descriptors for the ranks), a directory
another run holds, and the first records of every data file. Errors raised inside a rank (a
checkpoint that does not verify, a rank killed) come back as one line too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from tests.support.trainer import tiny_config

from overlap_runtime.cli import main
from overlap_runtime.failure import LOG_DIR_ENV, exit_code
from overlap_runtime.testing import Concurrently, RankFailedError, RankFailure
from overlap_runtime.trainer import config_from_dict
from overlap_runtime.trainer.checkpoint import FAULT_ENV
from overlap_runtime.config.train import apply_overrides, load_config


def _config(tmp_path: Path, name: str = "tiny.yaml", text: str | None = None,
            **overrides: Any) -> Path:
    cfg = tiny_config(steps=3, seq_len=64, cp=2, linear_attention_cp_mode="p2p")
    cfg["train"]["accelerator"]["comm_timeout_s"] = 30.0
    for section, fields in overrides.items():
        cfg.setdefault(section, {}).update(fields)
    path = tmp_path / name
    path.write_text(text if text is not None else yaml.safe_dump(cfg))
    return path


def _one_line(capfd: pytest.CaptureFixture[str], *, code: int, rc: int, names: str) -> str:
    """The command printed exactly one line on stderr, naming ``names``, with a log file; the
    exit code is ``code``; no rank was spawned."""
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert rc == code and len(lines) == 1, (rc, err)
    line = lines[0]
    assert line.startswith("error: ") and names in line, line
    log = Path(line.rsplit("(full traceback: ", 1)[1].rstrip(")"))
    assert log.is_file() and "Traceback" in log.read_text(), line
    assert "spawning" not in out, out
    return line


@pytest.fixture(autouse=True)
def _logs_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "logs"))


# ---- configuration: exit 2 before any rank ---------------------------------------------------

@pytest.mark.parametrize("flags, names", [
    (["--set", "train.seed=1180591620717411303424"], "train.seed"),          # 2**70
    (["--set", "train.seed=-1"], "train.seed"),
    (["--set", "checkpoint.timeout_s=inf"], "checkpoint.timeout_s"),
    (["--set", "train.accelerator.comm_timeout_s=inf"], "train.accelerator.comm_timeout_s"),
    (["--set", "train.accelerator.comm_timeout_s=1e300"], "train.accelerator.comm_timeout_s"),
    (["--set", "optimizer.lr=1e30"], "optimizer.lr"),
    (["--set", "optimizer.lr=nan"], "optimizer.lr"),
    (["--world-size", "100000"], "RLIMIT_NOFILE"),
])
def test_a_value_that_would_fail_or_wait_forever_is_refused(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], flags: list[str], names: str) -> None:
    rc = main(["train", str(_config(tmp_path)), *flags])
    _one_line(capfd, code=2, rc=rc, names=names)


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path: Path,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    rc = main(["train", str(_config(tmp_path)), "--set", f"checkpoint.dir={tmp_path / 'afile'}"])
    _one_line(capfd, code=2, rc=rc, names="exists and is not a directory")


def test_an_uncreatable_metrics_path_is_refused_before_training(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    rc = main(["train", str(_config(tmp_path)), "--metrics", str(tmp_path / "afile" / "m.json")])
    _one_line(capfd, code=2, rc=rc, names="--metrics=")
    rc = main(["train", str(_config(tmp_path, train={"metrics": str(tmp_path / "afile" / "m")}))])
    _one_line(capfd, code=2, rc=rc, names="train.metrics=")
    bad = tiny_config(steps=3)
    bad["train"]["metrics"] = str(tmp_path / "afile" / "m.json")
    with pytest.raises(ValueError, match="train.metrics=.*afile is not a directory"):
        config_from_dict(bad)  # at load, for every caller, not only the command line


def test_duplicate_yaml_keys_are_refused_naming_key_and_lines(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    text = "train: {steps: 2}\nmodel: {hidden_size: 32}\ntrain: {steps: 3}\n"
    rc = main(["train", str(_config(tmp_path, text=text))])
    _one_line(capfd, code=2, rc=rc, names="the key 'train' appears twice in one mapping "
                                          "(lines 1 and 3)")
    nested = "train:\n  steps: 2\n  seed: 1\n  steps: 3\n"
    with pytest.raises(ValueError, match="'steps' appears twice .*lines 2 and 4"):
        load_config(_config(tmp_path, "nested.yaml", text=nested))


def test_a_quoted_set_value_stays_a_string(tmp_path: Path) -> None:
    base = config_from_dict(tiny_config(steps=3))
    c = apply_overrides(base, ['checkpoint.dir="2024"', "checkpoint.resume='7'"])
    assert c.checkpoint.dir == "2024" and c.checkpoint.resume == "7"
    c = apply_overrides(base, ["optimizer.lr=1e-4", "train.steps=7"])  # unquoted: numbers
    assert c.optimizer.lr == 1e-4 and c.train.steps == 7


# ---- data files: their first records read before any rank ------------------------------------

@pytest.mark.parametrize("name, content, names", [
    ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', "bad.jsonl' line 2 is not valid JSON"),
    ("empty.jsonl", b"", "empty.jsonl' is empty"),
    ("latin1.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "latin1.jsonl' line 2 is not UTF-8"),
    ("missing.jsonl", b'{"body": "a"}\n', "data.text_field='text' is not a field of"),
    ("number.jsonl", b'{"text": "a"}\n{"text": 3}\n', "number.jsonl' line 2 holds int"),
    ("latin1.txt", b"ok\n\ncaf\xe9\n", "latin1.txt' line 3 is not UTF-8"),
    ("blank.txt", b" \n\n", "blank.txt' is empty"),
    ("corrupt.parquet", b"PAR1 not really parquet", "corrupt.parquet' is not a readable Parquet"),
])
def test_a_bad_data_file_is_named_with_its_line_before_any_rank(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], name: str, content: bytes,
        names: str) -> None:
    (tmp_path / name).write_bytes(content)
    rc = main(["train", str(_config(tmp_path, data={"files": [str(tmp_path / name)]}))])
    _one_line(capfd, code=2, rc=rc, names=names)


def test_a_non_string_parquet_field_is_named(tmp_path: Path,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None]}), str(tmp_path / "nulls.parquet"))
    pq.write_table(pa.table({"text": [1, 2]}), str(tmp_path / "ints.parquet"))
    for name, names in (("nulls", "row 1 of"), ("ints", "is int64, not a string")):
        path = tmp_path / f"{name}.parquet"
        rc = main(["train", str(_config(tmp_path, data={"files": [str(path)]}))])
        _one_line(capfd, code=2, rc=rc, names=names)


# ---- a directory another run holds ------------------------------------------------------------

def test_a_second_run_on_a_held_checkpoint_dir_is_refused_before_ranks(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    code = ("import sys; from overlap_runtime.trainer.ckpt_lock import DirectoryLock; "
            f"lock = DirectoryLock({str(ckpt)!r}); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        rc = main(["train", str(_config(tmp_path)), "--set", f"checkpoint.dir={ckpt}"])
        _one_line(capfd, code=2, rc=rc, names=f"is in use by another run (pid {holder.pid} on "
                                              f"host ")
    finally:
        holder.communicate(input="", timeout=30)


# ---- errors raised inside a rank: one line too ----------------------------------------------

def _cli(config: Path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "overlap_runtime.cli", "train", str(config), "--quiet", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})


def _corrupted_resume(tmp_path: Path) -> tuple[Any, Any]:
    config, ckpt = _config(tmp_path), tmp_path / "ckpt"
    env = {LOG_DIR_ENV: str(tmp_path / "logs")}
    first = _cli(config, "--set", f"checkpoint.dir={ckpt}", env=env)
    if first.returncode != 0:
        return first, None
    shard = ckpt / "step-00000003" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(raw)
    return first, _cli(config, "--set", f"checkpoint.dir={ckpt}", "--resume", "--steps", "4",
                       env=env)


def _killed_rank(tmp_path: Path) -> Any:
    return _cli(_config(tmp_path), "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
                "--set", "checkpoint.interval=2",
                env={FAULT_ENV: "step=2,rank=1", LOG_DIR_ENV: str(tmp_path / "logs")})


@pytest.fixture(scope="module")
def in_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Concurrently]:
    """The two command lines run in fresh interpreters, side by side."""
    with Concurrently({"corrupted": lambda: _corrupted_resume(tmp_path_factory.mktemp("c")),
                       "killed": lambda: _killed_rank(tmp_path_factory.mktemp("k"))},
                      timeout_s=480) as started:
        yield started


def _stderr_is_one_line(proc: subprocess.CompletedProcess[str], code: int, names: str) -> None:
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: ") and names in lines[0], lines[0]
    log = Path(lines[0].rsplit("(full traceback: ", 1)[1].rstrip(")"))
    assert "--- rank " in log.read_text(), log  # the ranks' tracebacks are in the log


@pytest.mark.slow
def test_a_checkpoint_failing_verification_inside_the_ranks_is_one_line_exit_2(
        in_ranks: Concurrently) -> None:
    first, again = in_ranks.result("corrupted")
    assert first.returncode == 0, first.stderr[-3000:]
    _stderr_is_one_line(again, 2, "__1_0.distcp does not match its sha256")


@pytest.mark.slow
def test_a_killed_rank_is_one_line_exit_1(in_ranks: Concurrently) -> None:
    _stderr_is_one_line(in_ranks.result("killed"), 1,
                        "rank 1 of 2 was killed by signal SIGKILL")


def test_exit_codes_of_rank_failures() -> None:
    def failed(exc_type: str | None) -> RankFailedError:
        f = RankFailure(1, exc_type, "x" if exc_type else "rank 1 of 2 died", "tb")
        return RankFailedError(1, "m", "tb", {1: f})

    assert [exit_code(failed(t)) for t in ("DataError", "CheckpointError", "ConfigError",
                                           "CheckpointException")] == [2, 2, 2, 2]
    assert [exit_code(failed(t)) for t in ("TrainStepError", "FloatingPointError", None)] == \
        [1, 1, 1]
    assert exit_code(KeyboardInterrupt()) == 130
