"""Every ``trio-pdrouter`` command line shown in the documentation parses.

The pages are read as a user reads them: each fenced code block, its ``\\``-continued lines
joined (in a block that shows a session, only the lines after a ``$`` prompt), and every line
that starts with ``trio-pdrouter`` (or a path to it) (a trailing comment or ``&`` left
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
            lines = block.replace("\\\n", " ").splitlines()
            if any(line.startswith("$ ") for line in lines):  # a session: commands and output
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            for line in lines:
                line = line.split(" #", 1)[0].strip().removesuffix("&").strip()
                line = re.sub(r"^\S*/(?=trio-pdrouter )", "", line)  # /opt/.../bin/trio-pdrouter
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
