"""Check that the installed packages are exactly the pins of a constraints file; exit 1 naming each that differs.

    python scripts/check_pins.py constraints/gpu.txt     (the last step of scripts/install-gpu.sh)

A constraint does not install anything, so a package pinned there but missing is reported too.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement


def pins(path: str) -> list[Requirement]:
    with open(path, encoding="utf-8") as f:
        return [Requirement(text) for line in f if (text := line.split("#")[0].strip())]


def mismatches(path: str) -> list[str]:
    wrong = []
    for req in pins(path):
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            wrong.append(f"{req.name} not installed (pinned {req.specifier})")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            wrong.append(f"{req.name} {installed} (pinned {req.specifier})")
    return wrong


def main(path: str) -> int:
    wrong = mismatches(path)
    if wrong:
        print(f"installed versions differ from {path}: " + "; ".join(wrong), file=sys.stderr)
        return 1
    print(f"installed versions match {path}: " + ", ".join(f"{r.name} {version(r.name)}" for r in pins(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
