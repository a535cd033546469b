"""The order in which a learner draws its training tasks, shared by the trainer and the
distiller: seeded epoch by epoch and addressed by one integer cursor, so a checkpoint that
stores the cursor resumes exactly the batches an uninterrupted run would have drawn."""

from __future__ import annotations

import random
from collections.abc import Sequence


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The task order of one pass over the tasks: a permutation fixed by (seed, epoch)."""
    order = list(range(count))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def draw_tasks(task_ids: Sequence[str], batch: int, cursor: int, seed: int) -> tuple[list[str], int]:
    """The next `batch` tasks from position `cursor` of the seeded epoch-by-epoch order, and the new cursor."""
    count = len(task_ids)
    first_epoch, last_epoch = cursor // count, (cursor + batch - 1) // count
    # each epoch's permutation once, not once per drawn task
    order = [i for epoch in range(first_epoch, last_epoch + 1) for i in epoch_order(count, seed, epoch)]
    start = cursor - first_epoch * count
    return [task_ids[i] for i in order[start:start + batch]], cursor + batch
