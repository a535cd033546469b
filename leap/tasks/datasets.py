"""Tasks from a dataset file: JSONL or Parquet, one row per problem.

The layout is the one KernelBench publishes its problems in (the `ScalingIntelligence/
KernelBench` dataset: one row per problem with `code`, `name`, `level`, `problem_id`), so a
user who has that file, or a file of their own in the same shape, serves it as it is:

    code (or reference)  the problem as a Python module: `Model`, `get_inputs`,
                         `get_init_inputs` (required)
    name (or id)         the problem's name, for example "19_ReLU" (required unless
                         `problem_id` is given: then "problem_<problem_id>")
    level                where it is filed: level<level>/<name> (optional)
    inputs               Python source appended to `code`, for rows that keep
                         `get_inputs`/`get_init_inputs` apart from the model (optional)
    atol, rtol           the problem's tolerance (optional; KernelBench's 1e-2 otherwise)

Each row becomes one module in a directory of its own, named by the file's SHA-256 (so a
changed file is a new directory and an unchanged one is reused), and that directory is read
by the KernelBench loader like a checkout: the same ids (`level1/19_ReLU`), the same
toolchain. A row that is not a problem is refused when the file is loaded, naming the row and
the field, so a typo stops `leap serve sandbox` with one line instead of a missing task later.

Parquet needs pyarrow (`pip install 'leap-suite[parquet]'`); JSONL needs nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".parquet")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class DatasetError(ValueError):
    """A dataset file that cannot be served: the message names the file, the row and the field."""


def is_dataset_file(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in SUFFIXES and Path(path).is_file()


def rows(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(row number from 1, row) for every problem row of a JSONL or Parquet file."""
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install 'leap-suite[parquet]')") from None
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises its own error types for a damaged file
            raise DatasetError(f"{path}: not a readable Parquet file: {err}") from None
        for number, row in enumerate(table.to_pylist(), start=1):
            yield number, row
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{number}: not a JSON object: {err.msg}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{number}: not a JSON object")
            yield number, row


def module_source(row: Mapping[str, Any], where: str) -> tuple[str, str]:
    """(relative file path without suffix, module source) of one row."""
    code = row.get("code", row.get("reference"))
    if not isinstance(code, str) or not code.strip():
        raise DatasetError(f"{where}: code (or reference) is required: the problem's Python module")
    name = row.get("name", row.get("id"))
    if name is None and row.get("problem_id") is not None:
        name = f"problem_{row['problem_id']}"
    if not isinstance(name, str) or not _NAME.match(name):
        raise DatasetError(f"{where}: name (or id) is required: 1-128 of letters, digits, '.', '_', '-' "
                           f"starting with a letter or digit, got {name!r}")
    level = row.get("level")
    if level is not None and not (isinstance(level, int) and not isinstance(level, bool) and 0 <= level < 1000):
        raise DatasetError(f"{where}: level must be a whole number in [0, 1000), got {level!r}")
    relative = f"level{level}/{name}" if level is not None else name
    parts = [code.rstrip() + "\n"]
    inputs = row.get("inputs")
    if inputs is not None:
        if not isinstance(inputs, str):
            raise DatasetError(f"{where}: inputs must be Python source defining get_inputs and get_init_inputs")
        parts.append("\n" + inputs.rstrip() + "\n")
    for field in ("atol", "rtol"):
        value = row.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise DatasetError(f"{where}: {field} must be a finite number >= 0, got {value!r}")
        parts.append(f"\n{field.upper()} = {float(value)!r}  # from the dataset row\n")
    return relative, "".join(parts)


def _private_root() -> Path:
    """This user's directory of materialized datasets, refused when someone else could have
    planted it (a shared /tmp)."""
    root = Path(os.environ.get("LEAP_DATASET_DIR") or Path(tempfile.gettempdir()) / f"leap-task-datasets-{os.geteuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise DatasetError(f"{root}: not a private directory of this user; set LEAP_DATASET_DIR to one")
    return root


@functools.lru_cache(maxsize=64)
def _materialize(path: str, _mtime_ns: int, _size: int) -> str:
    file = Path(path)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:32]
    target = _private_root() / digest
    if target.is_dir():
        return str(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=target.parent))
    try:
        seen: dict[str, int] = {}
        for number, row in rows(file):
            where = f"{file}: row {number}"
            relative, source = module_source(row, where)
            if relative in seen:
                raise DatasetError(f"{where}: name {relative!r} is already row {seen[relative]}'s")
            seen[relative] = number
            out = staging / f"{relative}.py"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(source, encoding="utf-8")
        if not seen:
            raise DatasetError(f"{file}: no rows")
        try:
            staging.rename(target)
        except OSError:  # another process materialized the same file first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def as_directory(path: str | os.PathLike) -> str:
    """A directory the KernelBench loader reads: `path` itself when it is one, or the
    materialized rows of a JSONL or Parquet file."""
    resolved = Path(path).resolve()
    if resolved.suffix.lower() in SUFFIXES and resolved.is_file():
        info = resolved.stat()
        return _materialize(str(resolved), info.st_mtime_ns, info.st_size)
    return str(resolved)
