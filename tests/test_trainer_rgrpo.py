"""RGRPO bookkeeping (svc_trainer.rgrpo): coverage, round weights and weighted draws, by hand."""

from __future__ import annotations

import collections

import pytest

from svc_trainer import rgrpo

# Two teachers (rows) on four tasks (columns).
QUALITY = [[0.75, 0.0, 0.25, 0.5],
           [0.0, 0.5, 0.25, 0.0]]


def test_rounds_of_global_steps():
    assert [rgrpo.round_of(s, 3) for s in range(1, 8)] == [1, 1, 1, 2, 2, 2, 3]


def test_a_task_is_covered_when_some_teacher_reaches_tau():
    assert rgrpo.covered(QUALITY, 0.5) == [True, True, False, True]
    assert rgrpo.coverage(QUALITY, 0.5) == 0.75
    assert rgrpo.coverage(QUALITY, 0.8) == 0.0
    assert rgrpo.coverage([], 0.5) == 0.0


def test_next_round_weights_uncovered_tasks_one_and_covered_alpha():
    assert rgrpo.round_weights(4, [], 0.5, 0.1) == [1.0, 1.0, 1.0, 1.0]  # round 1: uniform
    assert rgrpo.round_weights(4, QUALITY, 0.5, 0.1) == [0.1, 0.1, 1.0, 0.1]
    assert rgrpo.round_weights(4, QUALITY[:1], 0.5, 0.1) == [0.1, 1.0, 1.0, 0.1]


def test_weighted_draws_are_distinct_seeded_and_follow_the_weights():
    tasks = ["a", "b", "c", "d"]
    weights = [0.1, 0.1, 1.0, 0.1]
    first = rgrpo.weighted_draw(tasks, weights, 2, seed=7)
    assert len(set(first)) == 2 and first == rgrpo.weighted_draw(tasks, weights, 2, seed=7)
    counts = collections.Counter(t for seed in range(2000) for t in rgrpo.weighted_draw(tasks, weights, 1, seed))
    # P(c first) = 1 / 1.3, each other 0.1 / 1.3
    assert counts["c"] / 2000 == pytest.approx(1 / 1.3, abs=0.03)
    assert counts["a"] / 2000 == pytest.approx(0.1 / 1.3, abs=0.02)


def test_weight_zero_tasks_come_last_and_a_batch_is_always_full():
    assert set(rgrpo.weighted_draw(["a", "b", "c"], [0.0, 1.0, 0.0], 1, seed=3)) == {"b"}
    assert sorted(rgrpo.weighted_draw(["a", "b", "c"], [0.0, 1.0, 0.0], 3, seed=3)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="4 distinct"):
        rgrpo.weighted_draw(["a", "b", "c"], [1.0, 1.0, 1.0], 4, seed=0)
