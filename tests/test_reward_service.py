"""RewardService over real gRPC: Gate, Rank, GetTaskHistory and GetStats; INVALID_ARGUMENT
with BadRequest naming every bad field; service config as the default of every request
field; and the task history surviving a real `leap serve reward` stopped — or killed — and
started again on the same file."""

from __future__ import annotations

import math
import signal
import subprocess
import sys

import grpc
import pytest
from google.rpc import error_details_pb2

from leap.common.v1 import common_pb2
from leap.reward.v1 import reward_pb2 as pb
from leap.reward.v1 import reward_pb2_grpc
from leap.runtime import BackgroundServer
from leap.runtime.errors import details_of
from svc_reward.server import RewardConfig, build
from tests.conftest import ROOT, free_port, leap_serve, subprocess_env

PASSED, CORRECT, RUN, COMPILE, FORMAT = (common_pb2.STAGE_PASSED, common_pb2.STAGE_CORRECT, common_pb2.STAGE_RUN,
                                         common_pb2.STAGE_COMPILE, common_pb2.STAGE_FORMAT)


def start(tmp_path, **settings) -> BackgroundServer:
    settings.setdefault("history_path", str(tmp_path / "history.sqlite3"))
    config = RewardConfig(port=free_port(), drain_seconds=0.0, log_level="warning", **settings)
    return BackgroundServer(build(config), config).start()


@pytest.fixture
def server(tmp_path):
    running = start(tmp_path)
    yield running
    running.stop()


def stub_for(address: str) -> reward_pb2_grpc.RewardServiceStub:
    return reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(address))


def gate_group(task_id: str, failures: int, size: int = 8, stage=RUN) -> pb.GateGroup:
    rollouts = [pb.RolloutResult(stage=stage)] * failures + [pb.RolloutResult(stage=PASSED, speedup=1.5)] * (
        size - failures)
    return pb.GateGroup(task_id=task_id, rollouts=rollouts)


def turn(stage, tokens=100, speedup=None) -> pb.TurnResult:
    message = pb.TurnResult(stage=stage, generated_tokens=tokens)
    if speedup is not None:
        message.speedup = speedup
    return message


def trajectory(*turns: pb.TurnResult) -> pb.Trajectory:
    return pb.Trajectory(turns=turns)


def violations_of(call, request) -> list[str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (bad_request,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.BadRequest)]
    fields = [v.field for v in bad_request.field_violations]
    for field in fields:
        assert field in caught.value.details()
    return fields


# Gate ------------------------------------------------------------------------------------


def test_gate_decides_a_batch_and_records_history_and_stats(server):
    stub = stub_for(server.address)
    groups = [gate_group("easy", 2), gate_group("mid", 6), gate_group("broken", 8, stage=COMPILE)]
    request = pb.GateRequest(groups=groups)
    reply = stub.Gate(request, timeout=10)
    easy, mid, broken = reply.decisions
    assert (easy.decision, easy.rule, easy.max_turns) == (pb.DECISION_SIMPLE, "simple", 1)
    assert (mid.decision, mid.rule, list(mid.expand_rollouts), mid.max_turns) == (
        pb.DECISION_EXPAND, "expand", [0, 1, 2, 3, 4, 5], 3)
    assert mid.reason == "6/8 failed (0.75 > 0.50): expand 6 rollouts to 3 turns"
    assert (broken.decision, broken.rule) == (pb.DECISION_CATASTROPHIC, "catastrophic:stage")
    assert {c.stage: c.count for c in broken.stage_histogram}[COMPILE] == 8
    assert (mid.failures, mid.group_size, mid.history.attempts, mid.history.solves) == (6, 8, 8, 2)
    assert mid.history.ema_pass_rate == 0.25 and mid.expected_value == pytest.approx(0.5)
    assert reply.summary.groups == 3 and reply.summary.expanded_share == pytest.approx(1 / 3)
    assert reply.summary.evaluations_saved == (2 + 8) * 2

    histories = stub.GetTaskHistory(pb.GetTaskHistoryRequest(), timeout=10).histories
    assert [h.task_id for h in histories] == ["broken", "easy", "mid"]
    assert histories[0].update_time.seconds > 0
    picked = stub.GetTaskHistory(pb.GetTaskHistoryRequest(task_ids=["mid", "unknown"]), timeout=10).histories
    assert [h.task_id for h in picked] == ["mid"]

    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert (stats.groups_gated, stats.simple, stats.expanded, stats.catastrophic) == (3, 1, 1, 1)
    assert dict(stats.decisions_by_reason) == {"simple": 1, "expand": 1, "catastrophic:stage": 1}
    assert stats.evaluations_saved == 20 and stats.expanded_share == pytest.approx(1 / 3)


def test_dry_run_records_nothing(server):
    stub = stub_for(server.address)
    reply = stub.Gate(pb.GateRequest(groups=[gate_group("t", 6)], dry_run=True), timeout=10)
    assert reply.decisions[0].history.attempts == 8
    assert stub.GetTaskHistory(pb.GetTaskHistoryRequest(), timeout=10).histories == []
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10).groups_gated == 0


def test_request_config_overrides_the_service_config(tmp_path):
    server = start(tmp_path, simple_threshold=0.25, gate_mode="adaptive", expand_budget=0.5, max_turns=4)
    try:
        stub = stub_for(server.address)
        groups = [gate_group("a", 3), gate_group("b", 4)]
        adaptive = stub.Gate(pb.GateRequest(groups=groups, dry_run=True), timeout=10)
        assert [d.decision for d in adaptive.decisions] == [pb.DECISION_OVER_BUDGET, pb.DECISION_EXPAND]
        assert adaptive.decisions[1].max_turns == 4
        static = pb.GateConfig(mode=pb.GATE_MODE_STATIC)
        by_service = stub.Gate(pb.GateRequest(groups=groups, config=static, dry_run=True), timeout=10)
        assert [d.decision for d in by_service.decisions] == [pb.DECISION_EXPAND, pb.DECISION_EXPAND]
        static.simple_threshold = 0.5
        static.max_turns = 2
        by_request = stub.Gate(pb.GateRequest(groups=groups, config=static, dry_run=True), timeout=10)
        assert [d.decision for d in by_request.decisions] == [pb.DECISION_SIMPLE, pb.DECISION_SIMPLE]
        assert by_request.summary.evaluations_saved == (3 + 4) * 1
        expand_all = pb.GateConfig(mode=pb.GATE_MODE_EXPAND_ALL)
        unpruned = stub.Gate(pb.GateRequest(groups=[gate_group("c", 8, stage=FORMAT)], config=expand_all, dry_run=True),
                             timeout=10)
        assert unpruned.decisions[0].rule == "expand:all"
    finally:
        server.stop()


# Rank ------------------------------------------------------------------------------------


def test_rank_scores_groups_with_matrix_discount_and_stats(server):
    stub = stub_for(server.address)
    group = pb.RankGroup(task_id="relu", trajectories=[
        trajectory(turn(PASSED, 100, 2.0)),
        trajectory(turn(COMPILE, 80), turn(PASSED, 90, 1.0)),
        trajectory(turn(RUN, 50), turn(CORRECT, 50)),
        trajectory(turn(PASSED, 100, 2.05)),  # within the 5% speed margin of the first: a tie
    ])
    config = pb.RankConfig(include_matrix=True, turn_discount=0.5)
    (result,) = stub.Rank(pb.RankRequest(groups=[group], config=config), timeout=10).results
    assert result.task_id == "relu"
    rewards = [t.reward for t in result.trajectories]
    assert rewards == pytest.approx([2 / 3, -1 / 3, -1, 2 / 3])
    assert [(t.wins, t.losses, t.ties) for t in result.trajectories] == [(2, 0, 1), (1, 2, 0), (0, 3, 0), (2, 0, 1)]
    assert list(result.trajectories[1].turn_advantages) == pytest.approx([-1 / 6, -1 / 3])
    assert list(result.outcome_matrix) == [0, 1, 1, 0, -1, 0, 1, -1, -1, -1, 0, -1, 0, 1, 1, 0]

    binary = stub.Rank(pb.RankRequest(groups=[group], config=pb.RankConfig(method=pb.REWARD_METHOD_BINARY)),
                       timeout=10).results[0]
    assert [t.reward for t in binary.trajectories] == [1, 1, 0, 1]
    assert sum(t.advantage for t in binary.trajectories) == pytest.approx(0, abs=1e-9)
    assert list(binary.outcome_matrix) == []

    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert (stats.groups_ranked, stats.trajectories_ranked) == (2, 8)
    assert dict(stats.trajectories_by_method) == {"tournament": 4, "binary": 4}
    assert len(stats.reward_histogram.edges) == 21 and sum(stats.reward_histogram.counts) == 4
    assert stats.reward_histogram.counts[0] == 1 and stats.reward_histogram.counts[16] == 2


def test_a_large_batch_is_ranked_off_the_event_loop_with_the_same_answer(server):
    stub = stub_for(server.address)
    big = pb.RankGroup(task_id="big", trajectories=[
        trajectory(turn(PASSED, 100 + i, 1.0 + i / 10)) if i % 2 else trajectory(turn(RUN, 10))
        for i in range(400)
    ])
    (result,) = stub.Rank(pb.RankRequest(groups=[big]), timeout=60).results
    rewards = [t.reward for t in result.trajectories]
    assert abs(math.fsum(rewards)) < 1e-9 and max(rewards) == rewards[-1]


# Bad input -------------------------------------------------------------------------------


def bad_gate_requests():
    good = gate_group("t", 6)
    nan = pb.RolloutResult(stage=PASSED, speedup=math.nan)
    yield "no groups", pb.GateRequest(), ["groups"]
    yield "group of one", pb.GateRequest(groups=[gate_group("ok", 0, size=1)]), ["groups[0].rollouts"]
    yield "no task id, unknown and unspecified stages, negative speedups", pb.GateRequest(groups=[
        good,
        pb.GateGroup(rollouts=[pb.RolloutResult(stage=9), pb.RolloutResult(),
                               pb.RolloutResult(stage=PASSED, speedup=-3.0), pb.RolloutResult(stage=PASSED, speedup=-1.0)]),
    ]), ["groups[1].task_id", "groups[1].rollouts[0].stage", "groups[1].rollouts[1].stage",
         "groups[1].rollouts[2].speedup", "groups[1].rollouts[3].speedup"]
    # NaN and infinity are refused by the runtime (leap.runtime.checks) before the servicer runs.
    yield "NaN and infinite floats", pb.GateRequest(groups=[good, pb.GateGroup(task_id="u", rollouts=[nan, nan])],
                                                    config=pb.GateConfig(expand_budget=math.inf)), [
        "groups[1].rollouts[0].speedup", "groups[1].rollouts[1].speedup", "config.expand_budget"]
    config = pb.GateConfig(mode=9, simple_threshold=1.5, catastrophic_stage=PASSED, max_turns=-1,
                           expand_budget=2.0, history_decay=0.0, improve_below_speedup=-2.0)
    yield "bad config", pb.GateRequest(groups=[good], config=config), [
        "config.mode", "config.simple_threshold", "config.catastrophic_stage", "config.max_turns",
        "config.expand_budget", "config.history_decay", "config.improve_below_speedup"]
    yield "group too large", pb.GateRequest(groups=[gate_group("t", 0, size=1025)]), ["groups[0].rollouts"]


@pytest.mark.parametrize("case", list(bad_gate_requests()), ids=lambda case: case[0])
def test_bad_gate_requests_name_every_bad_field(server, case):
    _, request, fields = case
    assert violations_of(stub_for(server.address).Gate, request) == fields


def bad_rank_requests():
    good = pb.RankGroup(trajectories=[trajectory(turn(PASSED, 10, 1.0)), trajectory(turn(RUN))])
    yield "no groups", pb.RankRequest(), ["groups"]
    yield "group of one", pb.RankRequest(groups=[good, pb.RankGroup(trajectories=[trajectory(turn(RUN))])]), [
        "groups[1].trajectories"]
    yield "no turns, unknown stage, negative speedups and tokens", pb.RankRequest(groups=[good, pb.RankGroup(
        trajectories=[
            trajectory(turn(RUN), turn(PASSED), turn(7), turn(PASSED, 10, -math.pi)),
            pb.Trajectory(),
            trajectory(turn(PASSED, -5, -0.5)),
        ])]), ["groups[1].trajectories[0].turns[2].stage", "groups[1].trajectories[0].turns[3].speedup",
               "groups[1].trajectories[1].turns", "groups[1].trajectories[2].turns[0].speedup",
               "groups[1].trajectories[2].turns[0].generated_tokens"]
    inverted = turn(PASSED, 10, 2.0)
    inverted.speedup_low, inverted.speedup_high = 2.5, 3.0
    negative = turn(PASSED, 10, 2.0)
    negative.speedup_low, negative.speedup_high = -1.0, 3.0
    # NaN ends never reach Rank: the runtime refuses every non-finite float first (test_runtime).
    yield "a speedup outside its interval, a negative end", pb.RankRequest(groups=[good, pb.RankGroup(trajectories=[
        trajectory(inverted), trajectory(negative)])]), ["groups[1].trajectories[0].turns[0].speedup_low",
                                                          "groups[1].trajectories[1].turns[0].speedup_low"]
    config = pb.RankConfig(method=7, speedup_margin=-0.1, token_margin=-1.0, turn_discount=1.5,
                           failure_penalty=0.5)
    yield "bad config", pb.RankRequest(groups=[good], config=config), [
        "config.method", "config.speedup_margin", "config.token_margin", "config.turn_discount",
        "config.failure_penalty"]


@pytest.mark.parametrize("case", list(bad_rank_requests()), ids=lambda case: case[0])
def test_bad_rank_requests_name_every_bad_field(server, case):
    _, request, fields = case
    assert violations_of(stub_for(server.address).Rank, request) == fields


def test_an_empty_task_id_in_a_history_read_is_named(server):
    request = pb.GetTaskHistoryRequest(task_ids=["a", ""])
    assert violations_of(stub_for(server.address).GetTaskHistory, request) == ["task_ids[1]"]


def test_zero_speedup_reads_as_not_timed(server):
    group = pb.RankGroup(trajectories=[trajectory(turn(PASSED, 100, 0.0)), trajectory(turn(PASSED, 100, 9.0))])
    (result,) = stub_for(server.address).Rank(pb.RankRequest(groups=[group]), timeout=10).results
    assert [t.reward for t in result.trajectories] == [0, 0]


def test_flagged_speedups_and_intervals_reach_the_tournament(server):
    flagged = turn(PASSED, 100, 30.0)
    flagged.speedup_flagged = True
    honest = turn(PASSED, 100, 1.5)
    honest.speedup_low, honest.speedup_high = 1.2, 1.8
    noisy = turn(PASSED, 100, 1.0)
    noisy.speedup_low, noisy.speedup_high = 0.5, 1.6
    group = pb.RankGroup(trajectories=[trajectory(flagged), trajectory(honest), trajectory(noisy)])
    (result,) = stub_for(server.address).Rank(pb.RankRequest(groups=[group]), timeout=10).results
    assert [t.reward for t in result.trajectories] == [0, 0, 0]  # no speed credit; intervals overlap
    noisy.speedup_high = 1.1
    group = pb.RankGroup(trajectories=[trajectory(honest), trajectory(noisy)])
    (result,) = stub_for(server.address).Rank(pb.RankRequest(groups=[group]), timeout=10).results
    assert [t.reward for t in result.trajectories] == [1, -1]


# The history across restarts of a real `leap serve reward` ---------------------------------


def gate_twice(address: str, step: int) -> pb.GateResponse:
    stub = stub_for(address)
    config = pb.GateConfig(never_solved_after=24)
    return stub.Gate(pb.GateRequest(groups=[gate_group("hard", 8), gate_group(f"step{step}", 2)], config=config),
                     timeout=10)


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_history_survives_a_restart_of_the_service(tmp_path, stop):
    history = str(tmp_path / "reward" / "history.sqlite3")
    with leap_serve("reward", "--history-path", history, "--drain-seconds", "0") as (address, process):
        first = gate_twice(address, 1)
        second = gate_twice(address, 2)
        before = stub_for(address).GetTaskHistory(pb.GetTaskHistoryRequest(), timeout=10).histories
        process.send_signal(signal.SIGTERM if stop == "sigterm" else signal.SIGKILL)
        process.wait(30)
    assert [d.rule for d in (first.decisions[0], second.decisions[0])] == ["expand", "expand"]
    with leap_serve("reward", "--history-path", history, "--drain-seconds", "0") as (address, _process):
        after = stub_for(address).GetTaskHistory(pb.GetTaskHistoryRequest(), timeout=10).histories
        assert after == before
        assert [h.task_id for h in after] == ["hard", "step1", "step2"]
        third = gate_twice(address, 3)
    # The third all-failing group brings "hard" to 24 attempts without a solve, across the restart.
    hard = third.decisions[0]
    assert (hard.rule, hard.history.attempts, hard.history.groups) == ("catastrophic:history", 24, 3)


def leap_serve_fails(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "leap", "serve", "reward", "--port", str(free_port()), *args],
                            check=False, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leap serve: "), result.stderr
    return lines[0]


def test_bad_service_settings_stop_leap_serve_with_one_line(tmp_path):
    assert "simple_threshold: must be in [0, 1]" in leap_serve_fails("--simple-threshold", "2")
    assert "catastrophic_stage: unknown stage 'linking'" in leap_serve_fails("--catastrophic-stage", "linking")
    corrupt = tmp_path / "history.json"
    corrupt.write_text("{half a file")
    assert "cannot read the task history" in leap_serve_fails("--history-path", str(corrupt))
    (tmp_path / "garbage.sqlite3").write_bytes(b"not a database" * 100)
    assert "cannot read the task history" in leap_serve_fails("--history-path", str(tmp_path / "garbage.sqlite3"))
    assert "max_history_tasks: must be at least 1" in leap_serve_fails("--max-history-tasks", "0")
