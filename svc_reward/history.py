"""Per-task difficulty history: an exponential moving average of the first-turn pass rate
and counts of attempts, solves and groups, kept in memory and persisted to one JSON file.

`record` is a pure update. `HistoryFile` reads and writes the file atomically (a temporary
file in the same folder, flushed and fsynced, then renamed over the old one), so a reader —
or a service restarted after a kill at any instant — sees either the previous complete
state or the new one, never half a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

FORMAT_VERSION = 1


class HistoryFileError(OSError):
    """The history file cannot be read or written (an OSError, so `leap serve` reports it
    in one line)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TaskRecord:
    """What the gate remembers of one task."""

    task_id: str
    ema_pass_rate: float  # the first group's pass rate, then (1 - decay) * ema + decay * rate
    attempts: int  # first-turn rollouts recorded
    solves: int  # of which passed
    groups: int  # groups recorded
    update_time: float  # seconds since the epoch


def record(prior: TaskRecord | None, task_id: str, passes: int, size: int, decay: float, now: float) -> TaskRecord:
    """The record after one more group of `size` first-turn rollouts, `passes` of them passing."""
    rate = passes / size
    if prior is None:
        return TaskRecord(task_id, rate, size, passes, 1, now)
    ema = (1 - decay) * prior.ema_pass_rate + decay * rate
    return TaskRecord(task_id, ema, prior.attempts + size, prior.solves + passes, prior.groups + 1, now)


class HistoryFile:
    """The JSON file holding every task's record; `path` None keeps nothing on disk."""

    def __init__(self, path: str | os.PathLike | None, fsync: bool = True):
        self.path = Path(path) if path else None
        self.fsync = fsync

    def load(self) -> dict[str, TaskRecord]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"unsupported format version {data.get('version')!r}")
            records = [TaskRecord(**item) for item in data["tasks"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise HistoryFileError(f"cannot read the task history {str(self.path)!r}: {err}. "
                                   "Fix it, move it away, or point history_path elsewhere.") from None
        return {item.task_id: item for item in records}

    @staticmethod
    def encode(records: Iterable[TaskRecord]) -> bytes:
        """The file's bytes (serialize on the caller's thread; write on any)."""
        tasks = [dataclasses.asdict(item) for item in sorted(records, key=lambda item: item.task_id)]
        return json.dumps({"version": FORMAT_VERSION, "tasks": tasks}, separators=(",", ":")).encode()

    def write(self, payload: bytes) -> None:
        """Replace the file by `payload` atomically."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(payload)
                    out.flush()
                    if self.fsync:
                        os.fsync(out.fileno())
                os.replace(temporary, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            if self.fsync:
                self._fsync_folder()
        except OSError as err:
            raise HistoryFileError(f"cannot write the task history {str(self.path)!r}: {err}") from None

    def save(self, records: Mapping[str, TaskRecord]) -> None:
        self.write(self.encode(records.values()))

    def _fsync_folder(self) -> None:
        """Make the rename itself durable (POSIX; a no-op where folders cannot be opened)."""
        assert self.path is not None
        try:
            folder = os.open(self.path.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(folder)
        except OSError:
            pass
        finally:
            os.close(folder)
