"""Measuring a model on a task set through the policy and the sandbox: pass@1 and pass@k by
turn and the speedup of correct answers. Shared by the trainer (held-out evaluation, RGRPO's
quality matrix q[k][x]) and the distiller (the student's pass@1).

Turn t counts a sample as solved when any of its turns up to t passed: a sample that stopped
early (solved, or out of context) keeps its last result, so every turn is measured over the
same samples. Each unsolved sample gets a debugging turn with the verdict's feedback, up to
`turns` in all, whatever a DCP gate would say: evaluation measures the model, not the gate.

    report = await evaluate(policy, sandbox, tokenizer, model="policy", tasks=tasks,
                            toolchain=CPU, samples=4, turns=3, sampling=sampling, seed=0)
    report.metrics()      # {"pass_at_1/turn_1": 0.25, "pass_at_k/turn_3": 0.5, ...}
    report.pass_rates()   # {"relu": 0.75, ...}: per task, turn 1
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from leap.common.v1 import common_pb2
from leap.rollouts import Endpoints, Episode, Outcome, Rollouts, derive_seed
from leap.sandbox.v1 import sandbox_pb2


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


def pass_at_k_by_turn(groups: Sequence[Sequence[Sequence[Outcome]]], turns: int) -> list[float]:
    """Per turn, the share of groups (tasks) where at least one of their k samples is solved
    by that turn; all zeros when there are no groups."""
    if not groups:
        return [0.0] * turns
    rows = [[any(col) for col in zip(*(correct_by_turn(o, turns) for o in group))] if group else [False] * turns
            for group in groups]
    return [sum(row[t] for row in rows) / len(rows) for t in range(turns)]


def mean_speedup_of_correct(trajectories: Sequence[Sequence[Outcome]]) -> float:
    """Mean speedup over every correct, timed answer of every turn whose timing the sandbox
    did not flag; 0 when there is none."""
    speedups = [o.credited_speedup for outcomes in trajectories for o in outcomes if o.credited_speedup > 0]
    return sum(speedups) / len(speedups) if speedups else 0.0


def by_turn(name: str, values: Sequence[float]) -> dict[str, float]:
    """{"name/turn_1": v1, ...}: the metric names every learner logs."""
    return {f"{name}/turn_{t + 1}": v for t, v in enumerate(values)}


@dataclasses.dataclass
class EvalReport:
    """Outcomes of `samples` samples of each task, turn by turn."""

    task_ids: list[str]
    outcomes: dict[str, list[list[Outcome]]]  # task -> sample -> turn
    turns: int
    evaluations: int = 0  # sandbox evaluations spent

    def pass_rates(self, turn: int = 1) -> dict[str, float]:
        """Per task, the share of its samples solved by `turn`."""
        return {task: pass_at_1_by_turn(self.outcomes[task], turn)[-1] for task in self.task_ids}

    def metrics(self) -> dict[str, float]:
        samples = [o for task in self.task_ids for o in self.outcomes[task]]
        values = by_turn("pass_at_1", pass_at_1_by_turn(samples, self.turns))
        values |= by_turn("pass_at_k", pass_at_k_by_turn([self.outcomes[t] for t in self.task_ids], self.turns))
        values["speedup/mean_correct"] = mean_speedup_of_correct(samples)
        values["samples"] = float(len(samples))
        values["sandbox/evaluations"] = float(self.evaluations)
        return values


async def play(rollouts: Rollouts, task: sandbox_pb2.Task, samples: int, turns: int, seed: int) -> list[Episode]:
    """`samples` episodes of one task, each unsolved one debugged up to `turns` turns in all."""
    episodes = await rollouts.first_turns(task, samples, derive_seed(seed, task.id, 1))
    for turn in range(2, turns + 1):
        unsolved = [e for e in episodes if not e.solved and not e.out_of_context]
        if not unsolved:
            break
        await rollouts.next_turns(unsolved, derive_seed(seed, task.id, turn))
    return episodes


async def evaluate(policy, sandbox, tokenizer, *, model: str, tasks: Sequence[sandbox_pb2.Task], toolchain: int,
                   samples: int, turns: int = 1, sampling: common_pb2.RolloutSampling, seed: int,
                   options: sandbox_pb2.EvaluateOptions | None = None, max_context_tokens: int = 0,
                   rollouts: Rollouts | None = None) -> EvalReport:
    """Sample and judge every task (concurrently; see the module docstring). `policy` and
    `sandbox` are aio stubs of `leap.clients.connect`, or pass a configured `rollouts`."""
    rollouts = rollouts or Rollouts(Endpoints(policy, sandbox), tokenizer, model=model, toolchain=toolchain,
                                    sampling=sampling, options=options, max_context_tokens=max_context_tokens)
    before = rollouts.evaluations
    played = await asyncio.gather(*(play(rollouts, task, samples, turns, seed) for task in tasks))
    outcomes = {task.id: [e.outcomes() for e in episodes] for task, episodes in zip(tasks, played)}
    return EvalReport([t.id for t in tasks], outcomes, turns, rollouts.evaluations - before)
