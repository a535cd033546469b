"""What lets an experiment stopped part way go on where it stopped: each finished piece (a
mode's run, a seed's whole expand-compress) is written beside a stamp of everything that
decided it, and read back instead of run again when the stamp is the same.

    stamp = {"config": ..., "model": model_stamp(model)}
    if (events := finished(record, stamp, "events")) is None:
        events = ...  # run it
        save_finished(record, stamp, "events", events)

The stamp does not cover this package's code: delete the output directory after changing it."""

from __future__ import annotations

import json
from pathlib import Path


def model_stamp(model: Path) -> object:
    """What identifies a model directory's weights: a bootstrapped model's cache key (which
    covers its tasks, config, code and libraries), else every file's size and modification time."""
    from leap.bootstrap import MANIFEST

    try:
        key = json.loads((model / MANIFEST).read_text()).get("key")
    except (OSError, ValueError, AttributeError):  # none, or not a bootstrap manifest
        key = None
    if key:
        return key
    return [[str(f.relative_to(model)), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(model.rglob("*")) if f.is_file()]


def finished(record: Path, stamp: dict, field: str):
    """`field` of `record` when it was saved with `stamp` (compared as JSON), else None."""
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("stamp") != json.loads(json.dumps(stamp)) or field not in saved:
        return None
    return saved[field]


def save_finished(record: Path, stamp: dict, field: str, value) -> None:
    """Write `value` with its stamp (whole or not at all: a stop mid-write leaves no record)."""
    record.parent.mkdir(parents=True, exist_ok=True)
    staging = record.with_name(record.name + ".partial")
    staging.write_text(json.dumps({"stamp": stamp, field: value}) + "\n")
    staging.replace(record)
