"""Pure functions of the timing stage: how long a timed run is, in what order candidate and
reference run, when to stop repeating, and the speedup with its confidence interval.

A *pair* is one timed run of the reference and one of the candidate on the same fresh
inputs, back to back (reference first on even pairs, candidate first on odd ones, so neither
always finds the caches and clocks the other one left). Its ratio is

    r_i = t_reference_i / t_candidate_i

Pairing cancels what the two runs share (a neighbour's burst of load, a clock change). The
order does not cancel within a pair: whichever side runs second is measured slower (on this
project's 2-core EPYC an honest relu ran 12.5 us per call first and 16.5 us second, the
reference 31.5 and 33.5), so per-pair ratios fall into two clusters, one per order, and
their median's interval spans both (every relu verdict was TIMING_UNRELIABLE). So pairs are
grouped in *blocks* of one pair of each order (two consecutive pairs; one pair when the
order does not alternate), and a block's ratio is

    b_j = (t_reference_2j + t_reference_2j+1) / (t_candidate_2j + t_candidate_2j+1)

in which an order effect on either side counts once in each order and cancels. The speedup
is the Hodges-Lehmann estimate of the block ratios' centre, taken on their logarithms (a
ratio and its inverse are symmetric there): with x_j = log b_j and the n(n+1)/2 Walsh
averages w = (x_i + x_j) / 2 for i <= j,

    speedup = exp(median(w))

with the interval of the Wilcoxon signed-rank test, [exp w_(k), exp w_(M+1-k)] (1-based,
M = n(n+1)/2), k the largest integer such that P(T < k) <= (1 - confidence) / 2 under the
exact null distribution of the signed-rank statistic T (a normal approximation past 60
blocks). It covers the centre with at least that confidence where the log ratios are
symmetric about it, is as robust as the median to a block spoiled by a pre-emption (it
takes 29% of the blocks to move it arbitrarily), and is narrower than the median's
order-statistic interval for the same blocks: in a one-off replay of 200 evaluations of the suite's solutions
on this project's 2-core machine, stopping as below, it needed 4-6% fewer pairs and flagged
1-2% of honest verdicts TIMING_UNRELIABLE where the median flagged 3-9%, with a spread
between evaluations as small or smaller (docs/ARCHITECTURE.md, "Timing"). With fewer than
6 blocks no k reaches 95% and the interval is [min, max] of the block ratios (94% for 5
blocks, 88% for 4, 75% for 3).

Pairs are added until the interval's relative width (high - low) / speedup is at most the
target, or a budget of pairs or seconds is spent; then an interval wider than a second,
looser bound is TIMING_UNRELIABLE.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence

import numpy as np


def calls_per_run(seconds_per_call: float, target_seconds: float, most: int) -> int:
    """Calls in one timed run so that a run of calls at `seconds_per_call` lasts about
    `target_seconds` (the fixed cost of starting and stopping a run, tens of microseconds, then
    hardly counts), within [1, most]."""
    calls = most if seconds_per_call <= 0 else math.ceil(target_seconds / seconds_per_call)
    return max(1, min(most, calls))


def paced_calls(reference_per_call: float, target_seconds: float, most: int, slower_per_call: float,
                longest_seconds: float) -> int:
    """Calls in one timed run of a task whose reference's cost per call is known (its
    *pace*, measured once per task before its first timed runs): enough for the reference's
    run to last about `target_seconds`, rounded down to a power of two, within [1, most],
    and the candidate's (`slower_per_call`, its slowest measured) at most `longest_seconds`.

    Sized from the measured runs of each evaluation instead (`calls_per_run`), one honest
    relu solution got 6 to 128 calls a run: the warm-up's first runs have one or a few cold
    calls, whose time the run's fixed cost and first-touch faults dominate. The run's working
    set, and with it the speedup, moved between cache and memory (0.73-0.90x at some call
    counts, 1.4-1.7x at others). A pace fixed per task keeps every candidate of the task on
    the same working set; the power of two keeps a slightly different pace (another sandbox
    process) on the same count."""
    calls = calls_per_run(reference_per_call, target_seconds, most)
    calls = 1 << (calls.bit_length() - 1)
    if slower_per_call > 0 and math.isfinite(longest_seconds):
        calls = min(calls, max(1, math.floor(longest_seconds / slower_per_call)))
    return calls


def order(pair: int, alternate: bool) -> tuple[str, str]:
    """Who runs first in pair `pair`."""
    return ("reference", "candidate") if (not alternate or pair % 2 == 0) else ("candidate", "reference")


_EXACT_BLOCKS = 60  # the signed-rank statistic's exact distribution up to here; a normal one beyond


@functools.lru_cache(maxsize=256)
def signed_rank_k(n: int, confidence: float = 0.95) -> int:
    """The largest k >= 1 with P(T < k) <= (1 - confidence) / 2, T the Wilcoxon signed-rank
    statistic of n observations under the null (each of the ranks 1..n counted with
    probability 1/2); 1 where none reaches it ([min, max] is then the interval)."""
    alpha = (1.0 - confidence) / 2
    total = n * (n + 1) // 2
    if n > _EXACT_BLOCKS:
        sd = math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
        z = statistics.NormalDist().inv_cdf(alpha)
        return max(1, math.floor(total / 2 + z * sd + 0.5))  # P(T <= k - 1) with a continuity correction
    counts = [1] + [0] * total  # counts[t]: subsets of the ranks 1..i whose sum is t
    for rank in range(1, n + 1):
        for t in range(total, rank - 1, -1):
            counts[t] += counts[t - rank]
    k, below = 0, 0
    while k <= total and (below + counts[k]) / 2 ** n <= alpha:  # P(T <= k) <= alpha: k + 1 qualifies
        below += counts[k]
        k += 1
    return max(k, 1)


def hodges_lehmann_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(centre, low, high) of positive ratios: the Hodges-Lehmann estimate on their logarithms
    and the signed-rank interval (the module's docstring); values <= 0 are left out."""
    logs = np.log(np.array([v for v in values if v > 0], dtype=np.float64))
    n = len(logs)
    if not n:
        return 0.0, 0.0, 0.0
    upper = np.triu_indices(n)  # i <= j: n(n+1)/2 averages (125 000 at 500 blocks, sorted in milliseconds)
    walsh = np.sort(((logs[:, None] + logs[None, :]) / 2)[upper])
    k = min(signed_rank_k(n, confidence), (len(walsh) + 1) // 2)
    return math.exp(float(np.median(walsh))), math.exp(float(walsh[k - 1])), math.exp(float(walsh[len(walsh) - k]))


def relative_width(low: float, high: float, center: float) -> float:
    return (high - low) / center if center > 0 else math.inf


def block_size(alternate: bool) -> int:
    """Pairs per block: one of each order when the order alternates."""
    return 2 if alternate else 1


def block_ratios(reference: Sequence[float], candidate: Sequence[float], size: int) -> list[float]:
    """Per block of `size` consecutive pairs, the reference's total over the candidate's (an
    incomplete last block is left out, as are blocks with a non-positive total; with fewer
    pairs than one block, each pair is its own)."""
    if len(reference) < size:
        size = 1
    blocks = []
    for start in range(0, len(reference) - size + 1, size):
        ref, cand = sum(reference[start:start + size]), sum(candidate[start:start + size])
        if ref > 0 and cand > 0:
            blocks.append(ref / cand)
    return blocks


def speedup_interval(reference: Sequence[float], candidate: Sequence[float], alternate: bool,
                     confidence: float = 0.95) -> tuple[float, float, float]:
    """(speedup, low, high) of per-pair times: the Hodges-Lehmann centre of the block ratios
    (blocks of one pair of each order when the order alternates) and its signed-rank interval."""
    return hodges_lehmann_interval(block_ratios(reference, candidate, block_size(alternate)), confidence)


def should_stop(pairs: int, width: float, *, min_pairs: int, max_pairs: int, target_width: float,
                elapsed: float, budget_seconds: float, block: int = 1) -> bool:
    """After at least `min_pairs` pairs (the request's timing_trials: always run), stop once
    the interval is narrow enough, or the budget of pairs or seconds is spent; only after a
    whole block (`block` pairs)."""
    if pairs >= max(max_pairs, min_pairs):
        return True
    if pairs < min_pairs or pairs % block:
        return False
    return width <= target_width or elapsed >= budget_seconds


def excess(candidate: Sequence[float], reference: Sequence[float]) -> float:
    """How much longer the candidate's untimed copies (cuda: staging inputs and fetching
    outputs) took than the reference's identical ones, as a median over pairs, in seconds.
    Work moved out of the timed region into those copies shows up here."""
    if not candidate or not reference:
        return 0.0
    return statistics.median(c - r for c, r in zip(candidate, reference))
