"""Reference data the service computes and keeps (this process only; a candidate never sees
what is here):

- each correctness trial's inputs and the oracle's outputs, per task, size, seed and trial
  (reproducible: the same request gets the same inputs);
- a small pool of input sets per task and size, drawn from seeds the service chose at random
  when it started, from which every timed call's inputs are made (`scramble_into`);
- what a KernelBench problem's tensors look like (its probe), per problem and device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from leap import tasks
from leap.sandbox.v1 import sandbox_pb2

POOL_SETS = 4
Role = sandbox_pb2.ArgumentRole
MANTISSA_BITS = {2: 10, 4: 23, 8: 52}  # float16, float32, float64
UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclasses.dataclass(frozen=True)
class TrialData:
    inputs: dict[str, np.ndarray]  # input name -> array (C order)
    expected: dict[str, np.ndarray]  # output name -> oracle values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.inputs.values()) + sum(a.nbytes for a in self.expected.values())


def mantissa_key(dtype: np.dtype, rng: np.random.Generator) -> int:
    """A random nonzero mask over the mantissa bits of a float dtype."""
    bits = MANTISSA_BITS[np.dtype(dtype).itemsize]
    return int(rng.integers(1, 1 << bits, dtype=np.uint64))


def scramble_into(source: np.ndarray, out: np.ndarray, key: int) -> None:
    """out = source with every element's mantissa XOR-ed with `key` (floats): the sign and the
    binade of every value are kept (so is a task's value range: uniform [0, 1) stays in it),
    every element changes, and no output for `source` helps compute the output for `out`
    (the bits are mixed, not the values shifted or scaled, so no algebra of the op relates
    them). Integer inputs are copied (the caller draws them fresh)."""
    _scramble(np.ascontiguousarray(source).reshape(-1), out.reshape(-1), key)


ROW_BY_ROW_BYTES = 1 << 16  # rows this large: the loop's Python is small beside the bytes


def scramble_rows(sources: Sequence[np.ndarray], out: np.ndarray, keys: Sequence[int]) -> None:
    """`scramble_into` for the calls of a run at once: row i of `out` (a (calls, size) array,
    `shm.Region.rows`) gets sources[i] scrambled with keys[i]. Consecutive rows made from one
    source (the same array object: a pool set) are one NumPy operation that broadcasts the
    source against their keys, reading it once and writing each row once; rows of sources of
    their own (integers drawn afresh) are stacked into one operation where they are small and
    of one dtype, else written row by row (stacking large rows would only add a copy)."""
    if not len(sources):
        return
    runs, start = [], 0  # [start, end) of consecutive rows with one source
    for i in range(1, len(sources) + 1):
        if i == len(sources) or sources[i] is not sources[start]:
            runs.append((start, i))
            start = i
    keys = np.asarray(keys, dtype=np.uint64)
    first = np.asarray(sources[0])
    if len(runs) == len(sources) and len(sources) > 1 and first.nbytes < ROW_BY_ROW_BYTES and \
            all(np.asarray(s).dtype == first.dtype for s in sources):
        _scramble(np.stack([np.ascontiguousarray(s).reshape(-1) for s in sources]), out, keys[:, None])
        return
    for begin, end in runs:
        source = np.ascontiguousarray(sources[begin]).reshape(1, -1)
        _scramble(source, out[begin:end], keys[begin:end, None])


def _scramble(source: np.ndarray, out: np.ndarray, keys: int | np.ndarray) -> None:
    """The rule of `scramble_into` on arrays of one shape (`keys` broadcast against them)."""
    if source.dtype.kind != "f":
        np.copyto(out.view(source.dtype), source)
        return
    unsigned = UNSIGNED[source.dtype.itemsize]
    np.bitwise_xor(source.view(unsigned), np.asarray(keys).astype(unsigned), out=out.view(unsigned))


class ReferenceStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.secret = int.from_bytes(os.urandom(8), "little")  # the timed inputs' pool seeds: unknown outside
        self._trials: collections.OrderedDict[Hashable, TrialData] = collections.OrderedDict()
        self._pools: dict[Hashable, list[dict[str, np.ndarray]]] = {}
        self._probes: dict[Hashable, dict[str, Any]] = {}
        self._paces: dict[Hashable, float] = {}  # a task's reference seconds per call (timing.paced_calls)
        self._bytes = 0
        self._lock = threading.Lock()
        self._key_locks: dict[Hashable, threading.Lock] = collections.defaultdict(threading.Lock)

    @contextlib.contextmanager
    def _computing(self, key: Hashable):
        with self._lock:
            lock = self._key_locks[key]
        with lock:
            yield

    def _cached(self, table: dict, key: Hashable, compute: Callable[[], Any], remember: Callable[[Any], bool]) -> Any:
        with self._lock:
            if key in table:
                return table[key]
        with self._computing((id(table), key)):
            with self._lock:
                if key in table:
                    return table[key]
            value = compute()
            if remember(value):
                with self._lock:
                    table[key] = value
            return value

    def trial(self, spec: tasks.TaskSpec, size: str, sizes: dict[str, int], seed: int, trial: int) -> TrialData:
        """Inputs and expected outputs of a built-in task's correctness trial."""
        key = ("builtin", spec.task.id, size, seed, trial)
        with self._lock:
            found = self._trials.get(key)
            if found is not None:
                self._trials.move_to_end(key)
                return found
        with self._computing(key):
            with self._lock:
                if key in self._trials:
                    return self._trials[key]
            inputs = spec.inputs(sizes, seed, trial)
            data = TrialData(inputs, spec.expected(inputs, sizes))
            with self._lock:
                self._trials[key] = data
                self._bytes += data.nbytes
                while self._bytes > self.max_bytes and len(self._trials) > 1:
                    _, old = self._trials.popitem(last=False)
                    self._bytes -= old.nbytes
            return data

    def pool(self, spec: tasks.TaskSpec, size: str, sizes: dict[str, int]) -> list[dict[str, np.ndarray]]:
        """POOL_SETS input sets of a built-in task, from seeds only this process knows."""
        return self._cached(self._pools, (spec.task.id, size),
                            lambda: [spec.inputs(sizes, self.secret, -1 - i) for i in range(POOL_SETS)], lambda _: True)

    def probe(self, key: Hashable, compute: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """A KernelBench problem's probe (its tensors' dtypes and shapes), computed once per key;
        a failed probe is reported, not remembered."""
        return self._cached(self._probes, key, compute, lambda value: value is not None)

    def pace(self, key: Hashable) -> float | None:
        """The reference's seconds per call on a task (key: the task, its sizes and the
        clock), as the first timed evaluation of it in this process measured; None before."""
        with self._lock:
            return self._paces.get(key)

    def record_pace(self, key: Hashable, seconds: float) -> None:
        """Keep the first measured pace of a task (later ones do not move it: the same task
        keeps its calls per run for the life of the service)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        with self._lock:
            if len(self._paces) >= 100_000:
                self._paces.clear()
            self._paces.setdefault(key, seconds)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"trials_cached": len(self._trials), "bytes": self._bytes, "pools": len(self._pools),
                    "probes": len(self._probes)}


def fresh_integers(spec: tasks.TaskSpec, sizes: dict[str, int], names: Sequence[str],
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh draws of a task's integer inputs (from its own generator where it makes them)."""
    made = dict(spec.make_inputs(rng, **sizes)) if spec.make_inputs else {}
    result = {}
    for arg in spec.arguments(Role.ARGUMENT_ROLE_INPUT):
        if arg.name not in names:
            continue
        dtype = tasks.NUMPY_DTYPE[arg.dtype]
        shape = tasks.shape_of(arg, sizes)
        value = made.get(arg.name)
        result[arg.name] = (np.ascontiguousarray(value, dtype=dtype) if value is not None
                            else rng.standard_normal(shape).astype(dtype))
    return result
