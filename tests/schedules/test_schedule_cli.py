"""``overlap-runtime schedule``: output, trace file, CSV, plot."""

from __future__ import annotations

import json
import sys

import pytest

from overlap_runtime.cli import main


def test_schedule_command_prints_grid_and_bubble_and_writes_trace(  # type: ignore[no-untyped-def]
    tmp_path, capsys
) -> None:
    trace = tmp_path / "trace.json"
    csv_path = tmp_path / "s.csv"
    rc = main(["schedule", "--kind", "interleaved_1f1b", "--pp", "4", "--microbatches", "8",
               "--virtual", "2", "--overlap-b-f", "--cost-b", "1", "--trace", str(trace),
               "--csv", str(csv_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "(4B0;0F7)OVERLAP_B_F" in out          # the action grid
    assert "0SEND_F0" in out
    assert "rank 3" in out and "|" in out          # the timeline
    assert "bubble 0.1579" in out                  # 3 / 19 with equal costs
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    names = {e["name"] for e in spans}
    assert {"4B0", "0F7", "0SEND_F0", "1RECV_F0"} <= names
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "fwd", "bwd", "comm:pp"} <= threads
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)
    assert csv_path.read_text().splitlines()[0].startswith("0F0,0F1,")


def test_schedule_command_rejects_a_bad_spec(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["schedule", "--kind", "gpipe", "--virtual", "2", "--trace", ""])
    assert rc == 2
    assert "out of range for kind='gpipe'" in capsys.readouterr().err


def test_plot_needs_matplotlib(  # type: ignore[no-untyped-def]
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib`` fail
    rc = main(["schedule", "--pp", "2", "--microbatches", "2", "--trace", "",
               "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plot_writes_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main(["schedule", "--pp", "2", "--microbatches", "3", "--trace", "", "--no-grid",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag, value", [("--cost-f", "inf"), ("--cost-b", "nan"),
                                         ("--cost-i", "-1"), ("--cost-w", "-inf"),
                                         ("--comm-latency", "inf")])
def test_costs_must_be_finite_and_non_negative(flag: str, value: str, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["schedule", "--pp", "2", "--microbatches", "2", "--trace", "", "--no-grid",
               f"{flag}={value}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{flag}={float(value)}" in err and "finite number >= 0" in err, err
