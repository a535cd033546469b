"""RGRPO bookkeeping (DESIGN.md "RGRPO"), as pure functions.

Rounds r = 1..R each train a teacher from the same initial weights. After a round the new
teacher's pass rate on every task, q[r][x], joins the quality matrix; the union covers x
when some teacher reaches q >= tau. The next round draws uncovered tasks with weight 1 and
covered ones with weight alpha, so it is redirected toward what the union cannot do yet.

Steps are numbered across rounds (1 .. R * steps_per_round); a step's batch is drawn from
the round's weights with a seed of (run seed, step), so a resumed run draws the same tasks.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def round_of(step: int, steps_per_round: int) -> int:
    """The 1-based round a global step (1-based) belongs to."""
    return (step - 1) // steps_per_round + 1


def covered(quality: Sequence[Sequence[float]], tau: float) -> list[bool]:
    """Per task (column): whether some teacher (row) reaches q >= tau; all False without teachers."""
    if not quality:
        return []
    return [max(column) >= tau for column in zip(*quality)]


def coverage(quality: Sequence[Sequence[float]], tau: float) -> float:
    """Share of tasks the union covers; 0 without teachers."""
    flags = covered(quality, tau)
    return sum(flags) / len(flags) if flags else 0.0


def round_weights(task_count: int, quality: Sequence[Sequence[float]], tau: float, alpha: float) -> list[float]:
    """Sampling weight of each task in the next round: 1 when uncovered, alpha when covered
    (all 1 before the first teacher)."""
    if not quality:
        return [1.0] * task_count
    return [alpha if flag else 1.0 for flag in covered(quality, tau)]


def weighted_draw(task_ids: Sequence[str], weights: Sequence[float], count: int, seed: int) -> list[str]:
    """`count` distinct tasks drawn with probability proportional to their weights, without
    replacement (Efraimidis-Spirakis keys u^(1/w)); tasks of weight 0 come only after every
    weighted one, in a seeded order, so a batch is always full."""
    if count > len(task_ids):
        raise ValueError(f"cannot draw {count} distinct tasks from {len(task_ids)}")
    rng = random.Random(seed)
    keys = []
    for index, weight in enumerate(weights):
        u = rng.random()
        key = math.log(u) / weight if weight > 0 else -math.inf
        keys.append((key, rng.random(), index))  # the second number orders the weight-0 tasks
    keys.sort(reverse=True)
    return [task_ids[index] for _, _, index in keys[:count]]
