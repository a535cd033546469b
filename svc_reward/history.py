"""Per-task difficulty history: an exponential moving average of the first-turn pass rate
and counts of attempts, solves and groups, kept in an embedded SQLite database with the
stored answers of idempotent Gate calls.

`record` is a pure update. `HistoryStore` is the database (the standard library's `sqlite3`,
write-ahead log): one transaction per recording Gate call holds the call's task records, its
idempotency key and its stored answer, so a kill at any instant leaves either the whole call
recorded or none of it, and no temporary file behind. Work per call is proportional to the
groups in it (primary-key reads and upserts, counters kept in the database), never to the
size of the history. The number of distinct tasks and of stored keys are bounded; beyond the
task bound a new task is refused (`HistoryFull`), beyond the key bound the oldest keys go.

An older service kept the history in a JSON file; the JSON of the same name beside the
database (`task_history.json` for `task_history.sqlite3`) is imported once, in one
transaction, then renamed `<name>.migrated` so it is never read again, and the temporary
files its writer could leave after a kill (`.task_history.json.*.tmp`) are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from leap.runtime.logging import get_logger

LEGACY_FORMAT_VERSION = 1  # of the JSON file an older service wrote
SCHEMA_VERSION = 1
LEGACY_SUFFIX = ".json"
DB_SUFFIX = ".sqlite3"

log = get_logger("leap.reward")
T = TypeVar("T")


class HistoryFileError(OSError):
    """The history cannot be read or written (an OSError, so `leap serve` reports it in one line)."""


class HistoryFull(Exception):
    """Recording would take the history past its bound of distinct tasks."""


class KeyReused(Exception):
    """An idempotency key already names another request."""


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


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a recording call stored: its answer, and whether it was a replay of an earlier one."""

    reply: bytes
    replayed: bool
    result: object = None  # the caller's value from `decide` (None on a replay)


def database_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(database, legacy JSON) for a `history_path` setting. A path ending in .json (the
    setting of an older service) names the legacy file; the database is beside it."""
    given = Path(path).expanduser()
    if given.suffix == LEGACY_SUFFIX:
        return given.with_suffix(DB_SUFFIX), given
    return given, given.with_suffix(LEGACY_SUFFIX)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY,
    ema_pass_rate REAL NOT NULL,
    attempts INTEGER NOT NULL,
    solves INTEGER NOT NULL,
    groups_recorded INTEGER NOT NULL,
    update_time REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS gate_keys (
    key TEXT PRIMARY KEY,
    fingerprint BLOB NOT NULL,
    reply BLOB NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS gate_keys_created ON gate_keys (created);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value) WITHOUT ROWID;
INSERT OR IGNORE INTO meta VALUES ('schema', 1), ('tasks', 0), ('keys', 0);
"""


class HistoryStore:
    """The task history in SQLite; `path` None keeps it in memory (same code, no file).

    Thread-safe: one connection, used under a lock, from worker threads (the servicer never
    blocks its event loop on the database). Several processes may share a file: every
    recording call is one `BEGIN IMMEDIATE` transaction that reads what it updates.
    """

    def __init__(self, path: str | os.PathLike | None, *, fsync: bool = True, max_tasks: int = 50_000,
                 max_keys: int = 100_000, key_ttl_seconds: float = 7 * 24 * 3600.0, lock_timeout_seconds: float = 10.0):
        self.path, self.legacy = database_paths(path) if path else (None, None)
        self.max_tasks = max_tasks
        self.max_keys = max_keys
        self.key_ttl_seconds = key_ttl_seconds
        self._lock = threading.Lock()
        try:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path) if self.path else ":memory:", timeout=lock_timeout_seconds,
                                       isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            self._db.executescript(_SCHEMA)
            schema = self._meta("schema")
            if schema != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"unsupported schema version {schema!r}")
            self._migrate()
        except (OSError, sqlite3.Error, ValueError, KeyError, TypeError, AttributeError) as err:
            raise HistoryFileError(f"cannot read the task history {self.where!r}: {err}. Fix it, move it away, or "
                                   "point history_path elsewhere.") from None

    @property
    def where(self) -> str:
        return str(self.path) if self.path else ":memory:"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- reads ------------------------------------------------------------------------------

    def records(self, task_ids: Iterable[str]) -> dict[str, TaskRecord]:
        """The records of the tasks named that the history holds."""
        with self._lock:
            return self._records(set(task_ids))

    def all_records(self) -> list[TaskRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tasks ORDER BY task_id").fetchall()
        return [TaskRecord(*row) for row in rows]

    def task_count(self) -> int:
        with self._lock:
            return int(self._meta("tasks"))

    def key_count(self) -> int:
        with self._lock:
            return int(self._meta("keys"))

    # --- the one write ------------------------------------------------------------------------

    def record_call(self, task_ids: Sequence[str], decide: Callable[[dict[str, TaskRecord]], tuple[Mapping[str, TaskRecord], bytes, T]],
                    key: str = "", fingerprint: bytes = b"", now: float | None = None) -> Recorded:
        """One recording call, atomically: with a `key` already stored (same `fingerprint`),
        its stored reply (`KeyReused` for another fingerprint); otherwise
        `decide(current records of task_ids)` gives (records to write, reply, result), which
        are written with the key in one transaction. `HistoryFull` when new tasks would pass
        `max_tasks`; `HistoryFileError` when the database cannot be written (nothing is)."""
        now = time.time() if now is None else now
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    if key:
                        stored = self._db.execute("SELECT fingerprint, reply FROM gate_keys WHERE key = ?",
                                                  (key,)).fetchone()
                        if stored is not None:
                            self._db.execute("ROLLBACK")
                            if bytes(stored[0]) != fingerprint:
                                raise KeyReused(key)
                            return Recorded(bytes(stored[1]), True)
                    current = self._records(set(task_ids))
                    updates, reply, result = decide(current)
                    added = sum(1 for task_id in updates if task_id not in current)
                    tasks = int(self._meta("tasks"))
                    if added and tasks + added > self.max_tasks:
                        self._db.execute("ROLLBACK")
                        raise HistoryFull(f"the task history holds {tasks} tasks and this call would add {added}, "
                                          f"past max_history_tasks {self.max_tasks}")
                    self._db.executemany(
                        "INSERT INTO tasks VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
                        "ema_pass_rate = excluded.ema_pass_rate, attempts = excluded.attempts, "
                        "solves = excluded.solves, groups_recorded = excluded.groups_recorded, "
                        "update_time = excluded.update_time",
                        [dataclasses.astuple(item) for item in updates.values()])
                    if added:
                        self._db.execute("UPDATE meta SET value = value + ? WHERE name = 'tasks'", (added,))
                    if key:
                        self._store_key(key, fingerprint, reply, now)
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as err:
                raise HistoryFileError(f"cannot write the task history {self.where!r}: {err}") from None
        return Recorded(reply, False, result)

    # --- internals (lock held) ----------------------------------------------------------------

    def _meta(self, name: str):
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def _records(self, task_ids: set[str]) -> dict[str, TaskRecord]:
        found: dict[str, TaskRecord] = {}
        ids = sorted(task_ids)
        for start in range(0, len(ids), 500):  # below SQLite's limit of bound parameters
            part = ids[start:start + 500]
            marks = ",".join("?" * len(part))
            for row in self._db.execute(f"SELECT * FROM tasks WHERE task_id IN ({marks})", part):
                found[row[0]] = TaskRecord(*row)
        return found

    def _store_key(self, key: str, fingerprint: bytes, reply: bytes, now: float) -> None:
        """Store a key; drop expired ones and the oldest past `max_keys` (amortized O(1): each
        key is inserted once and deleted once, through the index on its creation time)."""
        self._db.execute("INSERT INTO gate_keys VALUES (?, ?, ?, ?)", (key, fingerprint, reply, now))
        expired = self._db.execute("DELETE FROM gate_keys WHERE created < ?", (now - self.key_ttl_seconds,)).rowcount
        keys = int(self._meta("keys")) + 1 - expired
        if keys > self.max_keys:
            keys -= self._db.execute("DELETE FROM gate_keys WHERE key IN (SELECT key FROM gate_keys ORDER BY created "
                                     "LIMIT ?)", (keys - self.max_keys,)).rowcount
        self._db.execute("UPDATE meta SET value = ? WHERE name = 'keys'", (keys,))

    def _migrate(self) -> None:
        """Import the legacy JSON file once (one transaction), then rename it and remove the
        temporary files an older writer left."""
        if self.legacy is None:
            return
        for leftover in self.legacy.parent.glob(f".{self.legacy.name}.*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()
                log.info("leftover temporary file of the old history removed", path=str(leftover))
        if not self.legacy.is_file():
            return
        data = json.loads(self.legacy.read_text())
        if data.get("version") != LEGACY_FORMAT_VERSION:
            raise ValueError(f"{str(self.legacy)!r}: unsupported format version {data.get('version')!r}")
        records = [TaskRecord(**item) for item in data["tasks"]]
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for item in records:
                exists = self._db.execute("SELECT 1 FROM tasks WHERE task_id = ?", (item.task_id,)).fetchone()
                if exists is None:  # a record already in the database is newer than the file's
                    self._db.execute("INSERT INTO tasks VALUES (?, ?, ?, ?, ?, ?)", dataclasses.astuple(item))
                    self._db.execute("UPDATE meta SET value = value + 1 WHERE name = 'tasks'")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        target = self.legacy.with_name(self.legacy.name + ".migrated")
        os.replace(self.legacy, target)
        log.info("task history imported from the JSON file of an older service", path=str(self.legacy),
                 tasks=len(records), database=str(self.path), moved_to=str(target))
