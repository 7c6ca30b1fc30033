"""``python -m benchmarks.profile``: the token-paced relay under py-spy, as a flame graph.

The regular-mode setting of :mod:`benchmarks.paced` (2 simulators x 4 DP ranks, one event per
token at 20 ms, 200-token streams, round_robin) at ``--concurrency`` streams; once the load
generator's window opens, py-spy samples the relay process (``--target ours``, or ``floor`` to
see what hypercorn's trio worker costs on its own) for ``--seconds`` and writes an SVG flame
graph (default ``benchmarks/results/profile-paced-<target>.svg``). py-spy comes with the bench
extras (``make profile`` installs them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .paced import REGULAR_LOAD, SIM_FLAGS, start_floor
from .procs import LoadRun, ProcessSet, start_router, start_sim

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--target", choices=("ours", "floor"), default="ours")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--seconds", type=float, default=15.0, help="seconds sampled")
    p.add_argument("--rate", type=int, default=200, help="samples per second")
    p.add_argument(
        "--format", choices=("flamegraph", "raw"), default="flamegraph", help="raw: folded stacks"
    )
    p.add_argument("--out", type=Path, default=None, help="the file to write")
    args = p.parse_args(argv)
    suffix = "svg" if args.format == "flamegraph" else "txt"
    out: Path = args.out or HERE / "results" / f"profile-paced-{args.target}.{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="trio-pdrouter-profile-"))
    print(f"process logs in {logs}", flush=True)
    procs = ProcessSet(logs)
    try:
        sims = [start_sim(procs, f"sim-{i}", "--role", "both", *SIM_FLAGS) for i in range(2)]
        workers = ["--worker-urls", *(s.url for s in sims)]
        if args.target == "ours":
            relay = start_router(procs, "ours", "ours", [*workers, "--policy", "round_robin"])
        else:
            relay = start_floor(procs, "floor", workers)
        load = LoadRun(
            procs,
            "load",
            ["--url", relay.url, *REGULAR_LOAD, "--warmup", "3", "--seconds", str(args.seconds)],
            processes=2,
            concurrency=args.concurrency,
            watch=relay,
        )
        deadline = time.monotonic() + 120.0
        while not load.measuring and time.monotonic() < deadline:
            time.sleep(0.05)
        spy = [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--pid",
            str(relay.popen.pid),
            "--duration",
            str(int(args.seconds)),
            "--rate",
            str(args.rate),
            "--nonblocking",
            "--format",
            args.format,
            "--output",
            str(out),
        ]
        subprocess.run(spy, check=True)
        result = load.wait(timeout=args.seconds + 60.0)
    finally:
        procs.close()
    cpu = result.get("router_cpu_s", float("nan"))
    print(
        f"{args.target}: {result['events'] / result['window_s']:,.0f} events/s, "
        f"{cpu / max(1, result['events']) * 1e6:.1f} µs CPU per event; flame graph {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
