"""Checkpoints on disk, written so that a kill at any moment never leaves one that loads wrong.

Layout of `<checkpoints>/step-00000010/`:

    model/            Hugging Face model directory (config, safetensors, tokenizer): loadable
                      by the policy service (ReloadWeights, LoadModel) as it is
    optimizer.pt      full (unsharded) optimizer state, keyed by parameter name
    scheduler.pt      learning-rate scheduler state
    rng/rank-R.pt     RNG states of rank R: python, numpy, torch CPU and CUDA
    adapter.safetensors  a LoRA learner's adapter (PEFT names); model/ then holds it merged
    state.json        {"step", "updates", "cursor", "extra", "world_size", "format"}
    manifest.json     every file above with its size; written last

A checkpoint is written into a hidden `.tmp-...` sibling, every file and directory is
fsynced, the manifest goes last, and the directory is then renamed into place (atomic on
POSIX). Readers list only `step-*` directories whose manifest exists and whose files all
have the recorded sizes; leftovers of a killed write are removed by the next save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path
    create_time: float
    size_bytes: int


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def new_temp_dir(root: str | os.PathLike, step: int) -> Path:
    """A fresh hidden directory beside the final one, for one write."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under `path` (and `path` itself)."""
    for directory, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to `path` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def finalize(temp: Path, step: int) -> CheckpointInfo:
    """Seal a fully written temporary checkpoint: manifest, fsync, rename into place.

    A checkpoint of the same step already there (a resumed run saving that step again) is
    replaced; between the two renames the old one is still complete under a hidden name.
    """
    files = {}
    for file in sorted(p for p in temp.rglob("*") if p.is_file()):
        files[str(file.relative_to(temp))] = file.stat().st_size
    fsync_tree(temp)
    write_json_atomic(temp / MANIFEST, {"format": FORMAT_VERSION, "step": step, "files": files, "time": time.time()})
    fsync_dir(temp)
    final = temp.parent / step_dir_name(step)
    if final.exists():
        retired = temp.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, retired)
        os.replace(temp, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(temp, final)
    fsync_dir(final.parent)
    info = describe(final)
    assert info is not None, f"checkpoint {final} did not verify after writing"
    return info


def describe(path: Path) -> CheckpointInfo | None:
    """The checkpoint at `path`, or None when it is incomplete or damaged."""
    match = STEP_DIR.match(path.name)
    manifest_path = path / MANIFEST
    if not match or not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        total = 0
        for name, size in manifest["files"].items():
            file = path / name
            if not file.is_file() or file.stat().st_size != size:
                return None
            total += size
        if int(manifest["step"]) != int(match.group(1)):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CheckpointInfo(step=int(match.group(1)), path=path, create_time=float(manifest.get("time", 0.0)),
                          size_bytes=total)


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Complete checkpoints under `root`, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [describe(child) for child in root.iterdir() if child.is_dir()]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def latest_checkpoint(root: str | os.PathLike) -> CheckpointInfo | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def clean_leftovers(root: str | os.PathLike) -> None:
    """Remove temporary directories of writes that never finished."""
    root = Path(root)
    if root.is_dir():
        for child in root.iterdir():
            if child.is_dir() and (child.name.startswith(".tmp-") or child.name.startswith(".old-")):
                shutil.rmtree(child, ignore_errors=True)


def prune(root: str | os.PathLike, keep_last: int, keep_steps: tuple[int, ...] = ()) -> None:
    """Keep the newest `keep_last` checkpoints (0 keeps all) and any step in `keep_steps`."""
    if keep_last <= 0:
        return
    checkpoints = list_checkpoints(root)
    for info in checkpoints[:-keep_last]:
        if info.step not in keep_steps:
            shutil.rmtree(info.path, ignore_errors=True)


def read_state(path: Path) -> dict[str, Any]:
    state = json.loads((path / STATE).read_text())
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, this version reads {FORMAT_VERSION}")
    return state
