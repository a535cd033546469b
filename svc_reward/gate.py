"""Difficulty-Conditioned Pruning: which groups of first-turn rollouts earn debugging turns.

Pure: `gate` takes the groups, the parameters and the task history as it stands, and returns
the decisions plus the history as it would be after recording the groups (the caller keeps
it, or drops it for a dry run). Groups are recorded in request order, so two groups of one
task in one call see each other.

With G rollouts of a group and f failing (stage below PASSED):
- static mode, in this order:
  1. `f / G <= simple_threshold`: SIMPLE (rule "simple");
  2. `f == G` and the best stage reached `<= catastrophic_stage`: CATASTROPHIC
     ("catastrophic:stage");
  3. the task's history, this group included, has `>= never_solved_after` attempts and no
     solve: CATASTROPHIC ("catastrophic:history"). Counting this group means a group with a
     pass is never pruned by it, so this rule too needs `f == G`;
  4. otherwise EXPAND ("expand").
- adaptive mode: the catastrophic rules prune as above; a group with no failure is SIMPLE;
  every other group is eligible — the simple threshold does not apply, the ranking takes
  its place — and the eligible groups, ranked by expected value (ties: request order), are
  expanded while the budget lasts: at most `floor(expand_budget * groups in the call)` of
  them ("expand:budget"); the rest are OVER_BUDGET ("over_budget"). The budget is per call:
  gate a step's groups together.
- expand-all mode (unpruned multi-turn, for ablation): every group with a failure is
  expanded ("expand:all"), the others are SIMPLE.

Expected value of expanding, in [0, 1]: `1 - |2 p - 1|`, the closeness to 1/2 of the task's
pass rate `p`, estimated as the history's moving average after this group (the group's own
rate for a new task; with history, the group weighs `history_decay` and the past the rest).
A task near 1/2 is where debugging turns most often turn a failure into a pass that the
group's ranking can learn from; near 0 or 1 they buy little.

An expanded group gives debugging turns to its failing rollouts and, when
`improve_below_speedup` is above 0, to its passing rollouts timed below that speedup (a
passing rollout with no speedup is left alone). It never changes a decision.

Evaluations saved: against expand-all with the same parameters, each group not expanded
that has a failure saves `(max_turns - 1)` sandbox evaluations for each rollout expand-all
would have given turns to. An upper bound: a rollout that passes at turn 2 stops there.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from svc_reward.history import TaskRecord, record
from svc_reward.stages import STAGES, Stage


class Mode(enum.Enum):
    """How decisions are made."""

    STATIC = "static"
    ADAPTIVE = "adaptive"
    EXPAND_ALL = "expand_all"


class Decision(enum.Enum):
    """What happens to a group."""

    SIMPLE = "simple"
    CATASTROPHIC = "catastrophic"
    EXPAND = "expand"
    OVER_BUDGET = "over_budget"


class Rule:
    """The rule behind a decision: the keys of GetStats' decisions_by_reason."""

    SIMPLE = "simple"
    CATASTROPHIC_STAGE = "catastrophic:stage"
    CATASTROPHIC_HISTORY = "catastrophic:history"
    EXPAND = "expand"
    EXPAND_BUDGET = "expand:budget"
    EXPAND_ALL = "expand:all"
    OVER_BUDGET = "over_budget"


class Rollout(NamedTuple):
    """The first-turn result of one rollout (speedup None or 0: not timed)."""

    stage: Stage
    speedup: float | None = None


@dataclasses.dataclass(frozen=True)
class GateParams:
    """Everything that shapes the decisions; every field has DESIGN.md's default."""

    mode: Mode = Mode.STATIC
    simple_threshold: float = 0.5
    catastrophic_stage: Stage = Stage.COMPILE
    never_solved_after: int = 32  # attempts; 0 or less turns the history rule off
    max_turns: int = 3
    expand_budget: float = 0.5
    history_decay: float = 0.3
    improve_below_speedup: float = 0.0

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for every value out of range."""
        found = []
        if not (math.isfinite(self.simple_threshold) and 0 <= self.simple_threshold <= 1):
            found.append(("simple_threshold", f"must be in [0, 1], got {self.simple_threshold!r}"))
        if not Stage.FORMAT <= self.catastrophic_stage <= Stage.CORRECT:
            label = Stage(self.catastrophic_stage).label
            found.append(("catastrophic_stage", f"must be a failing stage (format to correct), got {label}"))
        if self.max_turns < 1:
            found.append(("max_turns", f"must be at least 1, got {self.max_turns}"))
        if not (math.isfinite(self.expand_budget) and 0 <= self.expand_budget <= 1):
            found.append(("expand_budget", f"must be in [0, 1], got {self.expand_budget!r}"))
        if not (math.isfinite(self.history_decay) and 0 < self.history_decay <= 1):
            found.append(("history_decay", f"must be in (0, 1], got {self.history_decay!r}"))
        if not (math.isfinite(self.improve_below_speedup) and self.improve_below_speedup >= 0):
            found.append(("improve_below_speedup", f"must be a finite number >= 0, got {self.improve_below_speedup!r}"))
        return found


@dataclasses.dataclass
class GroupDecision:
    """The decision for one group, with the numbers behind it."""

    task_id: str
    decision: Decision
    rule: str
    reason: str
    failures: int
    group_size: int
    stage_histogram: dict[Stage, int]  # every stage, in order, zeros included
    expand_rollouts: list[int]
    max_turns: int
    expected_value: float
    history: TaskRecord


@dataclasses.dataclass
class GateTotals:
    """Totals of one call, or of many (`add`)."""

    groups: int = 0
    simple: int = 0
    catastrophic: int = 0
    expanded: int = 0
    over_budget: int = 0
    evaluations_saved: int = 0

    @property
    def expanded_share(self) -> float:
        return self.expanded / self.groups if self.groups else 0.0

    def add(self, other: GateTotals) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


@dataclasses.dataclass
class GateResult:
    decisions: list[GroupDecision]
    totals: GateTotals
    history: dict[str, TaskRecord]  # the records of every task gated, after the call


@dataclasses.dataclass
class _Group:
    """Working state of one group while the call is decided."""

    index: int
    task_id: str
    rollouts: Sequence[Rollout]
    failures: int
    best_stage: Stage
    candidates: list[int]  # rollouts that get debugging turns when the group is expanded
    record: TaskRecord
    expected_value: float


def expected_value(pass_rate: float) -> float:
    """Closeness of a pass rate to 1/2, in [0, 1]."""
    return max(0.0, 1.0 - abs(2.0 * pass_rate - 1.0))


def gate(groups: Sequence[tuple[str, Sequence[Rollout]]], params: GateParams,
         history: Mapping[str, TaskRecord], now: float) -> GateResult:
    """Decide every group (each: task id and at least one rollout)."""
    updated: dict[str, TaskRecord] = {}
    prepared = []
    for index, (task_id, rollouts) in enumerate(groups):
        prior = updated.get(task_id) or history.get(task_id)
        prepared.append(_prepare(index, task_id, rollouts, params, prior, now))
        updated[task_id] = prepared[-1].record
    decided: list[GroupDecision | None] = [None] * len(prepared)
    eligible = []
    for group in prepared:
        decision = _static_decision(group, params)
        if decision is None:
            eligible.append(group)
        else:
            decided[group.index] = decision
    for group, decision in _adaptive_decisions(eligible, len(prepared), params):
        decided[group.index] = decision
    decisions = [decision for decision in decided if decision is not None]
    return GateResult(decisions, _totals(decisions, prepared, params), updated)


def _prepare(index: int, task_id: str, rollouts: Sequence[Rollout], params: GateParams,
             prior: TaskRecord | None, now: float) -> _Group:
    failing = [i for i, rollout in enumerate(rollouts) if rollout.stage < Stage.PASSED]
    slow = [i for i, rollout in enumerate(rollouts)
            if rollout.stage == Stage.PASSED and rollout.speedup and rollout.speedup < params.improve_below_speedup]
    updated = record(prior, task_id, len(rollouts) - len(failing), len(rollouts), params.history_decay, now)
    return _Group(index, task_id, rollouts, len(failing), max(rollout.stage for rollout in rollouts),
                  sorted(failing + slow), updated, expected_value(updated.ema_pass_rate))


def _static_decision(group: _Group, params: GateParams) -> GroupDecision | None:
    """The decision the fixed rules make, or None for a group the adaptive ranking decides."""
    f, size = group.failures, len(group.rollouts)
    share = f / size
    if params.mode is Mode.EXPAND_ALL:
        if f == 0:
            return _decide(group, params, Decision.SIMPLE, Rule.SIMPLE, f"0/{size} failed: nothing to debug")
        return _decide(group, params, Decision.EXPAND, Rule.EXPAND_ALL,
                       f"{f}/{size} failed: expand-all mode expands every group with a failure")
    if params.mode is Mode.STATIC and share <= params.simple_threshold:
        return _decide(group, params, Decision.SIMPLE, Rule.SIMPLE,
                       f"{f}/{size} failed ({share:.2f} <= {params.simple_threshold:.2f}): simple")
    if params.mode is Mode.ADAPTIVE and f == 0:
        return _decide(group, params, Decision.SIMPLE, Rule.SIMPLE, f"0/{size} failed: simple")
    if f == size and group.best_stage <= params.catastrophic_stage:
        return _decide(group, params, Decision.CATASTROPHIC, Rule.CATASTROPHIC_STAGE,
                       f"{f}/{size} failed, best stage {group.best_stage.label} <= "
                       f"{params.catastrophic_stage.label}: catastrophic")
    history = group.record
    if 0 < params.never_solved_after <= history.attempts and history.solves == 0:
        return _decide(group, params, Decision.CATASTROPHIC, Rule.CATASTROPHIC_HISTORY,
                       f"{f}/{size} failed and the task has no solve in {history.attempts} attempts "
                       f"(>= {params.never_solved_after}): catastrophic")
    if params.mode is Mode.STATIC:
        return _decide(group, params, Decision.EXPAND, Rule.EXPAND,
                       f"{f}/{size} failed ({share:.2f} > {params.simple_threshold:.2f}): "
                       f"expand {len(group.candidates)} rollouts to {params.max_turns} turns")
    return None


def _adaptive_decisions(eligible: list[_Group], total: int, params: GateParams):
    budget = math.floor(params.expand_budget * total + 1e-9)
    ranked = sorted(eligible, key=lambda group: -group.expected_value)  # stable: ties keep request order
    for place, group in enumerate(ranked, start=1):
        standing = (f"{group.failures}/{len(group.rollouts)} failed, expected value {group.expected_value:.2f} "
                    f"ranks {place} of {len(ranked)} eligible; budget {budget} of {total} groups")
        if place <= budget:
            yield group, _decide(group, params, Decision.EXPAND, Rule.EXPAND_BUDGET,
                                 f"{standing}: expand {len(group.candidates)} rollouts to {params.max_turns} turns")
        else:
            yield group, _decide(group, params, Decision.OVER_BUDGET, Rule.OVER_BUDGET, f"{standing}: over budget")


def _decide(group: _Group, params: GateParams, decision: Decision, rule: str, reason: str) -> GroupDecision:
    histogram = dict.fromkeys(STAGES, 0)
    for rollout in group.rollouts:
        histogram[rollout.stage] += 1
    expanded = decision is Decision.EXPAND
    return GroupDecision(
        task_id=group.task_id, decision=decision, rule=rule, reason=reason, failures=group.failures,
        group_size=len(group.rollouts), stage_histogram=histogram,
        expand_rollouts=list(group.candidates) if expanded else [],
        max_turns=params.max_turns if expanded else 1, expected_value=group.expected_value, history=group.record,
    )


def _totals(decisions: list[GroupDecision], groups: list[_Group], params: GateParams) -> GateTotals:
    totals = GateTotals(groups=len(decisions))
    for decision, group in zip(decisions, groups):
        if decision.decision is Decision.SIMPLE:
            totals.simple += 1
        elif decision.decision is Decision.CATASTROPHIC:
            totals.catastrophic += 1
        elif decision.decision is Decision.EXPAND:
            totals.expanded += 1
        else:
            totals.over_budget += 1
        if decision.decision is not Decision.EXPAND and group.failures:
            totals.evaluations_saved += len(group.candidates) * (params.max_turns - 1)
    return totals
