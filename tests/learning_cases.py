"""Shared cases of the learner tests: one batch of GRPO sequences and the steps taken on it,
used in-process and by the two-process run (learner_ranks.py), which must agree."""

from __future__ import annotations

import random

from leap.learning import OptimizerSettings, Sequence, with_values
from svc_trainer.losses import GrpoLossConfig, GrpoObjective

SETTINGS_KW = dict(optimizer=OptimizerSettings(learning_rate=3e-3, micro_batch_tokens=96, max_grad_norm=1.0),
                   total_updates=4, seed=3)


def grpo_batch(count: int = 7, seed: int = 0, vocab: int = 384) -> list[Sequence]:
    """Sequences of varied length with a prompt part (masked) and a completion part."""
    rng = random.Random(seed)
    sequences = []
    for i in range(count):
        length, prompt = rng.randint(12, 40), rng.randint(3, 9)
        ids = [rng.randint(7, vocab - 1) for _ in range(length)]
        sequences.append(Sequence(ids, [0] * prompt + [1] * (length - prompt), {"advantages": [1.0, -1.0, 0.5][i % 3]}))
    return sequences


def run_steps(learner, sequences, steps: int = 2) -> list[dict]:
    """Recompute old logprobs, then `steps` steps of two epochs each; the stats of each."""
    objective = GrpoObjective(GrpoLossConfig())
    results = []
    for _ in range(steps):
        old = learner.logprobs(sequences)
        results.append(learner.train_step(with_values(sequences, old_logprobs=old), objective, epochs=2))
    return results


def step_batch(step: int) -> list[Sequence]:
    """A different, deterministic batch for every step (the data cursor is the step)."""
    return grpo_batch(count=5, seed=1000 + step)


def train_from(learner, root, start: int, steps: int, announce=None) -> None:
    """Steps start+1 .. steps over `step_batch`, with a checkpoint after each (the cursor is
    the next step), as a run does."""
    objective = GrpoObjective(GrpoLossConfig())
    for step in range(start + 1, steps + 1):
        sequences = step_batch(step)
        old = learner.logprobs(sequences)
        learner.train_step(with_values(sequences, old_logprobs=old), objective)
        learner.save_checkpoint(root, step, cursor={"next_step": step + 1}, keep_last=2)
        if announce:
            announce(step)
