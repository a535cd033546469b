"""Rewards of a group of whole trajectories: the lexicographic tournament of DESIGN.md and
the two baselines for ablation (binary pass and log-speedup, group-normalized as in GRPO).

Pure functions over plain values; the servicer converts protos to `Turn`s and back.

How a trajectory's outcome is read (`outcome_of`) — the *best artifact* it produced:
- solved at its first passing turn (a later turn, say a failed attempt to go faster, does
  not undo a solve);
- among unsolved, the best stage reached over its turns, not the last turn's: a bolder
  debugging attempt that regresses is not punished below what the trajectory already
  showed, and it is the same reading as for solved ones (the best kernel counts);
- speed: the best speedup over its passing turns, with its confidence interval when the
  turn carries one; a turn with no speedup (unset or 0: not timed) or a flagged one (the
  sandbox found its timing suspicious or unreliable: no speed credit) is neutral, and a
  trajectory with none takes no part in the speed tie-break;
- length: the tokens generated over all its turns.

Tournament: i beats j when (1) i is solved at an earlier turn, or solved where j is not, or
both unsolved and i reached a later stage; else, both solved at the same turn, (2) both have
a speedup, i's exceeds j's by more than `speedup_margin` (relative), and where both carry
intervals they separate (`low_i > high_j`: noise cannot have made the difference); else (3) j generated
more than `1 + token_margin` times i's tokens. Two unsolved trajectories at the same stage
tie: the length tie-break is for solved ones only, so a failing model is never taught to
fail in fewer words. `reward = (wins - losses) / (G - 1)` is the advantage itself.

Per-turn discounting (every method alike): the trajectory's advantage is a terminal reward
of its last turn, so turn t of T gets `gamma ** (T - t) * advantage` (Kevin's discounted
return of a reward that arrives at the end); gamma = 1 gives every turn the advantage.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import NamedTuple

from svc_reward.stages import Stage

# Added to the standard deviation of the group-normalized baselines (as GRPO does).
NORMALIZE_EPS = 1e-6
# Outcome.key of a solved trajectory: SOLVED_KEY - turn, above every unsolved stage.
SOLVED_KEY = 1 << 30


class Method(enum.Enum):
    """How a group's rewards are computed."""

    TOURNAMENT = "tournament"
    BINARY = "binary"
    LOG_SPEEDUP = "log_speedup"


class Turn(NamedTuple):
    """One turn of a trajectory: the stage reached, its speedup (None or 0: not timed; only
    a passing turn's counts), the tokens the model generated in it, the speedup's interval
    (None: not known) and whether the sandbox flagged the timing (then the speedup counts as
    not timed)."""

    stage: Stage
    speedup: float | None = None
    tokens: int = 0
    low: float | None = None
    high: float | None = None
    flagged: bool = False


class Outcome(NamedTuple):
    """What the tournament compares (see the module docstring)."""

    solved_turn: int | None  # 1-based turn of the first pass; None when unsolved
    stage: Stage  # best stage over the turns (PASSED when solved)
    speedup: float | None  # best speedup over the passing turns; None when none was timed
    tokens: int  # generated over every turn
    turns: int
    low: float | None = None  # that speedup's interval, when its turn carried one
    high: float | None = None

    @property
    def key(self) -> int:
        """Key 1 as one number: solved beats unsolved, an earlier solve a later one, and
        among unsolved the later stage wins."""
        return int(self.stage) if self.solved_turn is None else SOLVED_KEY - self.solved_turn


def outcome_of(turns: Sequence[Turn]) -> Outcome:
    solved_turn = None
    best_stage = Stage.FORMAT
    best: Turn | None = None
    tokens = 0
    for number, turn in enumerate(turns, start=1):
        tokens += turn.tokens
        best_stage = max(best_stage, turn.stage)
        if turn.stage == Stage.PASSED:
            if solved_turn is None:
                solved_turn = number
            if turn.speedup and not turn.flagged and (best is None or turn.speedup > best.speedup):
                best = turn
    if best is None:
        return Outcome(solved_turn, best_stage, None, tokens, len(turns))
    interval = (best.low, best.high) if best.low is not None and best.high is not None else (None, None)
    return Outcome(solved_turn, best_stage, best.speedup, tokens, len(turns), *interval)


@dataclasses.dataclass(frozen=True)
class RankParams:
    """Everything that shapes a group's rewards; every field has DESIGN.md's default."""

    method: Method = Method.TOURNAMENT
    speedup_margin: float = 0.05
    token_margin: float = 0.10
    turn_discount: float = 1.0
    failure_penalty: float = math.log(0.1)

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for every value out of range."""
        found = []
        for name in ("speedup_margin", "token_margin"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                found.append((name, f"must be a finite number >= 0, got {value!r}"))
        if not (math.isfinite(self.turn_discount) and 0 < self.turn_discount <= 1):
            found.append(("turn_discount", f"must be in (0, 1], got {self.turn_discount!r}"))
        if not (math.isfinite(self.failure_penalty) and self.failure_penalty <= 0):
            found.append(("failure_penalty", f"must be a finite number <= 0, got {self.failure_penalty!r}"))
        return found


def compare(a: Outcome, b: Outcome, speedup_margin: float, token_margin: float) -> int:
    """+1 when a beats b, -1 when b beats a, 0 for a tie. Antisymmetric by construction."""
    key_a, key_b = a.key, b.key
    if key_a != key_b:
        return 1 if key_a > key_b else -1
    if a.solved_turn is None:
        return 0
    return tie_break(a, b, speedup_margin, token_margin)


def tie_break(a: Outcome, b: Outcome, speedup_margin: float, token_margin: float) -> int:
    """Keys 2 and 3, for two trajectories solved at the same turn: speed, then length."""
    if a.speedup is not None and b.speedup is not None:
        if a.speedup > b.speedup * (1 + speedup_margin) and separated(a, b):
            return 1
        if b.speedup > a.speedup * (1 + speedup_margin) and separated(b, a):
            return -1
    if b.tokens > a.tokens * (1 + token_margin):
        return 1
    if a.tokens > b.tokens * (1 + token_margin):
        return -1
    return 0


def separated(faster: Outcome, slower: Outcome) -> bool:
    """Whether the faster one's speed interval lies above the slower one's (True when either
    has none: then the margin alone decides)."""
    if faster.low is None or slower.high is None:
        return True
    return faster.low > slower.high


@dataclasses.dataclass
class TrajectoryScore:
    """The reward of one trajectory and the advantages its tokens get."""

    reward: float
    advantage: float
    turn_advantages: list[float]
    wins: int = 0
    losses: int = 0
    ties: int = 0


@dataclasses.dataclass
class GroupScores:
    """One group's scores, in the order of its trajectories."""

    trajectories: list[TrajectoryScore]
    matrix: list[int] | None = None  # row-major G x G: +1 row beats column (tournament only)


def rank_group(trajectories: Sequence[Sequence[Turn]], params: RankParams = RankParams(),
               include_matrix: bool = False) -> GroupScores:
    """Rewards and advantages of one group (at least two trajectories, each with a turn)."""
    if len(trajectories) < 2:
        raise ValueError(f"a group needs at least two trajectories, got {len(trajectories)}")
    outcomes = [outcome_of(turns) for turns in trajectories]
    if params.method is Method.TOURNAMENT:
        return tournament(outcomes, params, include_matrix)
    if params.method is Method.BINARY:
        rewards = [1.0 if o.solved_turn is not None else 0.0 for o in outcomes]
    else:
        rewards = [log_speedup_reward(o, params.failure_penalty) for o in outcomes]
    advantages = group_normalized(rewards)
    return GroupScores([
        TrajectoryScore(reward, advantage, discounted(advantage, o.turns, params.turn_discount))
        for reward, advantage, o in zip(rewards, advantages, outcomes)
    ])


def tournament(outcomes: Sequence[Outcome], params: RankParams, include_matrix: bool = False) -> GroupScores:
    """Every pair's result, counted. Key 1 is a total order, so trajectories are sorted by it
    once: each beats every one in a lower class and loses to every one in a higher; only
    within a class of equal solves are pairs compared on speed and length (the margins make
    that relation intransitive, so it is pairwise). The matrix, when asked for, comes from
    `compare` itself."""
    size = len(outcomes)
    keys = [o.key for o in outcomes]
    order = sorted(range(size), key=keys.__getitem__)
    wins = [0] * size
    losses = [0] * size
    below = 0
    start = 0
    while start < size:
        end = start + 1
        while end < size and keys[order[end]] == keys[order[start]]:
            end += 1
        members = order[start:end]
        above = size - end
        for i in members:
            wins[i] = below
            losses[i] = above
        if outcomes[members[0]].solved_turn is not None:
            _tie_breaks(outcomes, members, params, wins, losses)
        below = end
        start = end
    matrix = None
    if include_matrix:
        matrix = [compare(outcomes[i], outcomes[j], params.speedup_margin, params.token_margin) if i != j else 0
                  for i in range(size) for j in range(size)]
    scores = []
    for i, outcome in enumerate(outcomes):
        reward = (wins[i] - losses[i]) / (size - 1)
        scores.append(TrajectoryScore(reward, reward, discounted(reward, outcome.turns, params.turn_discount),
                                      wins=wins[i], losses=losses[i], ties=size - 1 - wins[i] - losses[i]))
    return GroupScores(scores, matrix)


def _tie_breaks(outcomes: Sequence[Outcome], members: list[int], params: RankParams,
                wins: list[int], losses: list[int]) -> None:
    for position, i in enumerate(members):
        for j in members[position + 1:]:
            result = tie_break(outcomes[i], outcomes[j], params.speedup_margin, params.token_margin)
            if result > 0:
                wins[i] += 1
                losses[j] += 1
            elif result < 0:
                wins[j] += 1
                losses[i] += 1


def log_speedup_reward(outcome: Outcome, failure_penalty: float) -> float:
    """log(speedup) when solved (an untimed solve counts as speedup 1), floored at the
    failure penalty so that solving never scores below failing; the penalty otherwise."""
    if outcome.solved_turn is None:
        return failure_penalty
    return max(math.log(outcome.speedup) if outcome.speedup else 0.0, failure_penalty)


def group_normalized(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / (std + eps) with the sample standard deviation, as GRPO implementations
    do; a group whose rewards are all equal carries no signal and gets zeros."""
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + NORMALIZE_EPS) for r in rewards]


def discounted(advantage: float, turns: int, gamma: float) -> list[float]:
    """Per-turn advantages of a terminal reward: turn t of T gets gamma ** (T - t) * advantage."""
    if gamma == 1.0:
        return [advantage] * turns
    return [advantage * gamma ** (turns - t) for t in range(1, turns + 1)]
