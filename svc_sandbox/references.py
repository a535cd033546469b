"""Reference data, computed once and reused: each correctness trial's inputs (written to
files the candidate processes read) with their digests and the oracle's outputs, per task,
size, seed and trial; and reference timings per task, size, toolchain and device.

Expected outputs stay in this (trusted) process only; candidates never see them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np

from leap.tasks import TaskSpec
from leap.sandbox.v1 import sandbox_pb2


@dataclasses.dataclass(frozen=True)
class TrialData:
    files: dict[str, str]  # input name -> file of its raw bytes (C order)
    digests: dict[str, str]  # input name -> blake2b digest of those bytes
    expected: dict[str, np.ndarray]  # output name -> oracle values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.expected.values())


@dataclasses.dataclass(frozen=True)
class RecordedTrials:
    """Trials whose expected outputs a reference job produced (KernelBench)."""

    trials: list[TrialData]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.trials)


def input_digest(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).data, digest_size=16).hexdigest()


class ReferenceStore:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.max_bytes = max_bytes
        self._trials: collections.OrderedDict[Hashable, TrialData | RecordedTrials] = collections.OrderedDict()
        self._bytes = 0
        self._timings: dict[Hashable, sandbox_pb2.TimingStats] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[Hashable, threading.Lock] = collections.defaultdict(threading.Lock)

    @contextlib.contextmanager
    def _computing(self, key: Hashable):
        with self._lock:
            lock = self._key_locks[key]
        with lock:
            yield

    def _get(self, key: Hashable) -> Any:
        with self._lock:
            found = self._trials.get(key)
            if found is not None:
                self._trials.move_to_end(key)
            return found

    def _put(self, key: Hashable, data: TrialData | RecordedTrials) -> None:
        with self._lock:
            if key not in self._trials:
                self._trials[key] = data
                self._bytes += data.nbytes
            while self._bytes > self.max_bytes and len(self._trials) > 1:
                _, old = self._trials.popitem(last=False)
                self._bytes -= old.nbytes

    def _folder(self, *parts: object) -> Path:
        folder = self.root.joinpath(*(str(p) for p in parts))
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            for parent in [folder, *folder.parents]:
                if parent == self.root:
                    break
                os.chmod(parent, 0o755)
        return folder

    def _write(self, path: Path, array: np.ndarray) -> None:
        if path.exists() and path.stat().st_size == array.nbytes:
            return
        temporary = path.with_name(f".{path.name}.{threading.get_ident()}")
        with open(temporary, "wb") as file:
            file.write(np.ascontiguousarray(array).data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)

    def trial(self, spec: TaskSpec, size: str, sizes: dict[str, int], seed: int, trial: int) -> TrialData:
        """Inputs and expected outputs of a built-in task's correctness trial."""
        key = ("builtin", spec.task.id, size, seed, trial)
        found = self._get(key)
        if found is not None:
            return found
        with self._computing(key):
            found = self._get(key)
            if found is not None:
                return found
            inputs = spec.inputs(sizes, seed, trial)
            folder = self._folder(spec.task.id, size, seed, trial)
            files = {}
            for name, array in inputs.items():
                path = folder / f"{name}.bin"
                self._write(path, array)
                files[name] = str(path)
            data = TrialData(files, {k: input_digest(v) for k, v in inputs.items()}, spec.expected(inputs, sizes))
            self._put(key, data)
            return data

    def recorded(self, key: Hashable, compute: Callable[[], list[TrialData]]) -> list[TrialData]:
        """Trials whose expected outputs come from a reference job (KernelBench), computed by
        `compute` once per key."""
        found = self._get(key)
        if found is None:
            with self._computing(key):
                found = self._get(key)
                if found is None:
                    found = RecordedTrials(compute())
                    if not found.trials:  # a failed reference run is reported, not remembered
                        return []
                    self._put(key, found)
        return found.trials

    def timing(self, key: Hashable, measure: Callable[[], sandbox_pb2.TimingStats | None]) -> sandbox_pb2.TimingStats | None:
        """A reference timing, measured by `measure` once per key (task, size, toolchain, device)."""
        with self._lock:
            if key in self._timings:
                return self._timings[key]
        with self._computing(("timing", key)):
            with self._lock:
                if key in self._timings:
                    return self._timings[key]
            stats = measure()
            if stats is not None and stats.trials:
                with self._lock:
                    self._timings[key] = stats
            return stats

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"trials_cached": len(self._trials), "bytes": self._bytes, "timings_cached": len(self._timings)}
