"""Pure functions of the CORRECT stage and of verdicts: comparing outputs with the oracle
(streaming), comparing inputs, timing statistics, log trimming and throttle detection."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from leap.sandbox.v1 import sandbox_pb2

SENTINEL_BYTE = 0xFF  # every output byte is set to it before a run: all-ones is a NaN in float16/32/64
# Throttle reasons under which a timing is not trusted (NVML names, see telemetry.py).
UNRELIABLE_THROTTLE = frozenset({"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                                 "hw_power_brake_slowdown"})


def sentinel_mask(got: np.ndarray) -> np.ndarray:
    """Elements whose bytes still all hold the sentinel (never written by the kernel)."""
    raw = np.ascontiguousarray(got).view(np.uint8).reshape(got.size, got.itemsize) if got.size else np.zeros((0, 1), np.uint8)
    return np.all(raw == SENTINEL_BYTE, axis=1).reshape(got.shape)


CHUNK_ELEMENTS = 1 << 20  # outputs are compared this many elements at a time


def compare(name: str, trial: int, got: np.ndarray, expected: np.ndarray, atol: float, rtol: float,
            sentinel: bool = True, *, convert: Callable[[np.ndarray], np.ndarray] | None = None,
            release: Callable[[int, int], None] | None = None,
            chunk: int = CHUNK_ELEMENTS) -> sandbox_pb2.Mismatch | None:
    """The first departure of `got` from `expected` (|got - expected| <= atol + rtol * |expected|
    elementwise), or None when every element is within tolerance.

    Streams: `chunk` elements at a time, so the memory it needs beyond the two arrays is a few
    chunks whatever their size. `convert` turns a chunk of `got` and of `expected` into
    numbers (bfloat16 held as uint16); `release(start, end)` is called with each chunk's
    element range once it is done (the service drops those pages of a shared region). An
    output within tolerance costs one pass; the error statistics of a failure take another."""
    mismatch = sandbox_pb2.Mismatch(output=name, trial=trial, total_elements=int(expected.size))
    if got.shape != expected.shape:
        mismatch.reason = "shape"
        mismatch.bad_elements = int(expected.size)
        return mismatch
    flat_got, flat_want = got.reshape(-1), expected.reshape(-1)
    bad_count, first, nan_or_inf = 0, -1, False
    for start, have, want, error in _chunks(flat_got, flat_want, chunk, convert, release):
        allowed = np.abs(want)
        allowed *= rtol
        allowed += atol
        bad = ~(error <= allowed)  # NaN anywhere is bad ...
        if not bad.any():
            continue
        bad &= ~(np.isnan(have) & np.isnan(want))  # ... except where both are NaN
        count = int(np.count_nonzero(bad))
        if not count:
            continue
        if first < 0:
            index = int(np.argmax(bad))
            first = start + index
            mismatch.expected, mismatch.got = float(want[index]), float(have[index])
        bad_count += count
        wrong = have[bad]
        nan_or_inf |= bool(np.isnan(wrong).any() or np.isinf(wrong).any())
    if not bad_count:
        return None
    max_abs = max_rel = -1.0
    for _, _, want, error in _chunks(flat_got, flat_want, chunk, convert, release):
        finite = np.isfinite(error)
        if finite.any():
            max_abs = max(max_abs, float(error[finite].max()))
            max_rel = max(max_rel, float((error[finite] / (np.abs(want[finite]) + 1e-12)).max()))
    mismatch.max_abs_error = max_abs if max_abs >= 0 else math.inf
    mismatch.max_rel_error = max_rel if max_rel >= 0 else math.inf
    mismatch.first_bad_index = first
    mismatch.bad_elements = bad_count
    if sentinel and _any_sentinel(flat_got, chunk, release):
        mismatch.reason = "output not written"
    elif nan_or_inf:
        mismatch.reason = "nan"
    else:
        mismatch.reason = "values"
    return mismatch


def _chunks(flat_got: np.ndarray, flat_want: np.ndarray, chunk: int, convert: Callable[[np.ndarray], np.ndarray] | None,
            release: Callable[[int, int], None] | None):
    """(start, got, expected, |got - expected|) a chunk at a time, as float64."""
    for start in range(0, flat_got.size, chunk):
        end = min(start + chunk, flat_got.size)
        have_raw, want_raw = flat_got[start:end], flat_want[start:end]
        if convert is not None:
            have_raw, want_raw = convert(have_raw), convert(want_raw)
        want = want_raw.astype(np.float64, copy=False)
        have = have_raw.astype(np.float64)
        error = np.subtract(have, want)
        np.abs(error, out=error)
        yield start, have, want, error
        if release is not None:
            release(start, end)


def _any_sentinel(flat: np.ndarray, chunk: int, release: Callable[[int, int], None] | None) -> bool:
    for start in range(0, flat.size, chunk):
        end = min(start + chunk, flat.size)
        found = bool(sentinel_mask(flat[start:end]).any())
        if release is not None:
            release(start, end)
        if found:
            return True
    return False


def same_bytes(a: np.ndarray, b: np.ndarray, *, release: Callable[[int, int], None] | None = None,
               chunk_bytes: int = CHUNK_ELEMENTS * 4) -> bool:
    """Whether two byte arrays are equal, compared a chunk at a time."""
    if a.size != b.size:
        return False
    for start in range(0, a.size, chunk_bytes):
        end = min(start + chunk_bytes, a.size)
        equal = bool(np.array_equal(a[start:end], b[start:end]))
        if release is not None:
            release(start, end)
        if not equal:
            return False
    return True


def timing_stats(seconds: Sequence[float]) -> sandbox_pb2.TimingStats:
    """Statistics of timed runs given in seconds, reported in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return sandbox_pb2.TimingStats()
    return sandbox_pb2.TimingStats(median_ms=statistics.median(ms), mean_ms=statistics.fmean(ms), min_ms=min(ms),
                                   max_ms=max(ms), std_ms=statistics.pstdev(ms) if len(ms) > 1 else 0.0, trials=len(ms))


def trim_log(text: str, limit: int) -> tuple[str, bool]:
    """The head of a log (where the first errors are) within `limit` bytes, and whether it
    was cut."""
    data = text.encode(errors="replace")
    if len(data) <= limit:
        return text, False
    note = f"\n... [{len(data) - limit} more bytes trimmed]"
    head = data[: max(0, limit - len(note))].decode(errors="ignore")
    return head + note, True


def throttled(samples: Iterable[sandbox_pb2.TelemetrySample]) -> list[str]:
    """The throttle reasons that make a timing unreliable, seen in any sample."""
    seen = {reason for sample in samples for reason in sample.throttle_reasons}
    return sorted(seen & UNRELIABLE_THROTTLE)
