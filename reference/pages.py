"""Every generated page: where it lives and what renders it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs

from . import benchmarks, configuration, metrics

ROOT = Path(__file__).resolve().parent.parent


@attrs.frozen
class Page:
    """A page of the documentation site, rendered from the repository."""

    path: Path
    render: Callable[[], str]

    def stale(self) -> bool:
        """Whether the committed page differs from what is rendered now."""
        return not self.path.exists() or self.path.read_text(encoding="utf-8") != self.render()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.render(), encoding="utf-8")


PAGES = (
    Page(ROOT / "docs" / "reference" / "configuration.md", configuration.render),
    Page(ROOT / "docs" / "reference" / "metrics.md", metrics.render),
    Page(
        ROOT / "docs" / "benchmarks.md",
        lambda: benchmarks.render(ROOT / "benchmarks" / "report.md"),
    ),
)
