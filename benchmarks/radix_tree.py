"""How much a cache_aware decision costs in the radix tree as it fills up (scenario 5).

For each prompt size (200 B, 2 KB, 32 KB) a fresh :class:`RadixTree` with ``tenants`` endpoints is
filled with prompts shaped like chat traffic: one of 64 shared "system prompts" (half the length)
followed by a unique half. At 10 %, 25 %, 50 % and 100 % of the per-tenant budget we time
``match`` + ``insert`` for new prompts (the cache_aware path) and for exact repeats, then time one
``evict`` that trims 10 % over-budget back to the budget.

Run ``python benchmarks/radix_tree.py [quick|full]``; ``run(profile)`` returns the numbers.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from trio_pdrouter.routing.policies import RadixTree
from trio_pdrouter.routing.policies.cache_aware import EVICTION_SLICE

PROFILES: dict[str, dict[str, int]] = {
    # quick: 2 Mi chars per tenant, a few seconds; full: vllm-router's default 2**25 per tenant.
    "quick": {"budget": 2**21, "tenants": 4, "samples": 300},
    "full": {"budget": 2**25, "tenants": 2, "samples": 1000},
}
SIZES = (200, 2_048, 32_768)
CHECKPOINTS = (0.10, 0.25, 0.50, 1.00)
SYSTEM_PROMPTS = 64


class _Prompts:
    """Deterministic chat-like prompts: a shared system prompt, then a unique tail."""

    def __init__(self, size: int, seed: int) -> None:
        self._rng = random.Random(seed)
        half = size // 2
        self._size = size
        self._systems = [self._chars(half) for _ in range(SYSTEM_PROMPTS)]

    def _chars(self, n: int) -> str:
        return self._rng.randbytes((n + 1) // 2).hex()[:n]

    def next(self) -> str:
        system = self._rng.choice(self._systems)
        return system + self._chars(self._size - len(system))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _bench_size(size: int, budget: int, tenants: int, samples: int) -> list[dict[str, Any]]:
    tree: RadixTree[int] = RadixTree()
    prompts = _Prompts(size, seed=size)
    everyone = set(range(tenants))
    seen: list[str] = []
    rows: list[dict[str, Any]] = []
    count = 0
    for fraction in CHECKPOINTS:
        target = int(budget * fraction)
        while min(tree.tenant_bytes(t) for t in everyone) < target:
            text = prompts.next()
            tree.insert(text, count % tenants)
            count += 1
            if len(seen) < 4 * samples:
                seen.append(text)
        new_us: list[float] = []
        repeat_us: list[float] = []
        for i in range(samples):
            text = prompts.next()
            start = time.perf_counter()
            _, owner = tree.match(text, everyone)
            tree.insert(text, owner if owner is not None else i % tenants)
            new_us.append((time.perf_counter() - start) * 1e6)
            again = seen[i % len(seen)]
            start = time.perf_counter()
            _, owner = tree.match(again, everyone)
            tree.insert(again, owner if owner is not None else i % tenants)
            repeat_us.append((time.perf_counter() - start) * 1e6)
        row: dict[str, Any] = {
            "prompt_bytes": size,
            "fill": fraction,
            "tree_chars": sum(tree.tenants().values()),
            "new_mean_us": statistics.fmean(new_us),
            "new_p99_us": _percentile(new_us, 0.99),
            "repeat_mean_us": statistics.fmean(repeat_us),
            "repeat_p99_us": _percentile(repeat_us, 0.99),
            "evict_ms": None,
            "evict_slices": None,
            "evict_slice_max_ms": None,
        }
        if fraction == CHECKPOINTS[-1]:
            # Overfill by 10 % and time the periodic trim back to the budget.
            while min(tree.tenant_bytes(t) for t in everyone) < budget * 1.1:
                tree.insert(prompts.next(), count % tenants)
                count += 1
            # The router evicts in slices (cache_aware.EVICTION_SLICE nodes each) and lets
            # requests run between them: the longest slice is the event-loop stall.
            slices: list[float] = []
            while tree.over_budget(budget):
                start = time.perf_counter()
                tree.evict(budget, max_steps=EVICTION_SLICE)
                slices.append((time.perf_counter() - start) * 1e3)
            row["evict_ms"] = sum(slices)
            row["evict_slices"] = len(slices)
            row["evict_slice_max_ms"] = max(slices)
            assert all(n <= budget for n in tree.tenants().values())
        rows.append(row)
    return rows


def run(profile: str = "quick") -> dict[str, Any]:
    """Run the benchmark; returns ``{"profile", "budget", "tenants", "samples", "rows"}``."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    params = PROFILES[profile]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for size in SIZES:
        rows.extend(_bench_size(size, params["budget"], params["tenants"], params["samples"]))
    return {
        "profile": profile,
        **params,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }


def _print_table(result: dict[str, Any]) -> None:
    print(
        f"radix tree, profile={result['profile']} budget={result['budget']} chars/tenant "
        f"tenants={result['tenants']} samples={result['samples']}"
    )
    header = (
        f"{'prompt':>7} {'fill':>5} {'tree chars':>11} {'new mean':>9} {'new p99':>8} "
        f"{'rep mean':>9} {'rep p99':>8} {'evict':>9} {'slices':>7} {'max slice':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        evict = "" if r["evict_ms"] is None else f"{r['evict_ms']:.1f} ms"
        count = "" if r.get("evict_slices") is None else str(r["evict_slices"])
        worst = "" if r.get("evict_slice_max_ms") is None else f"{r['evict_slice_max_ms']:.2f} ms"
        print(
            f"{r['prompt_bytes']:>7} {r['fill']:>5.0%} {r['tree_chars']:>11} "
            f"{r['new_mean_us']:>7.1f}µs {r['new_p99_us']:>6.1f}µs "
            f"{r['repeat_mean_us']:>7.1f}µs {r['repeat_p99_us']:>6.1f}µs {evict:>9} {count:>7}"
            f" {worst:>10}"
        )
    print(f"(insert+match per request; total {result['seconds']:.1f} s)")


if __name__ == "__main__":
    _print_table(run(sys.argv[1] if len(sys.argv) > 1 else "quick"))
