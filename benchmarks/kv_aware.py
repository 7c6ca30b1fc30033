"""PD under prefill cache pressure: ``kv_aware`` against ``cache_aware`` and vllm-router.

Two prefill simulators, each computing one prompt at a time (a prefill engine is compute-bound:
5 ms + 0.1 ms per uncached token, so a miss of ~530 tokens costs ~58 ms of engine time and a
hit ~11 ms, and queues form), each holding about 6 of the workload's 32 prefix groups in its
prefix cache (the fleet about 12); they publish vLLM's KV events. One decode simulator (20 ms a
token). Workload: 2,000-character shared prefixes, 8 hot groups taking 70 % of the requests
and 24 cold ones the rest, a unique 64-character question, 16-32 tokens streamed; closed loops
of 64 clients. With the hot groups split between the engines and the rest of each cache
holding cold groups, about 75 % of the requests can hit. Each configuration runs with one
router, then with two replicas behind the clients split in half (what a round-robin Service
gives clients that keep their connections), then with one router of ``--workers 2`` (the
supervisor's one subscription fanned out to both). Figures from the simulators' truth: the
prefill prefix-hit rate (cached / prompt tokens) over the load generator's measured window
(the simulators' counters read as it opens and closes; before 2026-12-07, from the reset before
each row, warm-up included), and the load generator's TTFT p50/p99 and req/s.
First, in front of warm engines (10 prefix groups sent twice through a first router: each
engine holds about 5): a router started fresh (its estimate empty; ``kv_aware`` replays the
engines' buffered events) takes 100 requests drawn from those groups, and the hit rate over
those is compared. Then, idle: ``/debug/kv-index`` block counts against ``/sim/kv/events``.

vllm-router 0.1.17's own ``kv_aware`` needs ``sha256_cbor`` engine hashes with
``PYTHONHASHSEED=0``, which the simulator does not mimic: it is compared as ``cache_aware``.

Last (first in the run, on simulators of their own), the tokenizer rows: ``kv_aware`` asking an
engine's ``/tokenize`` per request against tokenizing in the router (``--kv-tokenizer-path``),
with 64 clients and with one (see :func:`_tokenizer_rows`).

``python -m benchmarks --only kv_aware`` (``BENCH_KV_PARTS``: some of ``main``, ``tokenizer`` and
``rounds``, all three by default; ``BENCH_KV_REPEATS=N``: the rows of each part N times,
interleaved; the main rows default to the profile's repeats, the tokenizer rows to one;
``BENCH_KV_SECONDS``: each row's load, in place of the profile's)

The ``rounds`` part (after ``main``, so that the restart row still finds the engines' history
from seq 0): ``cache_aware`` and ``kv_aware`` (other variants: below) on the main
scenario's simulators in ``BENCH_KV_ROUNDS`` rounds (the profile's: 4 quick, 8 full) for each
of ``BENCH_KV_WORKERS`` (``1,2,r2`` by default: one process, ``--workers 2``, two replicas of
one process behind the clients split in half), the variants' order rotated from round to
round.
What one row says is within what identical configurations differ by on a shared 2-core host
(README), so each ``kv_aware`` variant is judged by its pairs with the ``cache_aware`` row of
the same round: the median TTFT p99 ratio, how many pairs came in under 1, the sign test's
two-sided p-value, the median hit-rate difference, and the p99 of all the paired rounds'
requests pooled, its ratio and that ratio's 90 % interval over resampled rounds
(:func:`_pairs`). ``BENCH_KV_VARIANTS`` picks variants of :data:`ROUND_VARIANTS` by index (the
reference first; ``0,1`` by default);
``BENCH_KV_CHECKOUT=DIR`` adds a ``kv_aware`` variant run from another checkout (a candidate
change) with the flags in ``BENCH_KV_CHECKOUT_FLAGS``, one variant per ``;``-separated set.
``BENCH_KV_TOKENIZER=1`` runs the rounds on the tokenizer rows' simulators (a real BPE
tokenizer, :func:`_bpe_sims`) with one more variant, ``kv_aware`` tokenizing with it (index 3).

``benchmarks/report.md`` judges ``kv_aware``'s goals on the run: from its paired rounds where it
has them, else from its main rows (:mod:`.kv_goals`).
"""

from __future__ import annotations

import math
import os
import random
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from trio_pdrouter_sim.tokenizer_files import write_model_dir

from .common import Context, median, percentile
from .loadgen import prompt_text
from .procs import ROOT, LoadRun, ProcessSet, Service, start_router, start_sim

PROFILES = {
    "quick": {"seconds": 12, "repeats": 1, "rounds": 4},
    "full": {"seconds": 40, "repeats": 2, "rounds": 8},
}
PARTS = "main,tokenizer,rounds"
CLIENTS = 64
BLOCK = 16
LOAD = [
    "--stream", "--max-tokens", "32", "--max-tokens-min", "16", "--prefix-chars", "2000",
    "--hot-groups", "8", "--cold-groups", "24", "--hot-share", "0.7", "--suffix-chars", "64",
    "--warmup", "2",
]  # fmt: skip


#: One client's load for the tokenizer rows: a single group, so all but the first prompt hit.
ONE_HOT_GROUP = [
    "--hot-groups", "1", "--cold-groups", "0", "--max-tokens", "1", "--max-tokens-min", "1",
]  # fmt: skip


#: The ``rounds`` part's configurations: (label, prefill policy, extra router flags); the first
#: is the reference every other is paired with.
ROUND_VARIANTS: list[tuple[str, str, list[str]]] = [
    ("cache_aware", "cache_aware", []),
    ("kv_aware", "kv_aware", []),
    # kv_aware's default until 2026-12-05.
    ("kv_aware, prefill load in requests", "kv_aware", ["--prefill-load-metric", "requests"]),
]


def estimate(profile: str) -> float:
    p = PROFILES[profile]
    seconds = _seconds(profile)
    total = float(p["repeats"] * 8 * (seconds + 8) + 60)
    if "rounds" in os.environ.get("BENCH_KV_PARTS", PARTS):
        rounds, setups = _round_plan(profile)
        tokenizer = Path("model") if os.environ.get("BENCH_KV_TOKENIZER") else None
        total += rounds * len(setups) * len(_round_variants(tokenizer)) * (seconds + 5)
    return total


def _seconds(profile: str) -> int:
    return int(os.environ.get("BENCH_KV_SECONDS", PROFILES[profile]["seconds"]))


def _round_plan(profile: str) -> tuple[int, list[tuple[int, int]]]:
    """The ``rounds`` part's round count and setups, (replicas, workers) each (module doc)."""
    setups = [
        (int(w[1:]), 1) if w.startswith("r") else (1, int(w))
        for w in os.environ.get("BENCH_KV_WORKERS", "1,2,r2").split(",")
    ]
    return int(os.environ.get("BENCH_KV_ROUNDS", PROFILES[profile]["rounds"])), setups


def _prefill_flags(cache_blocks: int = 190, per_token_s: float = 0.0001) -> list[str]:
    return [
        "--role", "prefill", "--fast", "--max-num-seqs", "1", "--prefill-base-s", "0.005",
        "--prefill-per-token-s", str(per_token_s), "--prefix-cache-blocks", str(cache_blocks),
        "--kv-events-port", "0", "--kv-replay-port", "0",
    ]  # fmt: skip


def _sources(client: httpx.Client, prefill: list[Service]) -> list[str]:
    flags: list[str] = []
    for sim in prefill:
        row = client.get(sim.url + "/sim/kv/events").json()["ranks"][0]
        flags += ["--kv-event-source", f"{sim.url}={row['endpoint']}"]
        flags += ["--kv-event-replay-source", f"{sim.url}={row['replay_endpoint']}"]
    return flags


def _hits(client: httpx.Client, prefill: list[Service]) -> tuple[int, int]:
    hits = queries = 0
    for sim in prefill:
        totals = client.get(sim.url + "/sim/stats").json()["totals"]
        hits += int(totals["prefix_cache_hits"])
        queries += int(totals["prefix_cache_queries"])
    return hits, queries


_DECISION = re.compile(
    r'^trio_pdrouter_policy_decisions_total\{reason="([a-z_]+)",stage="prefill"\} ([0-9.e+]+)$',
    re.M,
)


def _prefill_decisions(client: httpx.Client, router: Service) -> dict[str, int]:
    """The router's prefill decisions by reason, from its ``/metrics``."""
    text = client.get(router.url + "/metrics").text
    return {reason: int(float(n)) for reason, n in _DECISION.findall(text)}


def _router_flags(kind: str, policy: str, prefill: list[Service], decode: Service) -> list[str]:
    flags = ["--vllm-pd-disaggregation"]
    for sim in prefill:
        flags += ["--prefill", sim.url]
    flags += ["--decode", decode.url, "--prefill-policy", policy, "--decode-policy", "round_robin"]
    return flags


def _one(
    ctx: Context,
    procs: ProcessSet,
    client: httpx.Client,
    sims: tuple[list[Service], Service],
    kind: str,
    policy: str,
    replicas: int,
    workers: int = 1,
    *,
    extra: Sequence[str] = (),
    clients: int = CLIENTS,
    load: Sequence[str] = (),
    checkout: Path = ROOT,
    samples: list[float] | None = None,
) -> dict[str, Any]:
    """One row; ``samples``, if given, receives its TTFTs (seconds)."""
    prefill, decode = sims
    for sim in [*prefill, decode]:
        client.post(sim.url + "/sim/reset", json={"prefix_cache": True})
    flags = [*_router_flags(kind, policy, prefill, decode), *extra]
    if policy == "kv_aware":
        flags += _sources(client, prefill)
    if workers > 1:
        flags += ["--workers", str(workers)]
    routers = [
        start_router(procs, f"{kind}-{policy}-{i}", kind, flags, cwd=checkout)
        for i in range(replicas)
    ]
    seconds = str(_seconds(ctx.profile))
    try:
        runs = [
            LoadRun(
                procs,
                f"load-{kind}-{policy}-{replicas}-{i}",
                ["--url", r.url, "--seconds", seconds, *LOAD, *load],
                concurrency=clients // replicas,
                # One router's CPU (its workers and the supervisor included) over the window.
                watch=routers[0] if replicas == 1 else None,
            )
            for i, r in enumerate(routers)
        ]
        # The simulators' counters when the first generator's window opens and closes, so
        # that the hit rate covers the window TTFT is measured over (not the cold start after
        # the reset); a close the polling missed (the generator exits at once) reads them now.
        marks: dict[str, tuple[int, int]] = {}

        def tick() -> None:
            for mark in ("window-start", "window-end"):
                if mark in runs[0].mark_times and mark not in marks:
                    marks[mark] = _hits(client, prefill)

        results = [run.wait(timeout=float(seconds) + 120, tick=tick) for run in runs]
        end = marks.get("window-end") or _hits(client, prefill)
        start = marks.get("window-start", (0, 0))
        hits, queries = end[0] - start[0], end[1] - start[1]
        since_reset = end[0] / end[1] if end[1] else 0.0
        decisions = _prefill_decisions(client, routers[0]) if kind == "ours" else {}
    finally:
        for r in routers:
            procs.stop(r)
    ttfb = [t for res in results for t in res["ttfb"]]
    if samples is not None:
        samples.extend(ttfb)
    window = max(res["window_s"] for res in results)
    cpu = results[0].get("router_cpu_s")
    return {
        "router": kind,
        "policy": policy,
        "replicas": replicas,
        "workers": workers,
        "clients": clients,
        "extra": list(extra),
        "hit_rate": hits / queries if queries else 0.0,
        # Counted from the reset before the row, warm-up included (``hit_rate`` until
        # 2026-12-07).
        "hit_rate_since_reset": since_reset,
        "ttfb_p50_ms": percentile(ttfb, 0.5) * 1000,
        "ttfb_p99_ms": percentile(ttfb, 0.99) * 1000,
        "req_per_s": sum(res["ok"] for res in results) / window if window else 0.0,
        "failed": sum(res["failed"] for res in results),
        # Why the first router chose (with --workers N, the one worker that answered).
        "prefill_decisions": decisions,
        # Router CPU per request over the window (one router only): what exactness costs.
        "router_cpu_ms_per_req": cpu / results[0]["ok"] * 1000
        if cpu and results[0]["ok"]
        else None,
    }


def _restart(
    procs: ProcessSet, client: httpx.Client, sims: tuple[list[Service], Service], policy: str
) -> dict[str, Any]:
    """A fresh router in front of warm engines: the hit rate over its first 100 requests."""
    prefill, decode = sims
    flags = _router_flags("ours", policy, prefill, decode)
    if policy == "kv_aware":
        flags += _sources(client, prefill)
    router = start_router(procs, f"restart-{policy}", "ours", flags)
    rng = random.Random(7)
    prefixes = [f"[group {g}] " + " ".join(["alpha"] * 400) for g in range(32)]
    groups = rng.sample(range(32), 10)  # what the engines hold: 5 groups each fit
    try:
        for sim in prefill:
            client.post(sim.url + "/sim/reset", json={"prefix_cache": True})
        for g in groups * 2:  # warm the engines through a first router, then restart it
            client.post(
                router.url + "/v1/completions",
                json={"prompt": prefixes[g] + f" w{rng.random()}", "max_tokens": 1},
            )
        procs.stop(router)
        router = start_router(procs, f"restart-{policy}-2", "ours", flags)
        before = _hits(client, prefill)
        for i in range(100):
            g = groups[rng.randrange(len(groups))]
            client.post(
                router.url + "/v1/completions",
                json={"prompt": prefixes[g] + f" r{i}", "max_tokens": 1},
                timeout=30.0,
            )
        after = _hits(client, prefill)
    finally:
        procs.stop(router)
    queries = after[1] - before[1]
    return {"policy": policy, "hit_rate_first_100": (after[0] - before[0]) / (queries or 1)}


def _idle_check(
    procs: ProcessSet, client: httpx.Client, sims: tuple[list[Service], Service]
) -> dict[str, Any]:
    prefill, decode = sims
    flags = _router_flags("ours", "kv_aware", prefill, decode) + _sources(client, prefill)
    flags.append("--admin-from-loopback")  # /debug/kv-index
    router = start_router(procs, "idle-kv", "ours", flags)
    try:
        for i in range(50):
            client.post(
                router.url + "/v1/completions",
                json={"prompt": f"[idle {i % 9}] " + "beta " * 300, "max_tokens": 1},
            )
        index = {r["url"]: r for r in client.get(router.url + "/debug/kv-index").json()["engines"]}
        truth = {
            s.url: client.get(s.url + "/sim/kv/events").json()["ranks"][0]["blocks"]
            for s in prefill
        }
    finally:
        procs.stop(router)
    return {
        "index_blocks": {u: index[u]["blocks"] for u in truth},
        "sim_blocks": truth,
        "known": all(index[u]["known"] for u in truth),
        "equal": all(index[u]["blocks"] == truth[u] for u in truth),
    }


def _bpe_sims(procs: ProcessSet) -> tuple[tuple[list[Service], Service], Path]:
    """Simulators that encode with a byte-level BPE tokenizer trained on the workload's text
    (~5.2 characters a token; prefix cache and prefill cost scaled to keep the main rows'
    pressure: 146 blocks, 0.13 ms a token), and the model directory the router can load."""
    corpus = [prompt_text(random.Random(1000 + g), 2000, f"[group {g}] ") for g in range(32)]
    model = write_model_dir(procs.log_dir / "model", corpus, vocab_size=400)
    tokenizer = ["--tokenizer", str(model / "tokenizer.json")]
    prefill_flags = _prefill_flags(cache_blocks=146, per_token_s=0.00013)
    prefill = [start_sim(procs, f"tok-prefill-{i}", *prefill_flags, *tokenizer) for i in range(2)]
    decode = start_sim(
        procs, "tok-decode", "--role", "decode", "--fast", "--itl-base-s", "0.02", *tokenizer
    )
    return (prefill, decode), model


def _tokenizer_rows(ctx: Context, procs: ProcessSet, client: httpx.Client) -> list[dict[str, Any]]:
    """kv_aware tokenizing through an engine's ``/tokenize`` against ``--kv-tokenizer-path``.

    On :func:`_bpe_sims` (a real tokenizer the router can load). cache_aware (ours and
    vllm-router's) is the reference; each configuration runs with 64 clients (one router, then
    two replicas for cache_aware and the local tokenizer), then with one client sending one
    group's prompts and asking for one token (every request after the first a hit: the latency
    that getting the tokens adds).
    """
    sims, model = _bpe_sims(procs)
    prefill, decode = sims
    local = ["--kv-tokenizer-path", str(model)]
    # (clients, replicas, load): loaded with one router and two, then one client's latency.
    plans = [(CLIENTS, 1, []), (CLIENTS, 2, []), (1, 1, ONE_HOT_GROUP)]
    variants = [
        ("ours", "cache_aware", "estimate", []),
        ("ours", "kv_aware", "local tokenizer", local),  # shared starts stitched (its default)
        (
            "ours",
            "kv_aware",
            "local tokenizer, whole prompts",
            [*local, "--kv-tokenize-cut-chars", "0"],
        ),
    ]
    if ctx.vllm_router:
        variants.append(("vllm", "cache_aware", "estimate", []))
    engine: tuple[str, str, str, list[str]] = ("ours", "kv_aware", "engine /tokenize", [])
    rows = []
    try:
        for rep in range(int(os.environ.get("BENCH_KV_REPEATS", "1"))):
            for clients, replicas, load in plans:
                for kind, policy, tokens, extra in (
                    variants if replicas > 1 else [*variants, engine]
                ):
                    ctx.progress.phase(
                        f"tokenizer: {kind} {policy}, {tokens}, {clients} clients x{replicas}"
                        f" (run {rep + 1})"
                    )
                    row = _one(
                        ctx,
                        procs,
                        client,
                        sims,
                        kind,
                        policy,
                        replicas,
                        extra=extra,
                        clients=clients,
                        load=load,
                    )
                    rows.append({**row, "tokens": tokens, "run": rep + 1})
    finally:
        for sim in [*prefill, decode]:
            procs.stop(sim)
    return rows


def _round_variants(model: Path | None = None) -> list[tuple[str, str, list[str], Path]]:
    """The ``rounds`` part's variants: (label, prefill policy, extra flags, checkout) each, the
    reference first (module doc); on simulators with a real tokenizer (``model``), also
    ``kv_aware`` tokenizing with it."""
    known = list(ROUND_VARIANTS)
    if model is not None:
        known.append(("kv_aware, local tokenizer", "kv_aware", ["--kv-tokenizer-path", str(model)]))
    chosen = os.environ.get("BENCH_KV_VARIANTS", "0,1")
    variants = [(*known[int(i)], ROOT) for i in chosen.split(",")]
    other = os.environ.get("BENCH_KV_CHECKOUT")
    if other:
        for given in os.environ.get("BENCH_KV_CHECKOUT_FLAGS", "").split(";"):
            flags = shlex.split(given)
            label = f"kv_aware ({other} {shlex.join(flags)})"
            variants.append((label, "kv_aware", flags, Path(other)))
    return variants


def _rounds(
    ctx: Context,
    procs: ProcessSet,
    client: httpx.Client,
    sims: tuple[list[Service], Service],
    model: Path | None = None,
) -> dict[str, Any]:
    """:data:`ROUND_VARIANTS` in interleaved rounds, each paired with the reference's row of
    the same round and process count (module doc)."""
    variants = _round_variants(model)
    rows = []
    samples: dict[tuple[int, int, str, int], list[float]] = {}
    rounds, plan = _round_plan(ctx.profile)
    for rnd in range(rounds):
        for replicas, workers in plan:
            turn = rnd % len(variants)
            for label, policy, extra, checkout in variants[turn:] + variants[:turn]:
                ctx.progress.phase(f"round {rnd + 1}: {label}, {replicas}x --workers {workers}")
                ttfb = samples.setdefault((replicas, workers, label, rnd + 1), [])
                row = _one(
                    ctx, procs, client, sims, "ours", policy, replicas, workers,
                    extra=extra, checkout=checkout, samples=ttfb,
                )  # fmt: skip
                rows.append({**row, "variant": label, "round": rnd + 1})
    return {"rows": rows, "pairs": _pairs(rows, [v[0] for v in variants], samples)}


def _pairs(
    rows: list[dict[str, Any]],
    labels: list[str],
    samples: dict[tuple[int, int, str, int], list[float]] | None = None,
) -> list[dict[str, Any]]:
    """Per setup (replicas, workers) and variant (``labels``, the reference first): its rows
    against the reference's of the same round; with the rows' TTFTs (``samples`` by replicas,
    workers, variant and round), also the p99 of all the paired rounds' requests pooled
    (:func:`_pooled`)."""
    reference = labels[0]
    by = {(r["replicas"], r["workers"], r["variant"], r["round"]): r for r in rows}
    out = []
    for replicas, workers in sorted({(r["replicas"], r["workers"]) for r in rows}):
        for label in labels:
            pairs = [
                (by[(replicas, workers, label, rnd)], by[(replicas, workers, reference, rnd)])
                for rnd in sorted({r["round"] for r in rows})
                if (replicas, workers, label, rnd) in by
                and (replicas, workers, reference, rnd) in by
            ]
            ratios = [a["ttfb_p99_ms"] / b["ttfb_p99_ms"] for a, b in pairs]
            under = sum(r < 1 for r in ratios)
            out.append(
                {
                    "replicas": replicas,
                    "workers": workers,
                    "variant": label,
                    "rounds": len(pairs),
                    "hit_rate": median([a["hit_rate"] for a, _b in pairs]),
                    "ttfb_p99_ms": median([a["ttfb_p99_ms"] for a, _b in pairs]),
                    "ttfb_p50_ms": median([a["ttfb_p50_ms"] for a, _b in pairs]),
                    "req_per_s": median([a["req_per_s"] for a, _b in pairs]),
                    "p99_ratios": ratios,
                    "p99_ratio_median": median(ratios),
                    "pairs_under_1": under,
                    "sign_test_p": _sign_test(under, len(ratios)) if label != reference else None,
                    "hit_diff_points_median": median(
                        [(a["hit_rate"] - b["hit_rate"]) * 100 for a, b in pairs]
                    ),
                }
            )
            if samples is not None:
                rounds = [a["round"] for a, _b in pairs]
                mine = [samples[(replicas, workers, label, rnd)] for rnd in rounds]
                theirs = [samples[(replicas, workers, reference, rnd)] for rnd in rounds]
                out[-1].update(_pooled(mine, theirs))
    return out


def _pooled(mine: list[list[float]], theirs: list[list[float]]) -> dict[str, Any]:
    """The TTFT p99 of a variant's requests over all its paired rounds, and its ratio to the
    reference's over the same rounds: a p99 of some 10,000 requests rather than a median of
    per-round p99s that each rest on the slowest dozen. The interval resamples whole rounds
    (with replacement, 1,000 times), so it spans what the rounds differ by."""

    def p99_ratio(picks: Sequence[int]) -> float:
        a = percentile([t for i in picks for t in mine[i]], 0.99)
        b = percentile([t for i in picks for t in theirs[i]], 0.99)
        return a / b if b else math.nan

    n = len(mine)
    if n == 0:
        return {}
    rng = random.Random(0)
    boot = sorted(p99_ratio([rng.randrange(n) for _ in range(n)]) for _ in range(1000))
    return {
        "pooled_ttfb_p99_ms": percentile([t for ts in mine for t in ts], 0.99) * 1000,
        "pooled_p99_ratio": p99_ratio(range(n)),
        "pooled_p99_ratio_90": [boot[50], boot[949]],
    }


def _sign_test(successes: int, n: int) -> float:
    """Two-sided p-value of ``successes`` of ``n`` fair coin flips (1.0 for no flips)."""
    if n == 0:
        return 1.0
    tail = min(successes, n - successes)
    p: float = 2 * sum(math.comb(n, k) for k in range(tail + 1)) / 2**n
    return min(p, 1.0)


def run(ctx: Context) -> dict[str, Any]:
    p = PROFILES[ctx.profile]
    parts = os.environ.get("BENCH_KV_PARTS", PARTS).split(",")
    procs = ProcessSet(ctx.log_dir / "kv_aware")
    client = httpx.Client(timeout=10.0)
    result: dict[str, Any] = {"scenario": "kv_aware", "profile": ctx.profile, "notes": []}
    configs = [("ours", "cache_aware"), ("ours", "kv_aware")]
    if ctx.vllm_router:
        configs.append(("vllm", "cache_aware"))
    else:
        result["notes"].append(ctx.note_vllm_missing())
    try:
        if "tokenizer" in parts:
            result["tokenizer"] = _tokenizer_rows(ctx, procs, client)
        if "rounds" in parts and os.environ.get("BENCH_KV_TOKENIZER"):
            ctx.progress.phase("starting simulators with a tokenizer")
            bpe, model = _bpe_sims(procs)
            result["rounds"] = _rounds(ctx, procs, client, bpe, model)
            for sim in [*bpe[0], bpe[1]]:
                procs.stop(sim)
            parts.remove("rounds")
        if "main" not in parts and "rounds" not in parts:
            return result
        ctx.progress.phase("starting simulators")
        prefill = [start_sim(procs, f"sim-prefill-{i}", *_prefill_flags()) for i in range(2)]
        decode = start_sim(
            procs, "sim-decode", "--role", "decode", "--fast", "--itl-base-s", "0.02"
        )
        sims = (prefill, decode)
        if "main" in parts:
            # First, while the engines' replay buffers still reach back to seq 0.
            ctx.progress.phase("restart in front of warm engines")
            result["restart"] = [
                _restart(procs, client, sims, pol) for pol in ("cache_aware", "kv_aware")
            ]
            ctx.progress.phase("idle: index against the simulators")
            result["idle"] = _idle_check(procs, client, sims)
            rows = []
            for rep in range(int(os.environ.get("BENCH_KV_REPEATS", p["repeats"]))):
                for kind, policy in configs:
                    for replicas in (1, 2):
                        ctx.progress.phase(f"{kind} {policy} x{replicas} (run {rep + 1})")
                        rows.append(_one(ctx, procs, client, sims, kind, policy, replicas))
                    if kind == "ours":
                        ctx.progress.phase(f"{kind} {policy} --workers 2 (run {rep + 1})")
                        rows.append(_one(ctx, procs, client, sims, kind, policy, 1, workers=2))
            result["configs"] = rows
        if "rounds" in parts:
            result["rounds"] = _rounds(ctx, procs, client, sims)
    finally:
        client.close()
        procs.close()
    return result
