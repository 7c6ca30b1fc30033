"""``make demo``: runs headless to completion, stops on Ctrl-C with a summary, renders a view."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from demo.run import LoadStats, plain_line, render

DEMO = [sys.executable, "-m", "demo", "--concurrency", "8"]
#: ``python -m demo`` finds the package in the repository, not in the installed distribution.
REPO = Path(__file__).resolve().parent.parent

LOADS = {
    "prefill": {"http://p:1@0": 1, "http://p:1@1": 0},
    "decode": {"http://d:2@0": 3, "http://d:2@1": 2},
    "engine": {"http://p:1@0": 1, "http://p:1@1": 0, "http://d:2@0": 2},
    "drift": {"http://p:1@0": 0, "http://p:1@1": 0, "http://d:2@0": 1},
}


def check_summary(stdout: str) -> None:
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("summary: ")
    assert int(summary.split()[1]) > 0
    assert " 0 failed" in summary
    assert "prefill drift 0 in" in summary and "decode drift 0 in" in summary


def test_demo_runs_headless_to_completion() -> None:
    result = subprocess.run(
        [*DEMO, "--seconds", "3"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout  # no terminal: no escape codes
    plain = [line for line in result.stdout.splitlines() if line.startswith("t=")]
    assert plain and "decode_router=" in plain[0] and "decode_drift=" in plain[0]
    check_summary(result.stdout)


def test_ctrl_c_stops_the_demo_with_a_summary() -> None:
    with subprocess.Popen(
        [*DEMO, "--seconds", "600"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as demo:
        assert demo.stdout is not None
        first = demo.stdout.readline()  # the first plain line: the demo is up and loaded
        assert first.startswith("t="), first
        demo.send_signal(signal.SIGINT)
        stdout, stderr = demo.communicate(timeout=60)
    assert demo.returncode == 0, stderr
    assert "aborted" not in stdout
    check_summary(stdout)


def test_the_view_shows_router_engine_and_drift_per_endpoint() -> None:
    stats = LoadStats(done=3, ttfb=[0.1, 0.2, 0.3])
    view = render("http://127.0.0.1:1", LOADS, stats, left=12.0)
    rows = {line.split()[0]: line.split()[1:] for line in view if line.startswith("http://")}
    # role, router (at the scrape: engine + drift), engine, drift
    assert rows["http://p:1@0"] == ["prefill", "1", "1", "0"]
    assert rows["http://d:2@0"] == ["decode", "3", "2", "+1"]
    # no scrape for this endpoint: the live router load, the engine unknown
    assert rows["http://d:2@1"] == ["decode", "2", "?", "?"]
    assert "requests done 3" in view[-1] and "p50 200 ms" in view[-1]


def test_plain_line_and_summary_count_drift_per_role() -> None:
    stats = LoadStats(done=1, ttfb=[0.05])
    stats.saw(LOADS)
    stats.saw({**LOADS, "drift": {}})
    line = plain_line(2.0, LOADS, stats)
    assert "decode_router=5 decode_engine=2" in line
    assert "prefill_drift=0 decode_drift=1" in line
    summary = stats.summary()
    assert "prefill drift 0 in 100% of 2 views (max 0)" in summary
    assert "decode drift 0 in 50% of 2 views (max 1)" in summary
