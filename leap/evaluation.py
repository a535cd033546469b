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
    report.summary()      # by turn: pass@1 and its standard error, pass@k, fast_p; geomean speedup
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

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


FAST_P = (0.0, 1.0, 1.5, 2.0)  # the thresholds KernelBench reports fast_p at


def best_speedup_by_turn(outcomes: Sequence[Outcome], turns: int) -> list[float]:
    """Per turn 1..turns: the best credited speedup of the sample's correct answers up to that
    turn (0 while none is correct and timed without a flag); carried forward like
    correct_by_turn."""
    best, result = 0.0, []
    for t in range(turns):
        if t < len(outcomes):
            best = max(best, outcomes[t].credited_speedup)
        result.append(best)
    return result


def fast_p_by_turn(trajectories: Sequence[Sequence[Outcome]], p: float, turns: int) -> list[float]:
    """KernelBench's fast_p per turn: the share of samples that are correct by that turn with
    a speedup above `p`, fast_0 being the share correct. A speedup the sandbox flagged
    (SUSPICIOUS_SPEEDUP, TIMING_UNRELIABLE) counts as correct but never as fast. All zeros
    when there are no samples."""
    if not trajectories:
        return [0.0] * turns
    if p <= 0:
        return pass_at_1_by_turn(trajectories, turns)
    rows = [best_speedup_by_turn(outcomes, turns) for outcomes in trajectories]
    return [sum(row[t] > p for row in rows) / len(rows) for t in range(turns)]


def geomean_speedup_of_correct(trajectories: Sequence[Sequence[Outcome]]) -> float:
    """The geometric mean, over samples with a correct, credited answer, of each one's best
    speedup over all its turns (KernelBench's figure of speed); 0 when there is none."""
    best = [max(o.credited_speedup for o in outcomes) for outcomes in trajectories if outcomes]
    best = [b for b in best if b > 0]
    return math.exp(sum(math.log(b) for b in best) / len(best)) if best else 0.0


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of `values` (sample standard deviation over sqrt(n));
    0 with fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def standard_errors_by_turn(per_task: Sequence[Sequence[float]], turns: int) -> list[float]:
    """pass@1's standard error over tasks by each turn, from each task's pass@1 by turn."""
    return [standard_error([rates[t] for rates in per_task]) for t in range(turns)]


def paired_change(before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]],
                  turn: int) -> tuple[float, float]:
    """The change of pass@1 by `turn` (1-based) between two evaluations of the same tasks (per
    task, pass@1 by turn) and its standard error over tasks: the mean of the per-task
    differences d_x = after_x - before_x, and standard_error(d). Pairing removes what the
    tasks share between the two (how hard each is), so this error is the one to compare a gain
    against. ValueError when the two do not measure the same tasks."""
    if set(before) != set(after):
        raise ValueError("the two evaluations measure different tasks")
    differences = [after[task][turn - 1] - before[task][turn - 1] for task in sorted(before)]
    return (sum(differences) / len(differences) if differences else 0.0), standard_error(differences)


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
    timed: bool = True  # whether the sandbox timed correct answers (EvaluateOptions.timing)

    def pass_rates(self, turn: int = 1) -> dict[str, float]:
        """Per task, the share of its samples solved by `turn`."""
        return {task: pass_at_1_by_turn(self.outcomes[task], turn)[-1] for task in self.task_ids}

    def pass_rates_by_turn(self) -> dict[str, list[float]]:
        """Per task, the share of its samples solved by each turn."""
        return {task: pass_at_1_by_turn(self.outcomes[task], self.turns) for task in self.task_ids}

    def summary(self) -> dict:
        """What papers report, by turn: pass@1 with its standard error over tasks (the samples
        of one task are not independent, the tasks are), pass@k, fast_p for p in FAST_P, and
        the geometric-mean speedup of correct answers (untimed: fast_0 alone, the share correct,
        and no speedup)."""
        samples = [o for task in self.task_ids for o in self.outcomes[task]]
        per_task = list(self.pass_rates_by_turn().values())
        pass_k = pass_at_k_by_turn([self.outcomes[t] for t in self.task_ids], self.turns)
        pass_1 = pass_at_1_by_turn(samples, self.turns)
        return {
            "tasks": len(self.task_ids),
            "samples": len(samples),
            "turns": self.turns,
            "sandbox_evaluations": self.evaluations,
            "pass_at_1": pass_1,
            "pass_at_1_se": standard_errors_by_turn(per_task, self.turns),
            "pass_at_k": pass_k,
            "timed": self.timed,
            "fast_p": {f"{p:g}": fast_p_by_turn(samples, p, self.turns) for p in FAST_P if self.timed or p == 0},
            "geomean_speedup_of_correct": geomean_speedup_of_correct(samples) if self.timed else None,
            "per_task_pass_at_1": {task: rates[-1] for task, rates in zip(self.task_ids, per_task)},
        }

    def metrics(self) -> dict[str, float]:
        samples = [o for task in self.task_ids for o in self.outcomes[task]]
        values = by_turn("pass_at_1", pass_at_1_by_turn(samples, self.turns))
        values |= by_turn("pass_at_1_se", standard_errors_by_turn(list(self.pass_rates_by_turn().values()), self.turns))
        values |= by_turn("pass_at_k", pass_at_k_by_turn([self.outcomes[t] for t in self.task_ids], self.turns))
        if self.timed:
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
                   rollouts: Rollouts | None = None,
                   on_task_done: Callable[[sandbox_pb2.Task], None] | None = None) -> EvalReport:
    """Sample and judge every task (concurrently; see the module docstring). `policy` and
    `sandbox` are aio stubs of `leap.clients.connect`, or pass a configured `rollouts`;
    `on_task_done(task)` is called as each task's samples are all judged (a progress bar)."""
    rollouts = rollouts or Rollouts(Endpoints(policy, sandbox), tokenizer, model=model, toolchain=toolchain,
                                    sampling=sampling, options=options, max_context_tokens=max_context_tokens)
    before = rollouts.evaluations

    async def one(task: sandbox_pb2.Task) -> list[Episode]:
        episodes = await play(rollouts, task, samples, turns, seed)
        if on_task_done is not None:
            on_task_done(task)
        return episodes

    played = await asyncio.gather(*(one(task) for task in tasks))
    outcomes = {task.id: [e.outcomes() for e in episodes] for task, episodes in zip(tasks, played)}
    timed = not rollouts.options.HasField("timing") or rollouts.options.timing
    return EvalReport([t.id for t in tasks], outcomes, turns, rollouts.evaluations - before, timed)
