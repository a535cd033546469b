"""Shared memory of a measured session: every input and output of every run lives in a memfd
the service creates, sizes and seals, so the service writes the inputs and reads the outputs
itself and nothing about them has to be taken from the candidate's word.

A region holds `slots` copies of one call's tensors (its inputs, then its outputs). In the
memfd each tensor takes whole pages and its data *ends* on a page boundary; a guarded
mapping (the candidate's) puts an inaccessible page after every tensor, so reading or
writing one element past the end is a segfault rather than a silent corruption, and a
tensor whose size is a multiple of 64 bytes starts 64-byte aligned.

The memfd is sealed against shrinking and growing once sized: a candidate holding it cannot
truncate it under the service's mapping (which would make the service's next read a SIGBUS).
The service drops the pages it has read from its own mapping (MADV_DONTNEED), so comparing a
large output costs the service a chunk of memory, not the output's size.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import math
import mmap
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE
BFLOAT16 = "bfloat16"  # not a NumPy dtype: held as uint16, converted to float32 where compared
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _pages(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One buffer of a call: a name, a dtype (a NumPy dtype string such as "<f4", or
    "bfloat16") and a shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    # Cached: the service asks for these for every tensor of every timed call.
    @functools.cached_property
    def itemsize(self) -> int:
        return 2 if self.dtype == BFLOAT16 else np.dtype(self.dtype).itemsize

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    @functools.cached_property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(np.uint16) if self.dtype == BFLOAT16 else np.dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each tensor of each slot lies in a region's memfd."""

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    slots: int

    # Cached (the dataclass is frozen): offsets are asked for every tensor of every timed call.
    @functools.cached_property
    def tensors(self) -> tuple[Tensor, ...]:
        return self.inputs + self.outputs

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:
        """Each tensor's first page's offset in a slot, then the slot's bytes."""
        starts = [0]
        for t in self.tensors:
            starts.append(starts[-1] + _pages(t.nbytes))
        return tuple(starts)

    @property
    def slot_bytes(self) -> int:
        return self._starts[-1]

    @property
    def size(self) -> int:
        return max(PAGE, self.slots * self.slot_bytes)

    @functools.cached_property
    def call_bytes(self) -> int:
        """Bytes of data (not pages) of one call's tensors."""
        return sum(t.nbytes for t in self.tensors)

    def span(self, index: int) -> tuple[int, int]:
        """(offset in a slot of the tensor's first page, its page bytes)."""
        return self._starts[index], self._starts[index + 1] - self._starts[index]

    def offset(self, slot: int, index: int) -> int:
        """Offset in the memfd of the first byte of tensor `index` of `slot`."""
        return slot * self._starts[-1] + self._starts[index + 1] - self.tensors[index].nbytes

    def as_dict(self) -> dict[str, Any]:
        encode = lambda ts: [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in ts]  # noqa: E731
        return {"inputs": encode(self.inputs), "outputs": encode(self.outputs), "slots": self.slots}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Layout:
        decode = lambda ts: tuple(Tensor(str(t["name"]), str(t["dtype"]), tuple(int(d) for d in t["shape"]))  # noqa: E731
                                  for t in ts)
        return Layout(decode(data["inputs"]), decode(data["outputs"]), int(data["slots"]))

    def with_slots(self, slots: int) -> Layout:
        return dataclasses.replace(self, slots=slots)


def slots_for(layout: Layout, budget_bytes: int, most: int) -> int:
    """How many slots a region may have: as many as fit `budget_bytes` of address space, at
    least one and at most `most`. Pages are only backed when touched, so unused slots cost
    nothing but address space."""
    return max(1, min(most, budget_bytes // max(1, layout.slot_bytes)))


class Region:
    """The service's side of one region: the memfd (sealed at its size) and a mapping of it.
    NumPy views of its tensors; filling, writing and releasing them."""

    def __init__(self, layout: Layout, name: str):
        self.layout = layout
        self.fd = os.memfd_create(f"leap-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, layout.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self.map = mmap.mmap(self.fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def view(self, slot: int, index: int) -> np.ndarray:
        """The tensor as a flat array (bfloat16 as uint16)."""
        tensor = self.layout.tensors[index]
        return np.frombuffer(self.map, dtype=tensor.numpy_dtype, count=tensor.size,
                             offset=self.layout.offset(slot, index))

    def raw(self, slot: int, index: int) -> np.ndarray:
        tensor = self.layout.tensors[index]
        return np.frombuffer(self.map, dtype=np.uint8, count=tensor.nbytes, offset=self.layout.offset(slot, index))

    def rows(self, index: int, count: int, first: int = 0, raw: bool = False) -> np.ndarray:
        """Tensor `index` of slots first .. first + count - 1 as one (count, size) array, a
        strided view (bfloat16 as uint16; with `raw`, bytes): one NumPy operation writes the
        tensor of every call of a run, where a loop over the calls would cost more in Python
        than the writing for the small tensors of most tasks."""
        tensor = self.layout.tensors[index]
        dtype = np.dtype(np.uint8) if raw else tensor.numpy_dtype
        return np.ndarray((count, tensor.nbytes // dtype.itemsize), dtype=dtype, buffer=self.map,
                          offset=self.layout.offset(first, index), strides=(self.layout.slot_bytes, dtype.itemsize))

    def fill(self, slots: Iterable[int], indexes: Iterable[int], byte: int, chunk: int = 4 << 20) -> None:
        """Set every byte of these tensors, a chunk at a time, dropping each chunk from this
        mapping once written (the data stays in the memfd); tensors of at most a chunk, for a
        run of consecutive slots, in one operation."""
        slots, indexes = list(slots), list(indexes)
        consecutive = bool(slots) and slots == list(range(slots[0], slots[0] + len(slots)))
        large = []
        for index in indexes:
            if consecutive and self.layout.tensors[index].nbytes <= chunk:
                self.rows(index, len(slots), slots[0], raw=True).fill(byte)
            else:
                large.append(index)
        for slot in slots:
            for index in large:
                raw = self.raw(slot, index)
                for start in range(0, raw.size, chunk):
                    raw[start:start + chunk].fill(byte)
                    if raw.size > chunk:
                        self.release(slot, index, start, min(start + chunk, raw.size))

    def write(self, slot: int, index: int, array: np.ndarray) -> None:
        tensor = self.layout.tensors[index]
        np.copyto(self.view(slot, index), np.ascontiguousarray(array).reshape(-1).view(tensor.numpy_dtype), casting="no")

    def release(self, slot: int, index: int, start: int = 0, end: int | None = None) -> None:
        """Drop the pages of bytes [start, end) of a tensor from this mapping (the data stays in
        the memfd): what the service has read no longer counts in its memory."""
        tensor = self.layout.tensors[index]
        base = self.layout.offset(slot, index)
        end = tensor.nbytes if end is None else end
        first = (base + start) // PAGE * PAGE
        last = -(-(base + end) // PAGE) * PAGE
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass
        os.close(self.fd)


# --------------------------------------------------------------------------------------
# In a child process: mapping a region received as a file descriptor.


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


class GuardedMapping:
    """A region mapped with an inaccessible page after every tensor (the candidate's view).
    `address(slot, index)` is where the tensor's first byte is."""

    def __init__(self, fd: int, layout: Layout):
        self.layout = layout
        libc = _libc()
        spans = [layout.span(i) for i in range(len(layout.tensors))]
        per_slot = sum(pages + PAGE for _, pages in spans)
        total = max(PAGE, per_slot * layout.slots)
        base = libc.mmap(None, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "cannot reserve address space for the buffers")
        self.base, self.total = base, total
        self._addresses: list[list[int]] = []
        for slot in range(layout.slots):
            row, at = [], base + slot * per_slot
            for index, (start, pages) in enumerate(spans):
                got = libc.mmap(at, pages, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd,
                                slot * layout.slot_bytes + start)
                if got != at:
                    raise OSError(ctypes.get_errno(), "cannot map a buffer of the session")
                row.append(at + pages - layout.tensors[index].nbytes)
                at += pages + PAGE  # the next page stays PROT_NONE: the guard
            self._addresses.append(row)

    def address(self, slot: int, index: int) -> int:
        return self._addresses[slot][index]

    def buffer(self, slot: int, index: int) -> ctypes.Array:
        """A writable buffer object over the tensor's bytes (for np.frombuffer / torch.frombuffer)."""
        return (ctypes.c_char * self.layout.tensors[index].nbytes).from_address(self.address(slot, index))

    def array(self, slot: int, index: int) -> np.ndarray:
        tensor = self.layout.tensors[index]
        if tensor.nbytes == 0:
            return np.empty(tensor.shape, dtype=tensor.numpy_dtype)
        return np.frombuffer(self.buffer(slot, index), dtype=tensor.numpy_dtype).reshape(tensor.shape)


class PlainMapping:
    """A region mapped whole (the trusted reference process's view)."""

    def __init__(self, fd: int, layout: Layout):
        self.layout = layout
        self.map = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def array(self, slot: int, index: int) -> np.ndarray:
        tensor = self.layout.tensors[index]
        return np.frombuffer(self.map, dtype=tensor.numpy_dtype, count=tensor.size,
                             offset=self.layout.offset(slot, index)).reshape(tensor.shape)


def bfloat16_to_float32(values: np.ndarray) -> np.ndarray:
    """bfloat16 held as uint16 -> float32 (the upper half of a float32's bits)."""
    return (values.astype(np.uint32) << 16).view(np.float32)


def as_compared(values: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's values in a NumPy type comparisons understand."""
    return bfloat16_to_float32(values) if dtype == BFLOAT16 else values


def tensors_of(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[Tensor, ...]:
    return tuple(Tensor(n, d, tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes))
