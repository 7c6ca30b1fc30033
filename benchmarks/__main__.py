"""``python -m benchmarks --profile quick|full [--only SCENARIO ...]``: run, save, report.

Scenarios run in order of importance: routing (4), paced (2, token-paced relay cost against
the floor), overhead (1), relay (2b, coalesced), memory (3), radix_tree (5), cluster (6),
workers (7), caps (memory caps), mixed (8, token-weighted load), kv_ownership (10, second pulls
and stranded prefill KV when clients leave), tracing (11, router CPU per request with
``--otlp-traces-endpoint`` against without), admission (12, priority and fair share between
tenants under overload). Each writes
``benchmarks/results/<date>-<scenario>.json``; then ``benchmarks/report.md`` is rebuilt from
the newest result of every scenario. Process logs (routers, simulators, load generators) go to
a fresh temporary directory, printed at the start.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from . import (
    admission,
    caps,
    cluster,
    kv_aware,
    kv_ownership,
    memory,
    mixed,
    overhead,
    paced,
    radix_tree,
    relay,
    report,
    routing,
    tracing,
    workers,
)
from .common import Context, Progress


def _radix(ctx: Context) -> dict[str, Any]:
    ctx.progress.phase("insert + match as the tree fills")
    return {"scenario": "radix_tree", **radix_tree.run(ctx.profile)}


def _radix_estimate(profile: str) -> float:
    return 5.0 if profile == "quick" else 60.0


SCENARIOS: dict[str, tuple[Callable[[Context], dict[str, Any]], Callable[[str], float]]] = {
    "routing": (routing.run, routing.estimate),
    "paced": (paced.run, paced.estimate),
    "overhead": (overhead.run, overhead.estimate),
    "relay": (relay.run, relay.estimate),
    "memory": (memory.run, memory.estimate),
    "radix_tree": (_radix, _radix_estimate),
    "cluster": (cluster.run, cluster.estimate),
    "workers": (workers.run, workers.estimate),
    "kv_aware": (kv_aware.run, kv_aware.estimate),
    "caps": (caps.run, caps.estimate),
    "mixed": (mixed.run, mixed.estimate),
    "kv_ownership": (kv_ownership.run, kv_ownership.estimate),
    "tracing": (tracing.run, tracing.estimate),
    "admission": (admission.run, admission.estimate),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--profile", choices=("quick", "full"), default="quick")
    parser.add_argument(
        "--only", nargs="+", choices=list(SCENARIOS), default=None, help="scenarios to run"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild report.md from saved results"
    )
    args = parser.parse_args(argv)
    command = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.report_only:
        print(f"wrote {report.write_report(command)}")
        return 0
    chosen = args.only or list(SCENARIOS)
    progress = Progress({name: SCENARIOS[name][1](args.profile) for name in chosen})
    logs = Path(tempfile.mkdtemp(prefix="trio-pdrouter-bench-"))
    print(f"profile {args.profile}: {', '.join(chosen)}; process logs in {logs}", flush=True)
    ctx = Context(args.profile, logs, progress)
    report.RESULTS.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    started = time.monotonic()
    failed: list[str] = []
    for name in chosen:
        progress.start_scenario(name)
        begun = time.monotonic()
        try:
            result = SCENARIOS[name][0](ctx)
        except Exception:
            # One broken scenario should not cost the others their results.
            failed.append(name)
            progress.note(f"scenario {name} failed:\n{traceback.format_exc()}")
            continue
        result["seconds"] = time.monotonic() - begun
        result["date"] = date
        dest = report.RESULTS / f"{date}-{name}.json"
        tmp = dest.with_suffix(".json.tmp")
        tmp.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        tmp.replace(dest)
        progress.note(f"scenario {name}: {result['seconds']:.0f} s, saved {dest}")
    progress.done()
    path = report.write_report(command)
    print(f"wrote {path} in {time.monotonic() - started:.0f} s", flush=True)
    if failed:
        print(f"failed scenarios: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
