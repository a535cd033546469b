"""From a step's episodes to what the reward service and the learner take: pure functions.

- `gate_group`: a group's first turns as a Gate request group;
- `rank_group`: a group's whole trajectories as a Rank request group;
- `continues`: which rollouts of an expanded group get another turn;
- `training_sequence`: one episode as a learner `Sequence` whose loss mask keeps only the
  tokens the model sampled (every turn's answer; prompt and feedback masked) and whose
  per-token advantage is the advantage of the turn that sampled the token;
- `learning_batch`: the sequences worth a forward pass, and the loss's normalizer over all;
- `logprob_gap`: how far the sampler's logprobs are from the learner's recomputation;
- `rollout_records`: a step's trajectories as JSON lines for people (and tests) to read,
  each turn with its verdict's flags (a flagged rollout is kept, never dropped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from leap.common.v1 import common_pb2
from leap.evaluation import correct_by_turn
from leap.learning import Normalizer, Sequence as LearnerSequence
from leap.reward.v1 import reward_pb2
from leap.rollouts import Episode, Outcome
from leap.sandbox.v1 import sandbox_pb2

Stage = common_pb2.Stage


def _gated(outcome: Outcome) -> dict:
    """A first turn's result fields for the gate: its stage (FORMAT when it has none) and, only
    when it is correct, timed and not flagged, its speedup (a flagged one reads as untimed)."""
    fields = {"stage": outcome.stage or Stage.STAGE_FORMAT}
    if outcome.credited_speedup > 0:
        fields["speedup"] = outcome.credited_speedup
    return fields


def _ranked(outcome: Outcome) -> dict:
    """A turn's result fields for the tournament: its stage and, when it is correct and timed,
    its speedup with its interval and whether the sandbox flagged it (then the reward service
    gives it no speed credit)."""
    fields = {"stage": outcome.stage or Stage.STAGE_FORMAT}
    if outcome.correct and outcome.speedup > 0:
        fields["speedup"] = outcome.speedup
        if 0 < outcome.speedup_low <= outcome.speedup <= outcome.speedup_high:
            fields["speedup_low"], fields["speedup_high"] = outcome.speedup_low, outcome.speedup_high
        if outcome.flagged:
            fields["speedup_flagged"] = True
    return fields


def gate_group(task_id: str, episodes: Sequence[Episode]) -> reward_pb2.GateGroup:
    return reward_pb2.GateGroup(task_id=task_id,
                                rollouts=[reward_pb2.RolloutResult(**_gated(e.turns[0].outcome)) for e in episodes])


def rank_group(task_id: str, episodes: Sequence[Episode]) -> reward_pb2.RankGroup:
    trajectories = []
    for episode in episodes:
        turns = [reward_pb2.TurnResult(**_ranked(turn.outcome), generated_tokens=len(turn.completion_ids))
                 for turn in episode.turns]
        trajectories.append(reward_pb2.Trajectory(turns=turns))
    return reward_pb2.RankGroup(task_id=task_id, trajectories=trajectories)


def continues(episode: Episode, improve_below_speedup: float) -> bool:
    """An expanded rollout gets another turn while it is unsolved, or, with a speed target,
    while its best correct answer is timed below the target."""
    if not episode.solved:
        return True
    return improve_below_speedup > 0 and 0 < episode.best_speedup < improve_below_speedup


def training_sequence(episode: Episode, turn_advantages: Sequence[float]) -> tuple[LearnerSequence, list[float]]:
    """The learner's sequence of one episode (values: per-token `advantages`) and, aligned with
    its tokens, the sampler's logprobs (0 where the model did not sample)."""
    if len(turn_advantages) != len(episode.turns):
        raise ValueError(f"{len(turn_advantages)} turn advantages for {len(episode.turns)} turns")
    ids, owner = episode.sequence()
    mask = [1 if turn >= 0 else 0 for turn in owner]
    advantages = [float(turn_advantages[turn]) if turn >= 0 else 0.0 for turn in owner]
    sampler = [0.0] * len(ids)
    for turn in episode.turns:
        start = len(turn.prompt_ids)
        sampler[start:start + len(turn.sampler_logprobs)] = turn.sampler_logprobs
    return LearnerSequence(ids, mask, {"advantages": advantages}), sampler


def carries_signal(sequence: LearnerSequence) -> bool:
    """Whether any of the model's tokens has a nonzero advantage (else, without a KL term,
    the sequence adds nothing to the gradient and is not worth a forward pass)."""
    return any(m and a != 0 for m, a in zip(sequence.loss_mask, sequence.values["advantages"]))


def learning_batch(built: Sequence[tuple[LearnerSequence, list[float]]], kl: bool
                   ) -> tuple[list[tuple[LearnerSequence, list[float]]], Normalizer]:
    """The (sequence, sampler logprobs) pairs worth a forward pass, and the normalizer of the
    loss: the counts of *every* rolled-out sequence. Without a KL term a sequence whose
    advantages are all 0 adds nothing to the gradient, so it is left out of the passes, but its
    tokens stay in the token-mean's denominator (and it in seq-mean-token-mean's), as in
    DESIGN.md and TRL's GRPOTrainer: the loss is the mean over all generated tokens, and its
    scale does not change from step to step with the share of tied groups."""
    kept = [(seq, sampler) for seq, sampler in built if kl or carries_signal(seq)]
    return kept, Normalizer.of([seq for seq, _ in built])


def logprob_gap(sequences: Sequence[LearnerSequence], sampler: Sequence[Sequence[float]],
                learner: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean and largest |sampler - learner| logprob over the model's tokens: the two numerics
    should agree; a large gap means the policy serves other weights or another distribution
    (top-p truncation counts here: the learner scores the untruncated softmax)."""
    gaps = [abs(s - l) for seq, srow, lrow in zip(sequences, sampler, learner)
            for m, s, l in zip(seq.loss_mask, srow, lrow) if m]
    if not gaps:
        return {"logprob_gap/mean_abs": 0.0, "logprob_gap/max_abs": 0.0}
    return {"logprob_gap/mean_abs": math.fsum(gaps) / len(gaps), "logprob_gap/max_abs": max(gaps)}


def rollout_records(step: int, groups: Sequence[tuple[str, Sequence[Episode]]], ranked: reward_pb2.RankResponse, *,
                    tokens: bool = False) -> list[dict]:
    """One JSON-able record per trajectory of a step: task, sample, reward and advantages,
    and each turn's answer with its verdict; with `tokens`, also the whole token sequence, the
    turn that sampled each token (-1: prompt or feedback) and the sampler's logprobs."""
    records = []
    for (task_id, episodes), result in zip(groups, ranked.results):
        for episode, trajectory in zip(episodes, result.trajectories):
            record = {
                "step": step, "task_id": task_id, "sample": episode.sample, "reward": trajectory.reward,
                "advantage": trajectory.advantage, "turn_advantages": list(trajectory.turn_advantages),
                "solved_by_turn": correct_by_turn(episode.outcomes(), len(episode.turns)),
                "turns": [{"stage": Stage.Name(t.outcome.stage), "speedup": t.outcome.speedup,
                           "speedup_interval": [t.outcome.speedup_low, t.outcome.speedup_high],
                           "flags": [sandbox_pb2.VerdictFlag.Name(f).removeprefix("VERDICT_FLAG_")
                                     for f in (t.verdict.flags if t.verdict else [])],
                           "tokens": len(t.completion_ids), "weight_version": t.weight_version, "text": t.text,
                           "verdict": (t.verdict.message or t.verdict.runtime_error) if t.verdict else ""}
                          for t in episode.turns],
            }
            if tokens:
                record["token_ids"], record["owner"] = episode.sequence()
                _, record["sampler_logprobs"] = training_sequence(episode, trajectory.turn_advantages)
            records.append(record)
    return records
