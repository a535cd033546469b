"""Work directories the service makes for itself, and the ones a killed service left behind.

A sandbox without `work_dir` makes its own under the temp directory and removes it when it
stops. A service that is killed (SIGKILL, the OOM killer, a node losing power) cannot, and
each such directory holds a precompiled header and the jobs' files (about 15 MB): a
sandbox restarted in a crash loop would fill /tmp. So each owned directory holds a lock
file that its service keeps locked (`flock`, exclusive) for as long as it lives; the kernel
drops the lock when the process ends however it ends, and the next sandbox that starts on
the host removes every such directory whose lock it can take.

The directory is made under a hidden name, locked, then renamed into place, so no sweeping
service ever sees one of ours before it is locked. Only directories of the service's own
user with a lock file are touched: one of an older version (no lock file) is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "leap-sandbox-"
LOCK = ".owner.lock"


class OwnedDir:
    """A work directory locked by this process until `close()`, which removes it."""

    def __init__(self, parent: str | os.PathLike | None = None):
        staging = Path(tempfile.mkdtemp(prefix="." + PREFIX, dir=parent))
        try:
            self._fd = os.open(staging / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path = staging.with_name(staging.name[1:])
            os.rename(staging, self.path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def close(self) -> None:
        if self._fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = None


def sweep(parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove the work directories under `parent` (the temp directory by default) whose
    service has died; return them."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(Path(entry.path) / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no lock file: an older version's, or not ours to judge
            continue
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
        finally:
            os.close(fd)
    return removed
