"""The documentation pages that are generated, not written: each is rendered from what the
router itself declares, so a page cannot drift from the code.

* :mod:`.configuration`: ``docs/reference/configuration.md``, from the flag declarations
  (the same ones ``--help`` is built from);
* :mod:`.metrics`: ``docs/reference/metrics.md``, from the Prometheus registry the router builds;
* :mod:`.benchmarks`: ``docs/benchmarks.md``, from ``benchmarks/report.md`` (which the benchmarks
  write from their results files).

``python -m reference`` (``make docs-reference``) writes all three; ``--check`` only says which
differ. ``tests/docs/test_reference.py`` fails when a committed page is not what its renderer
gives today.
"""

from __future__ import annotations

from .pages import PAGES, Page

__all__ = ["PAGES", "Page"]
