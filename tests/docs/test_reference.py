"""The generated pages are what their renderers give today, and they render what they claim to.

``make docs-reference`` rewrites a stale page; until then these tests fail and say which.
"""

from __future__ import annotations

import argparse

import pytest

from reference import PAGES, Page, configuration, metrics
from reference import benchmarks as benchmarks_page
from trio_pdrouter.config import RouterConfig, build_parser, flags
from trio_pdrouter.observe import RouterMetrics


@pytest.mark.parametrize("page", PAGES, ids=[page.path.name for page in PAGES])
def test_the_committed_page_is_current(page: Page) -> None:
    assert not page.stale(), f"{page.path} is stale: run make docs-reference"


def test_the_configuration_page_lists_every_flag_with_its_shown_default() -> None:
    text = configuration.render()
    for _, _, option in flags.declared(RouterConfig):
        if isinstance(option, flags.Flag) and option.hidden:
            assert f"`{option.spelling}" not in text
        else:
            assert f"`{option.spelling}" in text, option.spelling
    assert "| `--max-payload-size SIZE` | `512MiB` |" in text
    assert "`mooncake` is refused:" in text
    assert "## Refused vllm-router flags" in text


def test_the_configuration_page_follows_the_parser() -> None:
    """A help text changed in a declaration changes the page: it is read from there."""
    parser = build_parser()
    shown = [a for a in parser._actions if a.help not in (None, argparse.SUPPRESS)]
    text = configuration.render()
    for action in shown:
        if action.option_strings[0] in ("-h", "--version"):
            continue
        cell = str(action.help).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        assert cell in text


def test_the_metrics_page_lists_every_family_of_the_registry() -> None:
    text = metrics.render()
    for family in RouterMetrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"| `{name}` | {family.type} |" in text
    assert (
        "| `trio_pdrouter_requests_total` | counter | `route`, `status`, `stream`, `outcome` |"
        in text
    )
    assert "`trio_pdrouter_discovery_lists_total`" in text
    assert "`trio_pdrouter_kv_index_blocks` | gauge | `endpoint` |" in text


def test_the_benchmarks_page_carries_the_report(tmp_path: pytest.TempPathFactory) -> None:
    report = tmp_path / "report.md"  # type: ignore[operator]
    report.write_text(
        "# Benchmarks\n\nIntro.\n\n## 1. Overhead\n\n| a | b |\n|---|---|\n| 1 | x\x00y |\n\n"
        "![chart](results/c.png)\n",
        encoding="utf-8",
    )
    page = benchmarks_page.render(report)
    assert page.startswith("# Benchmarks\n")
    assert "### 1. Overhead" in page
    assert "| 1 | x\\\\x00y |" in page
    assert "Chart (chart): `benchmarks/results/c.png`" in page
    assert "\x00" not in page and "](results/" not in page
