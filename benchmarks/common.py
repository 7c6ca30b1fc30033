"""What every scenario shares: statistics, the progress display, the run context."""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from .procs import LoadRun, ProcessSet, Service, find_vllm_router

Config = tuple[str, str, list[str]]


def table_cell(text: str) -> str:
    """``text`` fit for a markdown table cell: a character that is not printable (a peer's raw
    bytes, say) as its ``\\xNN`` escape, and ``|`` escaped."""
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return shown.replace("|", "\\|")


def chosen_configs(configs: Sequence[Config], env: str, vllm_router: bool) -> list[Config]:
    """The ``(label, router kind, flags)`` rows a run takes: vllm-router's only when it is
    installed, and, when the environment variable ``env`` is set, only those whose label
    contains one of its ``|``-separated parts."""
    parts = [part for part in os.environ.get(env, "").split("|") if part]
    return [
        c
        for c in configs
        if (c[1] == "ours" or vllm_router) and (not parts or any(x in c[0] for x in parts))
    ]


#: A scenario's result file: ``<date>-<scenario>.json``.
_RESULT_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-(?P<scenario>.+)\.json")


def scenario_results(directory: Path, scenario: str) -> list[Path]:
    """``scenario``'s result files in ``directory``, oldest first. A run kept under a longer
    name (``<date>-kv_aware-rounds-rel-1.5-workers.json``) is not one of them, whatever its
    name ends with."""
    found = []
    for path in directory.glob("*.json"):
        named = _RESULT_NAME.fullmatch(path.name)
        if named is not None and named["scenario"] == scenario:
            found.append(path)
    return sorted(found)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def histogram_percentile(counts: Sequence[int], bucket: float, q: float) -> float:
    """The ``q`` quantile (0..1) of a histogram of ``bucket``-wide counts from 0, by nearest
    rank, as the bucket's upper edge; NaN for no values."""
    total = sum(counts)
    if not total:
        return math.nan
    rank = min(total, max(1, math.ceil(q * total)))
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return (i + 1) * bucket
    return len(counts) * bucket


def median(values: Sequence[float]) -> float:
    """The median of the finite ``values``; NaN if there are none."""
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def latency_summary(run: dict[str, Any]) -> dict[str, float]:
    """p50/p99 of time to first byte and total latency, in milliseconds, and requests/s."""
    window = run["window_s"] or math.nan
    return {
        "ttfb_p50_ms": percentile(run["ttfb"], 0.50) * 1e3,
        "ttfb_p99_ms": percentile(run["ttfb"], 0.99) * 1e3,
        "total_p50_ms": percentile(run["total"], 0.50) * 1e3,
        "total_p99_ms": percentile(run["total"], 0.99) * 1e3,
        "req_per_s": run["ok"] / window,
        "failed": run["failed"],
    }


def median_of_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric key, the median over repeated runs (keys missing from a run are skipped)."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k, v in run.items() if isinstance(v, int | float) and k not in keys]
    return {k: median([r[k] for r in runs if isinstance(r.get(k), int | float)]) for k in keys}


class Progress:
    """One status line: scenario, phase, and an estimate of the time left in the whole run.

    On a terminal the line is redrawn in place; otherwise a line is printed per phase.
    """

    def __init__(self, estimates: dict[str, float], out: TextIO = sys.stderr) -> None:
        self.estimates = dict(estimates)
        self.out = out
        self.tty = out.isatty()
        self.scenario = ""
        self.scenario_started = time.monotonic()
        self.phase_text = ""
        self._remaining_after: float = 0.0

    def start_scenario(self, name: str) -> None:
        names = list(self.estimates)
        self.scenario = name
        self.scenario_started = time.monotonic()
        self._remaining_after = sum(self.estimates[n] for n in names[names.index(name) + 1 :])
        self._emit(f"== scenario {name}", newline=True)

    def time_left(self) -> float:
        spent = time.monotonic() - self.scenario_started
        return max(0.0, self.estimates.get(self.scenario, 0.0) - spent) + self._remaining_after

    def phase(self, text: str) -> None:
        self.phase_text = text
        self.refresh(newline=not self.tty)

    def refresh(self, newline: bool = False) -> None:
        """Redraw the line (on a terminal; elsewhere only when ``newline``: once per phase)."""
        if not (self.tty or newline):
            return
        left = self.time_left()
        line = f"[{self.scenario}] {self.phase_text}  ~{int(left) // 60}:{int(left) % 60:02d} left"
        self._emit(line, newline=newline)

    def note(self, text: str) -> None:
        """A message that stays (a skipped comparison, a warning)."""
        self._emit(text, newline=True)

    def _emit(self, line: str, newline: bool) -> None:
        if self.tty:
            self.out.write("\r\x1b[K" + line + ("\n" if newline else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def done(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


@attrs.define
class Context:
    """What a scenario gets: the profile, where to put logs, the progress line, vllm-router."""

    profile: str
    log_dir: Path
    progress: Progress
    vllm_router: str | None = attrs.field(factory=find_vllm_router)

    def note_vllm_missing(self) -> str:
        text = (
            "vllm-router not found (looked at $VLLM_ROUTER, .venv-bench-vllm-router/bin, PATH): "
            "its rows are skipped. `make bench` installs it with pip."
        )
        self.progress.note(text)
        return text

    def router_kinds(self, notes: list[str]) -> list[tuple[str, str]]:
        """``(label, kind)`` of the routers to run side by side: ours, and vllm-router when it
        is installed (else a note saying its rows are skipped goes into ``notes``)."""
        kinds = [("trio-pdrouter", "ours")]
        if self.vllm_router:
            kinds.append(("vllm-router", "vllm"))
        else:
            notes.append(self.note_vllm_missing())
        return kinds


def cdf_points(values: Sequence[float], points: int = 101) -> list[float]:
    """``points`` evenly spaced quantiles (0 %..100 %) of ``values``, in milliseconds."""
    if not values:
        return []
    ordered = sorted(values)
    last = len(ordered) - 1
    return [ordered[round(i * last / (points - 1))] * 1e3 for i in range(points)]


def run_load(
    ctx: Context,
    procs: ProcessSet,
    name: str,
    url: str,
    flags: Sequence[str],
    *,
    concurrency: int,
    router: Service | None,
    seconds: float,
    processes: int = 1,
    tick: Callable[[bool], None] | None = None,
) -> dict[str, Any]:
    """Run the load generator(s) against ``url`` and return the merged results, plus
    ``router_cpu_s`` over the measured window and ``router_peak_rss`` when ``router`` is set.
    ``seconds`` is warm-up + window, for the time-out; ``tick(measuring)`` is called about
    every 0.25 s while the load runs."""
    run = LoadRun(
        procs,
        name,
        ["--url", url, *flags],
        processes=processes,
        concurrency=concurrency,
        watch=router,
    )

    def on_tick() -> None:
        ctx.progress.refresh()
        if tick is not None:
            tick(run.measuring)

    result = run.wait(timeout=seconds + 120.0, tick=on_tick)
    if router is not None:
        if not router.alive():
            raise RuntimeError(f"{router.name} died during the run:\n{router.log_tail()}")
        result["router_peak_rss"] = router.peak_rss()
    return result
