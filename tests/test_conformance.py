"""`leap conformance`: the suites pass against the project's own five services, run as real
`leap serve` processes, and fail against deliberately broken implementations (real gRPC
servers built on the runtime, so health and reflection are real and only the broken part
differs), so every suite is shown able to fail."""

from __future__ import annotations

import contextlib
import json

import grpc
import pytest

from leap.cli import main
from leap.conformance import Outcome, check_service, failures, suite_of
from leap.reward.v1 import reward_pb2, reward_pb2_grpc
from leap.runtime import BackgroundServer, Registration, ServerConfig, Service, invalid_argument
from leap.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.conftest import free_port, leap_serve
from tests.tiny_lm import build_tiny_model

def report(results) -> str:
    return "\n".join(f"{r.outcome.value} {r.check}: {r.why}" for r in results)


@pytest.fixture(scope="module")
def own_services(tmp_path_factory) -> dict[str, str]:
    """The project's five services as real `leap serve` processes; their addresses by name."""
    tmp = tmp_path_factory.mktemp("stack")
    flags = {
        "policy": ["--models", f"policy={build_tiny_model(tmp / 'model')}"],
        "sandbox": ["--workers", "2", "--cache-dir", str(tmp / "compile-cache")],
        "reward": ["--history-path", str(tmp / "history.json")],
        "trainer": ["--runs-dir", str(tmp / "trainer-runs")],
        "distill": [],
    }
    with contextlib.ExitStack() as stack:  # no drain on SIGTERM: nobody balances load here
        yield {name: stack.enter_context(leap_serve(name, *args, "--drain-seconds", "0"))[0]
               for name, args in flags.items()}


@pytest.mark.parametrize("service", ["policy", "sandbox", "reward", "trainer", "distill"])
def test_own_service_passes_every_check(own_services, service):
    results = check_service(service, own_services[service])
    assert not failures(results), report(results)
    assert not [r for r in results if r.outcome is Outcome.SKIP], report(results)


def test_gate_history_is_untouched_by_conformance(own_services):
    """The dry-run promise, seen from outside: the reward service's history and stats are
    what they were before the suite ran."""
    stub = reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(own_services["reward"]))
    before = stub.GetTaskHistory(reward_pb2.GetTaskHistoryRequest(), timeout=10)
    gated_before = stub.GetStats(reward_pb2.GetStatsRequest(), timeout=10).groups_gated
    check_service("reward", own_services["reward"])
    assert stub.GetTaskHistory(reward_pb2.GetTaskHistoryRequest(), timeout=10) == before
    assert stub.GetStats(reward_pb2.GetStatsRequest(), timeout=10).groups_gated == gated_before


def test_command_prints_a_table_and_exits_zero_when_every_check_passes(own_services, capsys):
    assert main(["conformance", "reward", own_services["reward"]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["CHECK", "RESULT", "WHY"]
    assert f"reward at {own_services['reward']}: 13 passed, 0 failed, 0 skipped" in out


def test_command_json_lists_every_check(own_services, capsys):
    assert main(["conformance", "sandbox", own_services["sandbox"], "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] is True and answer["service"] == "sandbox"
    assert {c["outcome"] for c in answer["checks"]} == {"PASS"}
    assert any(c["rpc"] == "EvaluateBatch" for c in answer["checks"])


def test_command_exits_one_when_a_check_fails(own_services, capsys):
    assert main(["conformance", "trainer", own_services["distill"]]) == 1  # a distiller is no trainer
    assert "FAIL" in capsys.readouterr().out


def test_auth_token_reaches_every_call(monkeypatch, tmp_path):
    from svc_reward.server import SPEC, RewardConfig

    monkeypatch.delenv("LEAP_AUTH_TOKEN", raising=False)
    config = RewardConfig(port=free_port(), history_path="", auth_token="s3cret", drain_seconds=0.0)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with BackgroundServer(SPEC.build(config), config) as server:
        without_token = failures(check_service("reward", server.address))
        assert main(["conformance", "reward", server.address, "--auth-token-file", str(token_file)]) == 0
        monkeypatch.setenv("LEAP_AUTH_TOKEN", "s3cret")
        assert main(["conformance", "reward", server.address]) == 0
    assert without_token and all(r.why.startswith("UNAUTHENTICATED") for r in without_token)


def test_a_token_on_the_command_line_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["conformance", "reward", "127.0.0.1:1", "--auth-token", "s3cret"])
    assert exit.value.code == 2
    assert "cmdline" in capsys.readouterr().err


def test_unknown_service_is_one_friendly_line(capsys):
    assert main(["conformance", "scheduler", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown service 'scheduler'" in err


def test_address_that_does_not_answer_is_one_friendly_line(capsys):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["conformance", "reward", address, "--connect-timeout", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{address} does not answer" in err


# Broken implementations ------------------------------------------------------------------


@contextlib.contextmanager
def serving(service: str, servicer, add_to_server, *, on_start=None, on_stop=None):
    """`servicer` on the LEAP runtime (health, reflection, error mapping); yields its address."""
    name = suite_of(service).full_name
    config = ServerConfig(port=free_port(), drain_seconds=0.0, grace_seconds=1.0)
    built = Service(service, [Registration(name, add_to_server, servicer)], on_start=on_start, on_stop=on_stop)
    with BackgroundServer(built, config) as server:
        yield server.address


class UnfairReward(reward_pb2_grpc.RewardServiceServicer):
    """Gives the first trajectory of a group the whole reward and never checks its input."""

    async def Rank(self, request, context):
        return reward_pb2.RankResponse(results=[
            reward_pb2.RankResult(task_id=group.task_id, trajectories=[
                reward_pb2.TrajectoryReward(reward=1.0 if i == 0 else 0.0) for i in range(len(group.trajectories))])
            for group in request.groups])


def outcomes(results) -> dict[str, tuple[Outcome, str]]:
    return {r.check: (r.outcome, r.why) for r in results}


def test_rewards_that_do_not_sum_to_zero_fail_the_reward_suite():
    with serving("reward", UnfairReward(), reward_pb2_grpc.add_RewardServiceServicer_to_server) as address:
        results = outcomes(check_service("reward", address))
    outcome, why = results["Rank: tournament rewards of a group sum to zero and lie in [-1, 1]"]
    assert outcome is Outcome.FAIL and "sum to 1" in why
    outcome, why = results["Rank with an unset stage is INVALID_ARGUMENT"]
    assert outcome is Outcome.FAIL and why == "answered OK (INVALID_ARGUMENT expected)"
    assert results["health answers SERVING for leap.reward.v1.RewardService"][0] is Outcome.PASS
    assert results["Gate answers"] == (Outcome.FAIL, "UNIMPLEMENTED: Gate is not implemented by this service yet")


class RunsEverything(trainer_pb2_grpc.TrainerServiceServicer):
    """Answers every run id with a run, names the wrong field when StartRun lacks one, and
    ignores page_size."""

    async def GetRun(self, request, context):
        return trainer_pb2.GetRunResponse(run=trainer_pb2.Run(run_id=request.run_id))

    async def ListRuns(self, request, context):
        runs = [trainer_pb2.Run(run_id=f"run-{i}") for i in range(2)]
        return trainer_pb2.ListRunsResponse(runs=runs, next_page_token="more")

    async def StartRun(self, request, context):
        raise invalid_argument("config.steps", "must be at least 1")


def test_a_run_service_that_invents_runs_fails_the_trainer_suite():
    with serving("trainer", RunsEverything(), trainer_pb2_grpc.add_TrainerServiceServicer_to_server) as address:
        results = outcomes(check_service("trainer", address))
    assert results["GetRun of an unknown run is NOT_FOUND"] == (Outcome.FAIL, "answered OK (NOT_FOUND expected)")
    outcome, why = results["StartRun without request_id and config is INVALID_ARGUMENT naming both"]
    assert outcome is Outcome.FAIL and "names ['config.steps'], not request_id" in why
    outcome, why = results["ListRuns pages with next_page_token, no run twice"]
    assert outcome is Outcome.FAIL and why == "a page of page_size 1 held 2 runs"


def test_a_sandbox_that_reports_failing_kernels_as_errors_fails_the_sandbox_suite(tmp_path):
    """The classic mistake: a kernel that does not compile becomes an RPC error instead of a
    verdict. The real sandbox servicer, with only its Evaluate wrapped."""
    from leap.common.v1 import common_pb2
    from leap.sandbox.v1 import sandbox_pb2_grpc
    from svc_sandbox.server import SandboxConfig, SandboxServicer

    servicer = SandboxServicer(SandboxConfig(workers=1, cache_dir=str(tmp_path / "cache")))
    real_evaluate = servicer.Evaluate

    async def evaluate_failures_as_errors(request, context):
        reply = await real_evaluate(request, context)
        if reply.verdict.stage != common_pb2.STAGE_PASSED:
            raise invalid_argument("candidate.source", reply.verdict.message)
        return reply

    servicer.Evaluate = evaluate_failures_as_errors
    with serving("sandbox", servicer, sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
                 on_start=servicer.on_start, on_stop=servicer.on_stop) as address:
        results = outcomes(check_service("sandbox", address))
    outcome, why = results["a broken example is a verdict below STAGE_PASSED in a successful response"]
    assert outcome is Outcome.FAIL and why.startswith("INVALID_ARGUMENT")
    assert results["a task's own solution evaluates to STAGE_PASSED"][0] is Outcome.PASS


def test_a_sandbox_that_compiles_unfenced_responses_fails_the_fence_check(tmp_path):
    """What Candidate.source's comment used to promise (the whole text when there is no fence)
    against what the contract says now (STAGE_FORMAT without raw_source). The real sandbox
    servicer, with only its Evaluate wrapped to take unfenced text as code."""
    from leap.sandbox.v1 import sandbox_pb2_grpc
    from svc_sandbox.server import SandboxConfig, SandboxServicer

    servicer = SandboxServicer(SandboxConfig(workers=1, cache_dir=str(tmp_path / "cache")))
    real_evaluate = servicer.Evaluate

    async def whole_text_without_a_fence(request, context):
        if "```" not in request.candidate.source:
            request.options.raw_source = True
        return await real_evaluate(request, context)

    servicer.Evaluate = whole_text_without_a_fence
    with serving("sandbox", servicer, sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
                 on_start=servicer.on_start, on_stop=servicer.on_stop) as address:
        results = outcomes(check_service("sandbox", address))
    outcome, why = results["a response without a fenced code block stops at STAGE_FORMAT unless options.raw_source"]
    assert outcome is Outcome.FAIL and "STAGE_PASSED (STAGE_FORMAT expected" in why
    assert results["a task's own solution evaluates to STAGE_PASSED"][0] is Outcome.PASS
