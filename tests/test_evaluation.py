"""Pure metric helpers of evaluation and of the LEAP step, against hand-computed values."""

import types

from leap.evaluation import (EvalReport, by_turn, correct_by_turn, mean_speedup_of_correct, pass_at_1_by_turn,
                             pass_at_k_by_turn)
from leap.learning.data import draw_tasks
from leap.rollouts import BusyClock, Outcome, derive_seed
from svc_trainer.metrics import expanded_share, rollout_metrics

WRONG, RIGHT = Outcome(False), Outcome(True, 2.0)


def test_correct_by_turn_carries_the_last_result_forward():
    assert correct_by_turn([WRONG, RIGHT], 3) == [False, True, True]
    assert correct_by_turn([RIGHT], 2) == [True, True]
    assert correct_by_turn([WRONG], 2) == [False, False]


def test_pass_at_1_by_turn_hand_computed():
    trajectories = [[WRONG, RIGHT], [RIGHT], [WRONG, WRONG], [WRONG]]
    assert pass_at_1_by_turn(trajectories, 2) == [0.25, 0.5]
    assert pass_at_1_by_turn([], 2) == [0.0, 0.0]


def test_pass_at_k_counts_a_task_once_any_of_its_samples_is_solved():
    task_a = [[WRONG, RIGHT], [WRONG, WRONG]]  # solved at turn 2 by its first sample
    task_b = [[RIGHT], [WRONG]]  # solved at turn 1
    task_c = [[WRONG], [WRONG]]  # never
    assert pass_at_k_by_turn([task_a, task_b, task_c], 2) == [1 / 3, 2 / 3]
    assert pass_at_k_by_turn([], 3) == [0.0, 0.0, 0.0]


def test_speedup_counts_only_correct_timed_answers():
    assert mean_speedup_of_correct([[WRONG, Outcome(True, 3.0)], [Outcome(True, 1.0)], [Outcome(False, 9.0)]]) == 2.0
    assert mean_speedup_of_correct([[Outcome(True, 0.0)], [Outcome(True, 4.0)]]) == 4.0  # untimed: left out
    assert mean_speedup_of_correct([[WRONG]]) == 0.0


def test_eval_report_metrics_and_per_task_pass_rates():
    report = EvalReport(["a", "b"], {"a": [[WRONG, RIGHT], [RIGHT]], "b": [[WRONG, WRONG], [WRONG]]}, turns=2,
                        evaluations=6)
    assert report.pass_rates() == {"a": 0.5, "b": 0.0}
    assert report.pass_rates(turn=2) == {"a": 1.0, "b": 0.0}
    metrics = report.metrics()
    assert metrics["pass_at_1/turn_1"] == 0.25 and metrics["pass_at_1/turn_2"] == 0.5
    assert metrics["pass_at_k/turn_1"] == 0.5 and metrics["pass_at_k/turn_2"] == 0.5
    assert metrics["speedup/mean_correct"] == 2.0 and metrics["samples"] == 4 and metrics["sandbox/evaluations"] == 6


def test_expanded_share_and_rollout_metrics():
    assert expanded_share([True, False, False, True]) == 0.5
    assert expanded_share([]) == 0.0
    values = rollout_metrics([[WRONG, RIGHT], [RIGHT]], [True, False], 2)
    assert values == {"pass_at_1/turn_1": 0.5, "pass_at_1/turn_2": 1.0, "speedup/mean_correct": 2.0,
                      "expanded_share": 0.5, "sandbox/flagged_suspicious": 0.0, "sandbox/flagged_unreliable": 0.0}
    assert by_turn("x", [1.0]) == {"x/turn_1": 1.0}


def test_flagged_verdicts_are_counted_and_earn_no_mean_speedup():
    suspicious = Outcome(True, 40.0, suspicious=True)
    both = Outcome(True, 25.0, suspicious=True, unreliable=True)
    values = rollout_metrics([[WRONG, suspicious], [RIGHT, both], [Outcome(True, 1.0, unreliable=True)]],
                             [True, False, False], 2)
    assert values["sandbox/flagged_suspicious"] == 2.0 and values["sandbox/flagged_unreliable"] == 2.0
    assert values["speedup/mean_correct"] == 2.0  # only RIGHT's speedup counts
    assert values["pass_at_1/turn_2"] == 1.0  # a flagged pass is still a pass (FLAGGED_VERDICTS_NO_SPEED_CREDIT)


def test_draw_tasks_resumes_from_the_cursor_and_covers_each_epoch():
    ids = [f"t{i}" for i in range(5)]
    first, cursor = draw_tasks(ids, 3, 0, seed=7)
    second, cursor = draw_tasks(ids, 3, cursor, seed=7)
    assert cursor == 6
    assert sorted(first + second[:2]) == ids  # one full epoch before any repeat
    whole, _ = draw_tasks(ids, 6, 0, seed=7)
    assert whole == first + second  # resuming at the cursor gives the same batches
    assert draw_tasks(ids, 5, 0, seed=8)[0] != draw_tasks(ids, 5, 0, seed=7)[0]  # another seed, another order


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(0, "relu", 1) == 6125255625961819687  # sha256-based: the same in every process, unlike hash()
    assert derive_seed(0, "relu", 1) != derive_seed(0, "relu", 2) != derive_seed(1, "relu", 2)
    assert 0 <= derive_seed("x") < 2**63


def test_busy_clock_counts_overlapping_calls_once(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("leap.rollouts.time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = BusyClock()
    with clock:  # busy from 0 to 3
        now[0] = 1.0
        with clock:  # 1 to 2 overlaps the outer call: not counted again
            now[0] = 2.0
        now[0] = 3.0
    assert clock.seconds == 3.0
    now[0] = 10.0  # idle from 3 to 10: not counted
    with clock:
        now[0] = 11.0
        assert clock.take() == 4.0  # an ongoing call counts up to now
        now[0] = 12.0
    assert clock.seconds == 1.0  # counted again from the take
