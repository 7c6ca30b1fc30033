"""Nothing in the repository points at a document outside it or at how the project was made.

A reader has the repository only: a page, docstring or comment that cites a design document, a
specification by section, an issue or its acceptance checks sends them nowhere. What such a
reference meant is written where it is needed instead (docs/design.md for the router's theory).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("trio_pdrouter", "trio_pdrouter_sim", "demo", "tests", "benchmarks", "docs", "reference")
FILES = ("README.md", "Makefile", "pyproject.toml", "mkdocs.yml")
TEXT = (".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".sh", ".cfg", ".ini")

#: A pattern per kind of outside reference, with what it catches.
OUTSIDE = {
    "a specification by section": re.compile(r"\bSPEC\b\s*§|\bSPEC\.md\b"),
    "a design document": re.compile(r"\bDESIGN\b|\bDESIGN\.md\b"),
    "an issue": re.compile(r"\b[Ii]ssues? #?\d+|\bthe issue\b|\bthe issue's\b", re.IGNORECASE),
    "acceptance checks": re.compile(r"\bdone[- ]when\b", re.IGNORECASE),
    "a path outside the repository": re.compile(r"/work/shared|shared/research"),
}


def scanned() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *TREES, *FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    here = Path(__file__).resolve()
    return [
        ROOT / name
        for name in listed
        if (name.endswith(TEXT) or name in FILES)
        and (ROOT / name).is_file()
        and (ROOT / name).resolve() != here
    ]


def test_the_scan_sees_the_tree() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in scanned()}
    assert {"README.md", "trio_pdrouter/serve/proxy.py", "docs/kv-ownership.md"} <= names


def test_the_patterns_catch_what_they_are_for() -> None:
    for text in ("(SPEC §5)", "see DESIGN.md", "issue 21", "the issue's goal", "done-when 1"):
        assert any(pattern.search(text) for pattern in OUTSIDE.values()), text
    for text in ("--fault SPEC", "RFC 9112 §7.1", "a design choice", "issued", "session"):
        assert not any(pattern.search(text) for pattern in OUTSIDE.values()), text


def test_no_file_refers_to_documents_outside_the_repository() -> None:
    found = []
    for path in scanned():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for kind, pattern in OUTSIDE.items():
                if pattern.search(line):
                    where = f"{path.relative_to(ROOT)}:{number}"
                    found.append(f"{where}: {kind}: {line.strip()}")
    assert not found, "\n".join(found)
