"""The compile cache: shared objects (and compile failures) on disk, keyed by the SHA-256 of
everything that determines the result (source, toolchain, compiler identity, flags).

Safe under concurrency: an entry is written to a temporary file and renamed into place, so
a reader sees a whole entry or none; workers of this process compiling the same key wait
for the first one (a batch often holds duplicates), and other processes sharing the
directory at worst compile the same key twice. A hit costs a stat and a hard link.
Failures are cached too, so a repeated syntax error is answered without the compiler.
Entries are evicted oldest-used first when the directory grows over its byte budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

CACHE_FORMAT = "1"


@dataclasses.dataclass(frozen=True)
class Entry:
    ok: bool
    log: str
    object_path: Path | None  # the shared object, when ok
    seconds: float  # how long the original compile took


def cache_key(*parts: str) -> str:
    digest = hashlib.sha256(CACHE_FORMAT.encode())
    for part in parts:
        data = part.encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


class CompileCache:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.root = Path(directory)
        self.objects = self.root / "objects"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._stores = 0

    def _paths(self, key: str) -> tuple[Path, Path]:
        folder = self.objects / key[:2]
        return folder / f"{key}.so", folder / f"{key}.json"

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Serialize compiles of one key within this process."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            yield
        with self._guard:
            if not lock.locked():
                self._locks.pop(key, None)

    def lookup(self, key: str) -> Entry | None:
        obj, meta = self._paths(key)
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if info.get("ok"):
            if not obj.is_file():
                return None
            with contextlib.suppress(OSError):
                os.utime(meta)  # recency for eviction
            return Entry(True, info.get("log", ""), obj, float(info.get("seconds", 0.0)))
        return Entry(False, info.get("log", ""), None, float(info.get("seconds", 0.0)))

    def store(self, key: str, ok: bool, log: str, seconds: float, object_file: Path | None = None) -> Entry:
        obj, meta = self._paths(key)
        obj.parent.mkdir(parents=True, exist_ok=True)
        if ok and object_file is not None:
            self._atomic_copy(object_file, obj)
        self._atomic_write(meta, json.dumps({"ok": ok, "log": log, "seconds": seconds}))
        self._stores += 1
        if self._stores % 64 == 0:
            self.evict()
        return Entry(ok, log, obj if ok else None, seconds)

    def _atomic_copy(self, source: Path, target: Path) -> None:
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        os.close(fd)
        shutil.copyfile(source, temporary)
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)

    def _atomic_write(self, target: Path, text: str) -> None:
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)

    def place(self, entry: Entry, target: Path) -> None:
        """Put the cached object at `target` (a hard link when on the same file system)."""
        assert entry.object_path is not None
        try:
            os.link(entry.object_path, target)
        except OSError:
            shutil.copyfile(entry.object_path, target)
            os.chmod(target, 0o644)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.objects.rglob("*") if p.is_file())

    def evict(self) -> int:
        """Remove the least recently used entries until the cache fits its budget."""
        entries = []
        total = 0
        for meta in self.objects.rglob("*.json"):
            obj = meta.with_suffix(".so")
            try:
                size = meta.stat().st_size + (obj.stat().st_size if obj.exists() else 0)
                entries.append((meta.stat().st_mtime, size, meta, obj))
            except OSError:
                continue
            total += size
        removed = 0
        for _, size, meta, obj in sorted(entries):
            if total <= self.max_bytes:
                break
            for path in (meta, obj):
                with contextlib.suppress(OSError):
                    path.unlink()
            total -= size
            removed += 1
        return removed
