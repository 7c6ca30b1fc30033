"""Every ``trio-pdrouter`` command line shown in the documentation parses.

The pages are read as a user reads them: each fenced code block, its ``\\``-continued lines
joined, and every line that starts with ``trio-pdrouter`` (a trailing comment or ``&`` left
off) parsed by the router's own parser into a
config (which runs every check of the settings). A flag renamed or a value refused breaks the
page's example, and this test names it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from trio_pdrouter.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text(encoding="utf-8")):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip().removesuffix("&").strip()
                if line.startswith("trio-pdrouter "):
                    found.append((page.relative_to(ROOT).as_posix(), line))
    return found


COMMANDS = commands()


def test_the_pages_show_commands() -> None:
    pages = {page for page, _ in COMMANDS}
    assert {"README.md", "docs/quickstart.md", "docs/vllm.md", "docs/migrate.md"} <= pages


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[page for page, _ in COMMANDS])
def test_a_documented_command_parses(page: str, command: str) -> None:
    argv = shlex.split(command)[1:]
    if argv in (["--help"], ["--version"]):
        return
    parse_config(argv)
