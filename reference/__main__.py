"""``python -m reference``: write the generated pages; ``--check``: list the stale ones, exit 1."""

from __future__ import annotations

import argparse
import sys

from .pages import PAGES, ROOT


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args()
    stale = [page for page in PAGES if page.stale()]
    for page in stale:
        where = page.path.relative_to(ROOT)
        if args.check:
            print(f"stale: {where} (run make docs-reference)")
        else:
            page.write()
            print(f"wrote {where}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
