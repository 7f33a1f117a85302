"""Check that docs/architecture.md's module map names every module under packages/*/src/.

The map's lines read ``- `ejk_x._module`: role``; a package's ``__init__.py`` is listed
under the package's dotted name. Fails (exit 1) on a module missing from the map and on a
listed module that no longer exists. Run by ``nox -s lint``; reads files only.

    python scripts/check_architecture.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
ENTRY = re.compile(r"^- `(ejk_\w+(?:\.\w+)*)`:")


def modules_on_disk() -> set[str]:
    """Dotted names of every module under packages/*/src/ (a package by its name)."""
    found = set()
    for src in ROOT.glob("packages/*/src"):
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def modules_in_map(text: str) -> set[str]:
    """Dotted names listed in the "Module map" section of architecture.md."""
    section = text.split("\n## Module map", 1)
    if len(section) != 2:
        raise SystemExit(f"{DOC.relative_to(ROOT)} has no '## Module map' section")
    body = re.split(r"\n## ", section[1], maxsplit=1)[0]
    return {m.group(1) for line in body.splitlines() if (m := ENTRY.match(line))}


def main() -> int:
    on_disk = modules_on_disk()
    listed = modules_in_map(DOC.read_text(encoding="utf-8"))
    missing, gone = sorted(on_disk - listed), sorted(listed - on_disk)
    for name in missing:
        print(f"docs/architecture.md: module {name} is not in the module map")
    for name in gone:
        print(f"docs/architecture.md: the module map lists {name}, which does not exist")
    if missing or gone:
        return 1
    print(
        f"docs/architecture.md: module map matches the {len(on_disk)} modules under packages/*/src/"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
