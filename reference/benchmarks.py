"""``docs/benchmarks.md``: how to run the benchmarks, then the latest report as they wrote it.

The figures are ``benchmarks/report.md``'s, which ``python -m benchmarks`` writes from the newest
results file of every scenario (``benchmarks/results/*.json``); nothing here is typed by hand.
The report's headings move one level down under "Latest report", and its charts, which live
beside the results outside the site, are named by path instead of shown. Bytes a router
answered that are not text (vllm-router's HTTP/2 frames in the memory scenario) are shown as
``\\xNN`` escapes.
"""

from __future__ import annotations

import re
from pathlib import Path

HEADER = """\
# Benchmarks

## How to run them

```
make bench                # the quick profile: every scenario, about 45 minutes on 2 cores
make bench-full           # the full profile: longer runs, more rounds
.venv/bin/python -m benchmarks --only routing      # one scenario (see --help for the names)
```

`make bench` first runs the soak tests marked `slow` (left out of `make test`), installs
vllm-router 0.1.17 in its own virtual environment for the side-by-side rows (if it cannot, its
rows are skipped and the report says so), then writes one results file per scenario to
`benchmarks/results/` and regenerates `benchmarks/report.md` and its charts from the newest
result of each scenario. Environment variables narrow a scenario (`BENCH_ROUTING_CONFIGS`,
`BENCH_MIXED_WORKLOADS`, `BENCH_PACED_MODES`, ...): each scenario's module in `benchmarks/`
documents its own. `make profile` runs the token-paced relay under py-spy and writes a flame
graph.

Routers, simulators and load generators run on one machine as separate processes: compare rows
with each other, not with a cluster. Dated lab notes, with the commands and conditions of
earlier measurements, are in `benchmarks/results/*.md`.

This page is generated from `benchmarks/report.md` (`make docs-reference`).

## Latest report

"""

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)]*)\)")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def render(report: Path) -> str:
    lines = report.read_text(encoding="utf-8", errors="replace").splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    body = [_line(line) for line in lines]
    return HEADER + "\n".join(body).strip() + "\n"


def _line(line: str) -> str:
    if line.startswith("#"):
        return "#" + line
    line = _IMAGE.sub(lambda m: f"Chart ({m[1]}): `benchmarks/{m[2]}`", line)
    return _CONTROL.sub(lambda m: f"\\\\x{ord(m[0]):02x}", line)
