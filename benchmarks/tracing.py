"""Scenario 11, tracing: the router's CPU per request with ``--otlp-traces-endpoint`` (sampling
1.0: every request a SERVER span and a CLIENT span per leg) against tracing off.

Two PD routers over the same zero-latency simulators (``--fast``), one tracing into an OTLP/HTTP
sink in this process (a stdlib server that reads each export and answers 200, in a thread), one
not; closed loops of 16 clients, 16-token requests, streaming. The routers take turns (off on
off on ...); the figure is the router's CPU seconds per 1000 requests (user + system, psutil,
over the measured window), the median over rounds, and the ratio on/off.
"""

from __future__ import annotations

import http.server
import threading
from typing import Any

from .common import Context, latency_summary, median, run_load
from .procs import ProcessSet, Service, start_router, start_sim

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"warmup": 0.5, "seconds": 3.0, "repeats": 2},
    "full": {"warmup": 2.0, "seconds": 10.0, "repeats": 5},
}
CONCURRENCY = 16
LOAD_FLAGS = ["--max-tokens", "16", "--suffix-chars", "64", "--stream"]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    return float(2 * p["repeats"] * (p["warmup"] + p["seconds"] + 0.8) + 10)


class _Sink:
    """An OTLP/HTTP endpoint that accepts every export (and counts them)."""

    def __init__(self) -> None:
        self.exports = 0
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                sink.exports += 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    result: dict[str, Any] = {
        "scenario": "tracing",
        "profile": ctx.profile,
        "settings": {**p, "concurrency": CONCURRENCY, "load": LOAD_FLAGS, "sim": "--fast"},
        "notes": [],
    }
    procs = ProcessSet(ctx.log_dir / "tracing")
    sink = _Sink()
    try:
        ctx.progress.phase("starting simulators and routers")
        prefill = start_sim(procs, "sim-prefill", "--role", "prefill", "--fast")
        decode = start_sim(procs, "sim-decode", "--role", "decode", "--fast")
        pd = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url]
        traced = [*pd, "--otlp-traces-endpoint", sink.url, "--otlp-traces-sample-ratio", "1.0"]
        targets: dict[str, Service] = {
            "off": start_router(procs, "ours-untraced", "ours", pd),
            "on": start_router(procs, "ours-traced", "ours", traced),
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        flags = [*LOAD_FLAGS, "--warmup", str(p["warmup"]), "--seconds", str(p["seconds"])]
        for rep in range(p["repeats"]):
            for name, router in targets.items():
                ctx.progress.phase(f"tracing {name}, round {rep + 1}/{p['repeats']}")
                raw = run_load(
                    ctx,
                    procs,
                    f"load-tracing-{name}",
                    router.url,
                    flags,
                    concurrency=CONCURRENCY,
                    router=router,
                    seconds=p["warmup"] + p["seconds"],
                )
                row = latency_summary(raw)
                cpu = raw.get("router_cpu_s", float("nan"))
                row["router_cpu_ms_per_request"] = cpu / max(1, raw["ok"]) * 1000
                runs[name].append(row)
        for name, reps in runs.items():
            result[name] = {
                "runs": reps,
                **{key: median([r[key] for r in reps]) for key in reps[0]},
            }
        off = result["off"]["router_cpu_ms_per_request"]
        result["cpu_ratio_on_off"] = result["on"]["router_cpu_ms_per_request"] / off
        result["exports_received"] = sink.exports
    finally:
        procs.close()
        sink.close()
    return result
