"""Pure functions of the CORRECT and timing stages: comparing outputs with the oracle,
timing statistics, the order of timed runs, log trimming and throttle detection."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

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


def compare(name: str, trial: int, got: np.ndarray, expected: np.ndarray, atol: float, rtol: float,
            sentinel: bool = True) -> sandbox_pb2.Mismatch | None:
    """The first departure of `got` from `expected` (|got - expected| <= atol + rtol * |expected|
    elementwise), or None when every element is within tolerance."""
    mismatch = sandbox_pb2.Mismatch(output=name, trial=trial, total_elements=int(expected.size))
    if got.shape != expected.shape:
        mismatch.reason = "shape"
        mismatch.bad_elements = int(expected.size)
        return mismatch
    want = expected.astype(np.float64, copy=False)
    have = got.astype(np.float64)
    error = np.abs(have - want)
    bad = ~(error <= atol + rtol * np.abs(want))  # NaN anywhere is bad
    bad |= np.isnan(have) != np.isnan(want)
    bad &= ~(np.isnan(have) & np.isnan(want))
    if not bad.any():
        return None
    finite = np.isfinite(error)
    mismatch.max_abs_error = float(error[finite].max()) if finite.any() else math.inf
    rel = error / (np.abs(want) + 1e-12)
    mismatch.max_rel_error = float(rel[finite].max()) if finite.any() else math.inf
    flat = bad.reshape(-1)
    index = int(np.argmax(flat))
    mismatch.first_bad_index = index
    mismatch.expected = float(want.reshape(-1)[index])
    mismatch.got = float(have.reshape(-1)[index])
    mismatch.bad_elements = int(flat.sum())
    if sentinel and sentinel_mask(got).any():
        mismatch.reason = "output not written"
    elif np.isnan(have).reshape(-1)[flat].any() or np.isinf(have).reshape(-1)[flat].any():
        mismatch.reason = "nan"
    else:
        mismatch.reason = "values"
    return mismatch


def timing_stats(seconds: Sequence[float]) -> sandbox_pb2.TimingStats:
    """Statistics of timed runs given in seconds, reported in milliseconds."""
    ms = [s * 1e3 for s in seconds]
    if not ms:
        return sandbox_pb2.TimingStats()
    return sandbox_pb2.TimingStats(median_ms=statistics.median(ms), mean_ms=statistics.fmean(ms), min_ms=min(ms),
                                   max_ms=max(ms), std_ms=statistics.pstdev(ms) if len(ms) > 1 else 0.0, trials=len(ms))


def speedup(reference: sandbox_pb2.TimingStats, candidate: sandbox_pb2.TimingStats) -> float:
    """Reference median over candidate median; 0 when either is missing."""
    if reference.trials == 0 or candidate.trials == 0 or candidate.median_ms <= 0:
        return 0.0
    return reference.median_ms / candidate.median_ms


def timing_schedule(trials: int, alternate: bool) -> list[tuple[str, str]]:
    """Order of the reference and candidate runs in each timed trial: with `alternate`, even
    trials run the reference first and odd ones the candidate first, so neither always finds
    the caches and clocks the other one left."""
    order = ("reference", "candidate")
    return [order if (not alternate or i % 2 == 0) else order[::-1] for i in range(trials)]


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
