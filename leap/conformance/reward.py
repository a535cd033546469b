"""Conformance of a RewardService: the DCP gate decides as documented and a dry run records
nothing, the tournament's rewards of a group sum to zero and order trajectories by outcome,
and bad stages or group sizes are INVALID_ARGUMENT.

Every Gate call here is a dry run with the thresholds spelled out, so the answers do not
depend on the service's configured defaults and nothing enters the task history or the
stats. Rank has no dry run: its calls are counted in GetStats, and change nothing else.
"""

from __future__ import annotations

import grpc

from leap.common.v1 import common_pb2
from leap.conformance.core import CheckFailed, Context, Suite
from leap.reward.v1 import reward_pb2

SUITE = Suite("reward", reward_pb2.DESCRIPTOR.services_by_name["RewardService"])

S = common_pb2.Stage
STATIC = reward_pb2.GateConfig(mode=reward_pb2.GATE_MODE_STATIC, simple_threshold=0.5,
                               catastrophic_stage=S.STAGE_COMPILE, never_solved_after=-1, max_turns=3)
# (group, its first-turn stages, the decision DESIGN.md's static rule gives)
GATE_CASES = [
    ("simple", [S.STAGE_PASSED, S.STAGE_PASSED, S.STAGE_PASSED, S.STAGE_CORRECT], reward_pb2.DECISION_SIMPLE),
    ("pruned", [S.STAGE_FORMAT, S.STAGE_COMPILE, S.STAGE_COMPILE, S.STAGE_FORMAT], reward_pb2.DECISION_CATASTROPHIC),
    ("expand", [S.STAGE_PASSED, S.STAGE_CORRECT, S.STAGE_RUN, S.STAGE_CORRECT], reward_pb2.DECISION_EXPAND),
]


def turn(stage: int, tokens: int = 100, speedup: float | None = None) -> reward_pb2.TurnResult:
    return reward_pb2.TurnResult(stage=stage, generated_tokens=tokens, speedup=speedup)


# Best outcome first: solved at turn 1, solved at turn 2, unsolved reaching CORRECT, unsolved
# stuck at COMPILE. The tournament must give strictly decreasing rewards in this order.
RANKED = [
    reward_pb2.Trajectory(turns=[turn(S.STAGE_PASSED, speedup=1.5)]),
    reward_pb2.Trajectory(turns=[turn(S.STAGE_COMPILE), turn(S.STAGE_PASSED, speedup=1.5)]),
    reward_pb2.Trajectory(turns=[turn(S.STAGE_RUN), turn(S.STAGE_CORRECT)]),
    reward_pb2.Trajectory(turns=[turn(S.STAGE_COMPILE), turn(S.STAGE_COMPILE)]),
]
TOURNAMENT = reward_pb2.RankConfig(method=reward_pb2.REWARD_METHOD_TOURNAMENT)


def dry_gate(ctx: Context) -> tuple[list[str], reward_pb2.GateResponse]:
    task_ids = [f"{ctx.tag}-{name}" for name, _, _ in GATE_CASES]
    groups = [reward_pb2.GateGroup(task_id=task_id, rollouts=[reward_pb2.RolloutResult(stage=s) for s in stages])
              for task_id, (_, stages, _) in zip(task_ids, GATE_CASES)]
    reply = ctx.call("Gate", reward_pb2.GateRequest(groups=groups, config=STATIC, dry_run=True))
    return task_ids, reply


def ranked_rewards(ctx: Context) -> list[float]:
    def rank(ctx: Context) -> list[float]:
        group = reward_pb2.RankGroup(task_id=ctx.tag, trajectories=RANKED)
        results = ctx.call("Rank", reward_pb2.RankRequest(groups=[group], config=TOURNAMENT)).results
        if len(results) != 1 or len(results[0].trajectories) != len(RANKED):
            raise CheckFailed(f"{len(results)} results for 1 group of {len(RANKED)} trajectories")
        return [t.reward for t in results[0].trajectories]

    return ctx.found("ranked", rank)


@SUITE.check("Gate (dry run) decides simple, pruned and expand as documented", "Gate")
def gate_decides(ctx: Context) -> str:
    task_ids, reply = dry_gate(ctx)
    got = [(d.task_id, d.decision) for d in reply.decisions]
    wanted = [(task_id, decision) for task_id, (_, _, decision) in zip(task_ids, GATE_CASES)]
    if got != wanted:
        names = [reward_pb2.Decision.Name(d) for _, d in got]
        raise CheckFailed(f"decisions {names} for groups {[name for name, _, _ in GATE_CASES]}")
    expand = reply.decisions[-1]
    failing = [i for i, s in enumerate(GATE_CASES[-1][1]) if s != S.STAGE_PASSED]
    if sorted(expand.expand_rollouts) != failing:
        raise CheckFailed(f"the expanded group expands rollouts {list(expand.expand_rollouts)}, {failing} expected")
    return "SIMPLE, CATASTROPHIC, EXPAND (the failing rollouts)"


@SUITE.check("Gate with dry_run records nothing in the task history", "Gate")
def gate_dry_run_records_nothing(ctx: Context) -> str:
    task_ids, _ = dry_gate(ctx)
    histories = ctx.call("GetTaskHistory", reward_pb2.GetTaskHistoryRequest(task_ids=task_ids)).histories
    if histories:
        raise CheckFailed(f"history recorded for {[h.task_id for h in histories]}")
    return "GetTaskHistory knows none of the gated tasks"


@SUITE.check("Gate with a one-rollout group is INVALID_ARGUMENT", "Gate")
def gate_group_too_small(ctx: Context) -> str:
    group = reward_pb2.GateGroup(task_id=ctx.tag, rollouts=[reward_pb2.RolloutResult(stage=S.STAGE_PASSED)])
    request = reward_pb2.GateRequest(groups=[group], config=STATIC, dry_run=True)
    return ctx.refused("Gate", request, grpc.StatusCode.INVALID_ARGUMENT, "groups[0].rollouts")


@SUITE.check("Rank: tournament rewards of a group sum to zero and lie in [-1, 1]", "Rank")
def rank_zero_sum(ctx: Context) -> str:
    rewards = ranked_rewards(ctx)
    if abs(sum(rewards)) > 1e-6:
        raise CheckFailed(f"rewards {rewards} sum to {sum(rewards):.6g}")
    if any(not -1.0 <= r <= 1.0 for r in rewards):
        raise CheckFailed(f"rewards {rewards} leave [-1, 1]")
    return f"rewards {[round(r, 3) for r in rewards]}"


@SUITE.check("Rank: earlier solve > later solve > unsolved; among unsolved, later stage wins", "Rank")
def rank_orders_outcomes(ctx: Context) -> str:
    rewards = ranked_rewards(ctx)
    if not all(a > b for a, b in zip(rewards, rewards[1:])):
        raise CheckFailed(f"rewards {rewards} for (solved at turn 1, at turn 2, unsolved at CORRECT, at COMPILE) "
                          f"are not strictly decreasing")
    return "strictly decreasing from the turn-1 solve to the compile failure"


@SUITE.check("Rank with an unset stage is INVALID_ARGUMENT", "Rank")
def rank_bad_stage(ctx: Context) -> str:
    group = reward_pb2.RankGroup(task_id=ctx.tag, trajectories=[reward_pb2.Trajectory(turns=[turn(S.STAGE_UNSPECIFIED)]),
                                                                RANKED[0]])
    return ctx.refused("Rank", reward_pb2.RankRequest(groups=[group]), grpc.StatusCode.INVALID_ARGUMENT,
                       "groups[0].trajectories[0].turns[0].stage")
