"""Print the project's Python requirements, one per line, read from pyproject.toml alone:
the build requirements, the dependencies and the named extras. The image installs them in a
layer of their own before the source is copied in, so a code edit does not reinstall torch.

    python3 compose/requirements.py pyproject.toml kernelbench [EXTRA ...]
"""

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as file:
        data = tomllib.load(file)
    project = data["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"{pyproject}: no extra(s) {', '.join(unknown)}; choose from {', '.join(sorted(optional))}")
    lines = [*data.get("build-system", {}).get("requires", []), *project.get("dependencies", [])]
    for extra in extras:
        lines += optional[extra]
    return list(dict.fromkeys(lines))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1], [e for arg in sys.argv[2:] for e in arg.split(",") if e])))
