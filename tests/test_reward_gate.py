"""Difficulty-Conditioned Pruning as pure functions: each rule fires exactly at its
threshold, the adaptive mode keeps within its budget, expand-all expands everything, the
evaluations saved are counted as documented, and the history file is written atomically."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from svc_reward.gate import Decision, GateParams, Mode, Rollout, Rule, expected_value, gate
from svc_reward.history import HistoryFileError, HistoryStore, TaskRecord, record
from svc_reward.stages import Stage

PASS = Rollout(Stage.PASSED, 1.0)


def group(failures: int, size: int, stage: Stage = Stage.RUN) -> list[Rollout]:
    return [Rollout(stage)] * failures + [PASS] * (size - failures)


def decide(rollouts, params: GateParams | None = None, history=None, task_id="t"):
    return gate([(task_id, rollouts)], params or GateParams(), history or {}, now=0.0).decisions[0]


# Static rules, at their thresholds ---------------------------------------------------------


@pytest.mark.parametrize("size", [2, 8, 16])
@pytest.mark.parametrize("threshold_failures", [0, 1, 4])
def test_simple_fires_exactly_up_to_the_threshold(size, threshold_failures):
    threshold = threshold_failures / 8  # 0, 1/8, 1/2
    params = GateParams(simple_threshold=threshold)
    for failures in range(size):  # all-failing groups are left to the catastrophic tests
        d = decide(group(failures, size), params)
        if failures / size <= threshold:
            assert (d.decision, d.rule) == (Decision.SIMPLE, Rule.SIMPLE), (failures, size)
        else:
            assert (d.decision, d.rule) == (Decision.EXPAND, Rule.EXPAND), (failures, size)
            assert d.expand_rollouts == list(range(failures)) and d.max_turns == 3


def test_the_default_expands_only_groups_with_more_than_half_failing():
    assert decide(group(4, 8)).decision is Decision.SIMPLE
    d = decide(group(5, 8))
    assert d.decision is Decision.EXPAND
    assert d.reason == "5/8 failed (0.62 > 0.50): expand 5 rollouts to 3 turns"


@pytest.mark.parametrize("limit", [Stage.FORMAT, Stage.COMPILE, Stage.RUN, Stage.CORRECT])
def test_catastrophic_fires_exactly_at_the_stage(limit):
    params = GateParams(catastrophic_stage=limit)
    at = decide([Rollout(Stage.FORMAT)] * 7 + [Rollout(limit)], params)
    assert (at.decision, at.rule) == (Decision.CATASTROPHIC, Rule.CATASTROPHIC_STAGE)
    assert at.max_turns == 1 and at.expand_rollouts == []
    if limit < Stage.CORRECT:
        above = decide([Rollout(Stage.FORMAT)] * 7 + [Rollout(Stage(limit + 1))], params)
        assert (above.decision, above.rule) == (Decision.EXPAND, Rule.EXPAND)
    # One pass anywhere and the group is not catastrophic.
    assert decide([Rollout(Stage.FORMAT)] * 7 + [PASS], params).decision is Decision.EXPAND


def test_stage_histogram_and_numbers_behind_the_decision():
    d = decide([Rollout(Stage.COMPILE)] * 3 + [Rollout(Stage.FORMAT)] * 5)
    assert d.stage_histogram == {Stage.FORMAT: 5, Stage.COMPILE: 3, Stage.RUN: 0, Stage.CORRECT: 0, Stage.PASSED: 0}
    assert (d.failures, d.group_size) == (8, 8)
    assert d.reason == "8/8 failed, best stage compile <= compile: catastrophic"


@pytest.mark.parametrize("limit", [23, 24, 25])
def test_never_solved_fires_exactly_at_the_attempt_count(limit):
    params = GateParams(never_solved_after=limit)
    history: dict[str, TaskRecord] = {}
    decisions = []
    for step in range(4):  # 8 attempts per group: 8, 16, 24, 32 after each
        result = gate([("t", group(8, 8, Stage.RUN))], params, history, now=float(step))
        history.update(result.history)
        decisions.append(result.decisions[0])
    for d in decisions:
        fires = d.history.attempts >= limit
        expected = (Decision.CATASTROPHIC, Rule.CATASTROPHIC_HISTORY) if fires else (Decision.EXPAND, Rule.EXPAND)
        assert (d.decision, d.rule) == expected, d.history.attempts


def test_never_solved_counts_this_group_so_a_pass_is_never_pruned():
    history = {"t": TaskRecord("t", 0.0, 100, 0, 10, 0.0)}
    assert decide(group(8, 8), GateParams(), history).rule == Rule.CATASTROPHIC_HISTORY
    assert decide(group(7, 8), GateParams(), history).decision is Decision.EXPAND
    # Once solved, never pruned by history again; 0 turns the rule off.
    solved_once = {"t": TaskRecord("t", 0.01, 100, 1, 10, 0.0)}
    assert decide(group(8, 8), GateParams(), solved_once).decision is Decision.EXPAND
    assert decide(group(8, 8), GateParams(never_solved_after=0), history).decision is Decision.EXPAND


def test_groups_of_one_task_in_one_call_see_each_other():
    result = gate([("t", group(8, 8))] * 3, GateParams(never_solved_after=24), {}, now=0.0)
    assert [d.rule for d in result.decisions] == [Rule.EXPAND, Rule.EXPAND, Rule.CATASTROPHIC_HISTORY]
    assert result.history["t"].groups == 3 and result.history["t"].attempts == 24


def test_improve_below_speedup_adds_slow_passers_without_changing_decisions():
    rollouts = [Rollout(Stage.RUN)] * 5 + [Rollout(Stage.PASSED, 0.5), Rollout(Stage.PASSED, 2.0),
                                           Rollout(Stage.PASSED, None)]
    params = GateParams(improve_below_speedup=1.0)
    assert decide(rollouts, params).expand_rollouts == [0, 1, 2, 3, 4, 5]  # not the fast or untimed ones
    assert decide(group(4, 8), params).decision is Decision.SIMPLE


# Adaptive and expand-all --------------------------------------------------------------------

rollout_stages = st.sampled_from(list(Stage))
gate_groups = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d", "e", "f"]),
              st.lists(st.builds(Rollout, rollout_stages, st.just(None)), min_size=2, max_size=16)),
    min_size=1, max_size=24)


@settings(max_examples=150, deadline=None)
@given(gate_groups, st.floats(0.0, 1.0))
def test_adaptive_mode_respects_its_budget_and_expands_the_best(groups, budget):
    params = GateParams(mode=Mode.ADAPTIVE, expand_budget=budget)
    result = gate(groups, params, {}, now=0.0)
    decisions = result.decisions
    expanded = [d for d in decisions if d.decision is Decision.EXPAND]
    over = [d for d in decisions if d.decision is Decision.OVER_BUDGET]
    allowed = math.floor(budget * len(groups) + 1e-9)
    assert len(expanded) <= allowed
    assert result.totals.expanded_share <= budget + 1e-12
    assert len(expanded) == min(allowed, len(expanded) + len(over))  # the budget is spent when it can be
    if expanded and over:
        assert min(d.expected_value for d in expanded) >= max(d.expected_value for d in over)
    for d in decisions:
        if d.decision in (Decision.EXPAND, Decision.OVER_BUDGET):
            assert d.failures > 0 and d.rule in (Rule.EXPAND_BUDGET, Rule.OVER_BUDGET)
        elif d.decision is Decision.SIMPLE:
            assert d.failures == 0


def test_adaptive_mode_prefers_pass_rates_near_one_half_and_still_prunes():
    groups = [("near_one", group(1, 8)), ("half", group(4, 8)), ("hopeless", group(8, 8, Stage.COMPILE)),
              ("hard", group(7, 8)), ("solved", group(0, 8))]
    result = gate(groups, GateParams(mode=Mode.ADAPTIVE, expand_budget=0.4), {}, now=0.0)
    by_task = {d.task_id: d for d in result.decisions}
    assert by_task["half"].decision is Decision.EXPAND and by_task["half"].expected_value == 1.0
    assert {by_task["near_one"].decision, by_task["hard"].decision} == {Decision.EXPAND, Decision.OVER_BUDGET}
    assert by_task["hopeless"].rule == Rule.CATASTROPHIC_STAGE
    assert by_task["solved"].decision is Decision.SIMPLE
    assert result.totals.expanded == 2  # floor(0.4 * 5)


def test_expected_value_is_weighted_by_history():
    fresh = decide(group(4, 8), GateParams(mode=Mode.ADAPTIVE, expand_budget=1.0))
    assert fresh.expected_value == 1.0
    # A task that has mostly passed before: the estimate moves toward its history.
    seasoned = decide(group(4, 8), GateParams(mode=Mode.ADAPTIVE, history_decay=0.3),
                      {"t": TaskRecord("t", 0.9, 80, 72, 10, 0.0)})
    estimate = 0.7 * 0.9 + 0.3 * 0.5
    assert seasoned.history.ema_pass_rate == pytest.approx(estimate)
    assert seasoned.expected_value == pytest.approx(expected_value(estimate))
    assert expected_value(0.0) == expected_value(1.0) == 0.0


def test_expand_all_expands_every_group_with_a_failure_and_saves_nothing():
    groups = [("a", group(8, 8, Stage.FORMAT)), ("b", group(1, 8)), ("c", group(0, 8))]
    result = gate(groups, GateParams(mode=Mode.EXPAND_ALL), {"a": TaskRecord("a", 0.0, 999, 0, 99, 0.0)}, now=0.0)
    assert [d.decision for d in result.decisions] == [Decision.EXPAND, Decision.EXPAND, Decision.SIMPLE]
    assert result.decisions[0].rule == Rule.EXPAND_ALL
    assert result.totals.evaluations_saved == 0


def test_evaluations_saved_against_expand_all():
    groups = [("simple", group(3, 8)), ("expand", group(6, 8)), ("pruned", group(8, 8, Stage.COMPILE)),
              ("solved", group(0, 8))]
    result = gate(groups, GateParams(max_turns=4), {}, now=0.0)
    # simple: 3 failing rollouts x 3 more turns; pruned: 8 x 3; expanded and solved: nothing.
    assert result.totals.evaluations_saved == 3 * 3 + 8 * 3
    assert (result.totals.simple, result.totals.expanded, result.totals.catastrophic) == (2, 1, 1)
    assert result.totals.expanded_share == 0.25


def test_params_out_of_range_are_named():
    bad = GateParams(simple_threshold=1.5, catastrophic_stage=Stage.PASSED, max_turns=0, expand_budget=-0.1,
                     history_decay=0.0, improve_below_speedup=math.inf)
    assert [name for name, _ in bad.problems()] == ["simple_threshold", "catastrophic_stage", "max_turns",
                                                    "expand_budget", "history_decay", "improve_below_speedup"]
    assert GateParams().problems() == []


# History -------------------------------------------------------------------------------------


def test_history_is_an_exponential_moving_average_with_counts():
    first = record(None, "t", passes=2, size=8, decay=0.3, now=1.0)
    assert (first.ema_pass_rate, first.attempts, first.solves, first.groups) == (0.25, 8, 2, 1)
    second = record(first, "t", passes=8, size=8, decay=0.3, now=2.0)
    assert second.ema_pass_rate == pytest.approx(0.7 * 0.25 + 0.3 * 1.0)
    assert (second.attempts, second.solves, second.groups, second.update_time) == (16, 10, 2, 2.0)


def test_an_unreadable_history_database_is_a_clear_error(tmp_path):
    path = tmp_path / "history.sqlite3"
    path.write_bytes(b"this is not an SQLite database" * 100)
    with pytest.raises(HistoryFileError, match="cannot read the task history"):
        HistoryStore(path)
