"""Print pyproject's dependency floors as pip constraints (`name==floor`), for the CI job that
installs and tests the project at its lowest declared versions (.ci/run, docs/testing.md).

    python tools/floors.py [--extra serve] > floors.txt
    pip install -c floors.txt torch && pip install -c floors.txt -e ".[serve]"

Every dependency of [project.dependencies] and of the named extras must declare a floor (`>=X`):
one without is an error here, so a new dependency cannot slip past the floor job untested.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as a package
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$")


def floors(requirements: list[str]) -> list[str]:
    out = []
    for req in requirements:
        m = REQ.match(req)
        if m is None:
            raise SystemExit(f"tools/floors.py: cannot read requirement {req!r}")
        name, spec, marker = m.group(1), m.group(3), m.group(4) or ""
        floor = re.search(r">=\s*([0-9][^,\s]*)", spec)
        if floor is None:
            raise SystemExit(f"tools/floors.py: {name} has no floor (>=) in pyproject.toml: {req!r}")
        out.append(f"{name}=={floor.group(1)}{marker}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extra", action="append", default=[], help="an optional-dependencies group to include")
    a = ap.parse_args()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in a.extra:
        reqs += project["optional-dependencies"][extra]
    sys.stdout.write("\n".join(floors(reqs)) + "\n")


if __name__ == "__main__":
    main()
