"""Pure helpers of the LEAP step: the next turn's dialogue and a step's rollout metrics.

A trajectory is one rollout's dialogue across turns; `outcomes` holds one Outcome per turn it
reached (a group DCP did not expand stops after turn 1). These helpers hold no I/O so the
job (job.py, not built yet) stays a thin driver over gRPC.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from leap import prompts


@dataclasses.dataclass(frozen=True)
class Outcome:
    correct: bool
    speedup: float = 0.0  # reference time / candidate time; meaningful only when correct


def next_turn(history: Sequence[prompts.ChatMessage], response: str, feedback_text: str) -> list[prompts.ChatMessage]:
    """The dialogue the next turn is generated from: what was asked, the model's answer, the verdict's feedback."""
    return [*history, prompts.assistant(response), prompts.user(feedback_text)]


def correct_by_turn(outcomes: Sequence[Outcome], turns: int) -> list[bool]:
    """Per turn 1..turns: solved at or before that turn. A trajectory that stopped early keeps its last result,
    so pass@1 at turn t compares the same set of trajectories at every t."""
    solved, result = False, []
    for t in range(turns):
        if t < len(outcomes):
            solved = solved or outcomes[t].correct
        result.append(solved)
    return result


def pass_at_1_by_turn(trajectories: Sequence[Sequence[Outcome]], turns: int) -> list[float]:
    """Mean over trajectories of correct_by_turn; all zeros when there are none."""
    if not trajectories:
        return [0.0] * turns
    rows = [correct_by_turn(outcomes, turns) for outcomes in trajectories]
    return [sum(row[t] for row in rows) / len(rows) for t in range(turns)]


def mean_speedup_of_correct(trajectories: Sequence[Sequence[Outcome]]) -> float:
    """Mean speedup over every correct answer of every turn; 0 when none is correct."""
    speedups = [o.speedup for outcomes in trajectories for o in outcomes if o.correct]
    return sum(speedups) / len(speedups) if speedups else 0.0


def expanded_share(expanded: Sequence[bool]) -> float:
    """Share of groups DCP sent to a further turn."""
    return sum(expanded) / len(expanded) if expanded else 0.0


def step_metrics(trajectories: Sequence[Sequence[Outcome]], expanded: Sequence[bool], turns: int) -> dict[str, float]:
    """The rollout side of a step's metrics, named as they are logged."""
    values = {f"pass@1/turn{t + 1}": v for t, v in enumerate(pass_at_1_by_turn(trajectories, turns))}
    values["speedup/mean_correct"] = mean_speedup_of_correct(trajectories)
    values["dcp/expanded_share"] = expanded_share(expanded)
    values["sandbox/evaluations"] = float(sum(len(outcomes) for outcomes in trajectories))
    return values
