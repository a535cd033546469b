"""The rollout side of a LEAP step's metrics, as pure functions (the job logs them)."""

from __future__ import annotations

from collections.abc import Sequence

from leap.evaluation import by_turn, mean_speedup_of_correct, pass_at_1_by_turn
from leap.rollouts import Outcome


def expanded_share(expanded: Sequence[bool]) -> float:
    """Share of groups DCP sent to a further turn."""
    return sum(expanded) / len(expanded) if expanded else 0.0


def rollout_metrics(trajectories: Sequence[Sequence[Outcome]], expanded: Sequence[bool], turns: int,
                    timed: bool = True) -> dict[str, float]:
    """pass@1 by turn over the step's trajectories, the mean speedup of their correct
    answers (flagged ones left out; none when the run's verdicts are not `timed`), the
    expanded share of groups and the flagged verdicts. (The job counts the step's sandbox
    evaluations itself: an empty answer is judged without one.)"""
    values = by_turn("pass_at_1", pass_at_1_by_turn(trajectories, turns))
    if timed:
        values["speedup/mean_correct"] = mean_speedup_of_correct(trajectories)
    values["expanded_share"] = expanded_share(expanded)
    values.update(flagged_counts(trajectories))
    return values


def flagged_counts(trajectories: Sequence[Sequence[Outcome]]) -> dict[str, float]:
    """Verdicts of the step the sandbox flagged, over every turn: passes faster than its
    bound (`sandbox/flagged_suspicious`) and passes whose speedup interval stayed wide
    (`sandbox/flagged_unreliable`); one verdict can be both."""
    outcomes = [o for trajectory in trajectories for o in trajectory]
    return {"sandbox/flagged_suspicious": float(sum(o.suspicious for o in outcomes)),
            "sandbox/flagged_unreliable": float(sum(o.unreliable for o in outcomes))}


def zero_spread_share(rewards_by_group: Sequence[Sequence[float]]) -> float:
    """Share of groups whose rewards all tie (TRL's `frac_reward_zero_std`): such a group's
    advantages are all 0, so it teaches nothing. 1.0 for step after step means the run has no
    learning signal (a model that never passes, or always does, and ties on everything else)."""
    if not rewards_by_group:
        return 0.0
    flat = sum(1 for rewards in rewards_by_group if not rewards or max(rewards) - min(rewards) == 0.0)
    return flat / len(rewards_by_group)
