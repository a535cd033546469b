"""The rank reward as pure functions: the tournament's properties (hypothesis), DESIGN.md's
lexicographic order with its margins, the neutral missing speedup, the baselines with
group-normalized advantages, and per-turn discounting."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from leap.common.v1 import common_pb2
from svc_reward.rank import (
    Method,
    Outcome,
    RankParams,
    Turn,
    compare,
    outcome_of,
    rank_group,
    tournament,
)
from svc_reward.stages import Stage
from svc_reward.stats import histogram_edges, reward_bin

PROPERTY = settings(max_examples=150, deadline=None)
TOURNAMENT = RankParams()

speedups = st.one_of(st.none(), st.floats(min_value=0.05, max_value=50.0))
turns = st.builds(Turn, stage=st.sampled_from(list(Stage)), speedup=speedups, tokens=st.integers(0, 4000))
trajectories = st.lists(turns, min_size=1, max_size=3)
groups = st.lists(trajectories, min_size=2, max_size=10)


def rewards_of(group, params: RankParams = TOURNAMENT) -> list[float]:
    return [t.reward for t in rank_group(group, params).trajectories]


def solved(speedup: float | None = None, tokens: int = 100, turn: int = 1) -> list[Turn]:
    """A trajectory that fails at COMPILE until `turn`, where it passes."""
    return [Turn(Stage.COMPILE, None, 0)] * (turn - 1) + [Turn(Stage.PASSED, speedup, tokens)]


def failed(stage: Stage, tokens: int = 100) -> list[Turn]:
    return [Turn(stage, None, tokens)]


def test_stage_numbers_match_the_contract():
    for stage in Stage:
        assert common_pb2.Stage.Value(f"STAGE_{stage.name}") == stage.value
    assert len(common_pb2.Stage.values()) == len(Stage) + 1  # plus STAGE_UNSPECIFIED


# Properties of the tournament ------------------------------------------------------------


@PROPERTY
@given(groups)
def test_rewards_sum_to_zero_and_lie_in_minus_one_one(group):
    rewards = rewards_of(group)
    assert abs(math.fsum(rewards)) < 1e-9
    assert all(-1.0 <= r <= 1.0 for r in rewards)


@PROPERTY
@given(st.data(), groups)
def test_rewards_do_not_depend_on_the_order_of_the_group(data, group):
    order = data.draw(st.permutations(range(len(group))))
    rewards = rewards_of(group)
    shuffled = rewards_of([group[i] for i in order])
    assert shuffled == [rewards[i] for i in order]


@dataclasses.dataclass(frozen=True)
class Improvement:
    """One way of making a trajectory better, applied to one of its turns."""

    kind: str
    turn: int
    amount: float


improvements = st.builds(Improvement, kind=st.sampled_from(["fewer_tokens", "faster", "raise_stage"]),
                         turn=st.integers(0, 2), amount=st.floats(0.01, 0.99))


def improved(trajectory: list[Turn], change: Improvement) -> list[Turn] | None:
    """The trajectory made better at one turn, or None where the change does not apply. A
    stage is raised only on a turn with no speedup: gaining a speed measurement is not an
    improvement (a missing speedup is neutral, a measured one can lose)."""
    if change.turn >= len(trajectory):
        return None
    turn = trajectory[change.turn]
    if change.kind == "fewer_tokens":
        better = turn._replace(tokens=int(turn.tokens * (1 - change.amount)))
    elif change.kind == "faster":
        if turn.stage != Stage.PASSED or not turn.speedup:
            return None
        better = turn._replace(speedup=turn.speedup * (1 + 10 * change.amount))
    else:
        if turn.stage == Stage.PASSED or turn.speedup is not None:
            return None
        higher = [stage for stage in Stage if stage > turn.stage]
        better = turn._replace(stage=higher[int(change.amount * len(higher))])
    return [*trajectory[:change.turn], better, *trajectory[change.turn + 1:]]


@PROPERTY
@given(st.data(), groups, improvements)
def test_improving_one_trajectory_never_lowers_its_reward(data, group, change):
    index = data.draw(st.integers(0, len(group) - 1))
    better = improved(group[index], change)
    assume(better is not None)
    before = rewards_of(group)[index]
    after = rewards_of([*group[:index], better, *group[index + 1:]])[index]
    assert after >= before


outcomes = st.builds(
    Outcome,
    solved_turn=st.one_of(st.none(), st.integers(1, 3)),
    stage=st.sampled_from([s for s in Stage if s != Stage.PASSED]),
    speedup=speedups,
    tokens=st.integers(0, 4000),
    turns=st.just(3),
)


@PROPERTY
@given(st.data(), st.lists(outcomes, min_size=2, max_size=10))
def test_improving_an_outcome_on_any_key_never_lowers_its_reward(data, group):
    """The same on outcomes directly, one lexicographic key at a time."""
    index = data.draw(st.integers(0, len(group) - 1))
    o = group[index]
    key = data.draw(st.sampled_from(["solve", "earlier", "stage", "faster", "fewer_tokens"]))
    if key == "solve" and o.solved_turn is None:
        better = o._replace(solved_turn=3, stage=Stage.PASSED)
    elif key == "earlier" and o.solved_turn is not None and o.solved_turn > 1:
        better = o._replace(solved_turn=o.solved_turn - 1)
    elif key == "stage" and o.solved_turn is None and o.stage < Stage.CORRECT:
        better = o._replace(stage=Stage(o.stage + 1))
    elif key == "faster" and o.speedup is not None:
        better = o._replace(speedup=o.speedup * data.draw(st.floats(1.0, 10.0)))
    elif key == "fewer_tokens":
        better = o._replace(tokens=data.draw(st.integers(0, o.tokens)))
    else:
        assume(False)
    before = tournament(group, TOURNAMENT).trajectories[index].reward
    after = tournament([*group[:index], better, *group[index + 1:]], TOURNAMENT).trajectories[index].reward
    assert after >= before


@PROPERTY
@given(st.data(), groups)
def test_equal_outcomes_get_equal_rewards(data, group):
    copies = data.draw(st.lists(st.integers(0, len(group) - 1), min_size=1, max_size=4))
    # A copy with its tokens moved between turns has the same outcome but different turns.
    group = group + [reshuffled_tokens(group[i]) for i in copies]
    rewards = rewards_of(group)
    seen = [outcome_of(t) for t in group]
    for i in range(len(group)):
        for j in range(len(group)):
            if seen[i] == seen[j]:
                assert rewards[i] == rewards[j]


def reshuffled_tokens(trajectory: list[Turn]) -> list[Turn]:
    total = sum(turn.tokens for turn in trajectory)
    moved = [turn._replace(tokens=0) for turn in trajectory]
    moved[-1] = moved[-1]._replace(tokens=total)
    return moved


@PROPERTY
@given(trajectories, st.integers(2, 16))
def test_a_group_of_identical_outcomes_gets_all_zeros(trajectory, size):
    scores = rank_group([trajectory] * size, TOURNAMENT).trajectories
    assert [s.reward for s in scores] == [0.0] * size
    assert all(s.ties == size - 1 and s.wins == s.losses == 0 for s in scores)


@PROPERTY
@given(st.floats(0.1, 20.0), st.floats(0.0, 0.99), st.integers(10, 4000), st.floats(0.0, 0.99),
       st.floats(0.01, 0.5), st.floats(0.01, 0.5))
def test_the_margins_make_near_equal_speedups_and_token_counts_tie(speedup, speed_gap, tokens, token_gap,
                                                                   speedup_margin, token_margin):
    params = RankParams(speedup_margin=speedup_margin, token_margin=token_margin)
    near = [solved(speedup, tokens), solved(speedup * (1 + speed_gap * speedup_margin),
                                            int(tokens * (1 + token_gap * token_margin)))]
    assert rewards_of(near, params) == [0.0, 0.0]
    # Beyond the speed margin the faster one wins, whatever the tokens.
    faster = [solved(speedup, 1), solved(speedup * (1 + speedup_margin) * 1.01, 10 * tokens)]
    assert rewards_of(faster, params) == [-1.0, 1.0]
    # Within the speed margin, beyond the token margin the shorter one wins.
    shorter = [solved(speedup, tokens), solved(speedup, math.ceil(tokens * (1 + token_margin) * 1.01) + 1)]
    assert rewards_of(shorter, params) == [1.0, -1.0]


@PROPERTY
@given(groups)
def test_the_counted_tournament_agrees_with_every_pairwise_comparison(group):
    scores = rank_group(group, TOURNAMENT, include_matrix=True)
    size = len(group)
    matrix = scores.matrix
    for i, score in enumerate(scores.trajectories):
        row = matrix[i * size:(i + 1) * size]
        assert (score.wins, score.losses, score.ties) == (row.count(1), row.count(-1), row.count(0) - 1)
        assert all(matrix[i * size + j] == -matrix[j * size + i] for j in range(size))


# DESIGN.md's order, key by key -----------------------------------------------------------


def test_the_lexicographic_order_of_design_md():
    ladder = [
        solved(1.0, 500, turn=1),
        solved(9.0, 10, turn=2),  # a later solve loses to an earlier one, however fast and short
        solved(9.0, 10, turn=3),
        failed(Stage.CORRECT, 10),  # unsolved: wrong output > runtime error > compile error > format
        failed(Stage.RUN, 10),
        failed(Stage.COMPILE, 10),
        failed(Stage.FORMAT, 10),
    ]
    scores = rank_group(ladder, TOURNAMENT, include_matrix=True)
    assert [s.reward for s in scores.trajectories] == pytest.approx([1, 2 / 3, 1 / 3, 0, -1 / 3, -2 / 3, -1])
    size = len(ladder)
    for i in range(size):
        for j in range(size):
            expected = 0 if i == j else (1 if i < j else -1)
            assert scores.matrix[i * size + j] == expected


def test_speed_comes_before_tokens_and_tokens_only_among_solved():
    fast_long = solved(2.0, 1000)
    slow_short = solved(1.0, 10)
    assert rewards_of([fast_long, slow_short]) == [1.0, -1.0]
    # Two failures at the same stage tie whatever their lengths: no length gradient on failures.
    assert rewards_of([failed(Stage.RUN, 10), failed(Stage.RUN, 5000)]) == [0.0, 0.0]


def test_a_missing_speedup_is_neutral_and_zero_reads_as_missing():
    untimed = solved(None, 100)
    assert rewards_of([untimed, solved(50.0, 100)]) == [0.0, 0.0]  # no speed tie-break, tokens tie
    assert rewards_of([untimed, solved(50.0, 1000)]) == [1.0, -1.0]  # straight to the token tie-break
    assert outcome_of(solved(0.0)).speedup is None
    # A speedup on a turn that did not pass does not count.
    assert outcome_of([Turn(Stage.CORRECT, 5.0, 10)]).speedup is None


def test_a_flagged_speedup_earns_no_speed_credit():
    # The sandbox flagged the fast one's timing (suspicious or unreliable): it reads as untimed.
    flagged = [Turn(Stage.PASSED, 40.0, 100, flagged=True)]
    assert outcome_of(flagged).speedup is None
    assert rewards_of([flagged, solved(1.0, 100)]) == [0.0, 0.0]
    assert rewards_of([flagged, solved(1.0, 1000)]) == [1.0, -1.0]  # the token tie-break still applies
    # Its best unflagged turn still counts.
    assert outcome_of([Turn(Stage.PASSED, 2.0, 10), Turn(Stage.PASSED, 40.0, 10, flagged=True)]).speedup == 2.0
    log_speedup = RankParams(method=Method.LOG_SPEEDUP)
    assert rewards_of([flagged, failed(Stage.RUN)], log_speedup) == pytest.approx([0.0, math.log(0.1)])


def test_speed_wins_only_where_the_intervals_separate():
    fast = [Turn(Stage.PASSED, 1.5, 100, 1.3, 1.7)]
    overlapping = [Turn(Stage.PASSED, 1.0, 100, 0.8, 1.4)]
    apart = [Turn(Stage.PASSED, 1.0, 100, 0.9, 1.1)]
    assert rewards_of([fast, overlapping]) == [0.0, 0.0]  # beyond the margin, within the noise: a tie
    assert rewards_of([fast, apart]) == [1.0, -1.0]
    assert rewards_of([fast, solved(1.0)]) == [1.0, -1.0]  # no interval on one side: the margin decides
    assert outcome_of(fast)[5:] == (1.3, 1.7)


def test_a_trajectory_reads_as_its_best_artifact():
    regressed = [Turn(Stage.CORRECT, None, 10), Turn(Stage.COMPILE, None, 10)]
    outcome = outcome_of(regressed)
    assert outcome.solved_turn is None and outcome.stage == Stage.CORRECT and outcome.tokens == 20
    improved_then_broke = [Turn(Stage.PASSED, 1.5, 10), Turn(Stage.PASSED, 3.0, 10), Turn(Stage.RUN, None, 10)]
    outcome = outcome_of(improved_then_broke)
    assert (outcome.solved_turn, outcome.speedup, outcome.turns) == (1, 3.0, 3)


def test_compare_is_antisymmetric_on_a_few_hand_picked_pairs():
    pairs = [(solved(1.0), solved(1.04)), (solved(1.0, 100), solved(1.0, 111)), (failed(Stage.RUN), solved())]
    for a, b in pairs:
        oa, ob = outcome_of(a), outcome_of(b)
        assert compare(oa, ob, 0.05, 0.1) == -compare(ob, oa, 0.05, 0.1)


# Baselines and discounting ----------------------------------------------------------------


def test_binary_baseline_is_group_normalized():
    group = [solved(2.0), failed(Stage.COMPILE), solved(None), failed(Stage.RUN)]
    scores = rank_group(group, RankParams(method=Method.BINARY)).trajectories
    assert [s.reward for s in scores] == [1.0, 0.0, 1.0, 0.0]
    advantages = [s.advantage for s in scores]
    assert math.fsum(advantages) == pytest.approx(0.0, abs=1e-12)
    assert statistics.stdev(advantages) == pytest.approx(1.0, rel=1e-5)
    assert advantages[0] > 0 > advantages[1]
    assert all(s.wins == s.losses == s.ties == 0 for s in scores)


def test_log_speedup_baseline_uses_the_failure_penalty_as_failure_and_floor():
    penalty = -1.0
    group = [solved(4.0), solved(None), solved(0.01), failed(Stage.CORRECT)]
    rewards = rewards_of(group, RankParams(method=Method.LOG_SPEEDUP, failure_penalty=penalty))
    assert rewards == pytest.approx([math.log(4.0), 0.0, penalty, penalty])
    default = rewards_of([solved(1.0), failed(Stage.FORMAT)], RankParams(method=Method.LOG_SPEEDUP))
    assert default == pytest.approx([0.0, math.log(0.1)])


@pytest.mark.parametrize("method", list(Method))
def test_a_group_with_equal_rewards_gets_zero_advantages_with_every_method(method):
    scores = rank_group([solved(2.0, 10), solved(2.0, 10), solved(2.0, 10)], RankParams(method=method))
    assert [s.advantage for s in scores.trajectories] == [0.0, 0.0, 0.0]


@PROPERTY
@given(groups, st.sampled_from([Method.BINARY, Method.LOG_SPEEDUP]))
def test_baseline_advantages_sum_to_zero_and_follow_the_rewards(group, method):
    scores = rank_group(group, RankParams(method=method)).trajectories
    assert abs(math.fsum(s.advantage for s in scores)) < 1e-6
    for a in scores:
        for b in scores:
            if a.reward > b.reward:
                assert a.advantage > b.advantage


def test_per_turn_discounting_credits_the_last_turn_fully():
    group = [solved(2.0, 10, turn=3), failed(Stage.RUN)]
    gamma = 0.4
    scores = rank_group(group, RankParams(turn_discount=gamma)).trajectories
    assert scores[0].turn_advantages == pytest.approx([gamma ** 2, gamma, 1.0])
    assert scores[1].turn_advantages == [-1.0]
    undiscounted = rank_group(group, TOURNAMENT).trajectories
    assert undiscounted[0].turn_advantages == [1.0, 1.0, 1.0]
    binary = rank_group(group, RankParams(method=Method.BINARY, turn_discount=gamma)).trajectories[0]
    assert binary.turn_advantages == pytest.approx([binary.advantage * gamma ** 2, binary.advantage * gamma,
                                                    binary.advantage])


def test_params_out_of_range_are_named():
    bad = RankParams(speedup_margin=-0.1, token_margin=math.nan, turn_discount=0.0, failure_penalty=1.0)
    assert [name for name, _ in bad.problems()] == ["speedup_margin", "token_margin", "turn_discount",
                                                    "failure_penalty"]
    assert RankParams().problems() == []


def test_reward_histogram_bins_put_edges_in_the_bin_they_open():
    edges = histogram_edges()
    assert edges[0] == -1.0 and edges[-1] == 1.0 and len(edges) == 21
    assert [reward_bin(r) for r in (-1.0, -0.95, 3 / 15, 0.0, 1.0)] == [0, 0, 12, 10, 19]
