"""``python -m benchmarks.profile``: the token-paced relay under py-spy, as a flame graph.

A setting of :mod:`benchmarks.paced`, one event per token at 20 ms, round_robin: ``--mode
regular`` (2 simulators x 4 DP ranks, 200-token streams) or ``--mode pd`` (a prefill and a
decode simulator x 4 DP ranks, 100-token streams), at ``--concurrency`` streams; once the load
generator's window opens, py-spy samples the relay process (``--target ours``, or ``floor`` to
see what hypercorn's trio worker costs on its own) for ``--seconds`` and writes an SVG flame
graph (default ``benchmarks/results/profile-paced-<mode>-<target>.svg``). py-spy comes with the
bench extras (``make profile`` installs them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .paced import PD_CONCURRENCY, PD_LOAD, REGULAR_LOAD, SIM_FLAGS, start_floor
from .procs import LoadRun, ProcessSet, start_router, start_sim

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--target", choices=("ours", "floor"), default="ours")
    p.add_argument("--mode", choices=("regular", "pd"), default="regular")
    p.add_argument(
        "--concurrency", type=int, default=None, help=f"default 256, PD {PD_CONCURRENCY}"
    )
    p.add_argument("--seconds", type=float, default=15.0, help="seconds sampled")
    p.add_argument("--rate", type=int, default=200, help="samples per second")
    p.add_argument(
        "--format", choices=("flamegraph", "raw"), default="flamegraph", help="raw: folded stacks"
    )
    p.add_argument("--out", type=Path, default=None, help="the file to write")
    args = p.parse_args(argv)
    suffix = "svg" if args.format == "flamegraph" else "txt"
    out: Path = args.out or HERE / "results" / f"profile-paced-{args.mode}-{args.target}.{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="trio-pdrouter-profile-"))
    print(f"process logs in {logs}", flush=True)
    procs = ProcessSet(logs)
    try:
        if args.mode == "pd":
            prefill = start_sim(procs, "sim-prefill", "--role", "prefill", *SIM_FLAGS)
            decode = start_sim(procs, "sim-decode", "--role", "decode", *SIM_FLAGS)
            flags = ["--prefill", prefill.url, "--decode", decode.url]
            ours = ["--vllm-pd-disaggregation", *flags]
            shape, concurrency = PD_LOAD, PD_CONCURRENCY
        else:
            sims = [start_sim(procs, f"sim-{i}", "--role", "both", *SIM_FLAGS) for i in range(2)]
            flags = ours = ["--worker-urls", *(s.url for s in sims)]
            shape, concurrency = REGULAR_LOAD, 256
        if args.target == "ours":
            relay = start_router(procs, "ours", "ours", [*ours, "--policy", "round_robin"])
        else:
            relay = start_floor(procs, "floor", flags)
        load = LoadRun(
            procs,
            "load",
            ["--url", relay.url, *shape, "--warmup", "3", "--seconds", str(args.seconds)],
            processes=2,
            concurrency=args.concurrency or concurrency,
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
        f"{cpu / max(1, result['events']) * 1e6:.1f} µs CPU per event, "
        f"{cpu / max(1, result['ok']) * 1e3:.2f} ms per request; flame graph {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
