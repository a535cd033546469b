"""The LEAP loop end to end: real `leap serve` processes for policy, sandbox, reward and
trainer on loopback, the bootstrapped tiny model, real g++ in the sandbox, and the run API
over real gRPC. Steps are few and small (a handful of rollouts) so the file runs in about
two minutes on two cores."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.learning.registry import FAILED, SUCCEEDED
from leap.policy.v1 import policy_pb2
from leap.reward.v1 import reward_pb2
from leap.trainer.v1 import trainer_pb2
from tests.conftest import free_port, leap_serve, wait_for

pytestmark = pytest.mark.slow

# Tasks the tiny model solves some of the time (so groups disagree and advantages are not all 0).
TRAIN_TASKS = ["relu", "sigmoid", "sum_rows", "dot"]


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    """policy, sandbox and reward for the whole module (each run pushes its own weights first)."""
    work = tmp_path_factory.mktemp("services")
    with contextlib.ExitStack() as stack:
        policy, _ = stack.enter_context(leap_serve("policy", "--models", f"policy={tiny_model_dir}"))
        sandbox, _ = stack.enter_context(leap_serve("sandbox", "--workers", "2", "--cache-dir", str(work / "cache")))
        reward, _ = stack.enter_context(leap_serve("reward", "--history-path", ""))
        yield trainer_pb2.ServiceAddresses(policy=policy, sandbox=sandbox, reward=reward)


def trainer_flags(runs: Path, services: trainer_pb2.ServiceAddresses, *extra: str) -> list[str]:
    return ["--runs-dir", str(runs), "--policy-address", services.policy, "--sandbox-address", services.sandbox,
            "--reward-address", services.reward, "--rollout-log", "tokens", "--tensorboard", "false", *extra]


def small_config(model_dir: Path, **overrides) -> trainer_pb2.RunConfig:
    config = trainer_pb2.RunConfig(
        model_path=str(model_dir), steps=1, tasks_per_step=2, group_size=4, max_turns=2, train_tasks=TRAIN_TASKS,
        eval_tasks=["silu"], eval_samples=1, seed=3, sampling=common_pb2.RolloutSampling(max_new_tokens=256),
        optimizer=common_pb2.OptimizerConfig(learning_rate=1e-3))
    for name, value in overrides.items():
        field = getattr(config, name)
        if hasattr(field, "CopyFrom"):
            field.CopyFrom(value)
        elif isinstance(value, list):
            del field[:]
            field.extend(value)
        else:
            setattr(config, name, value)
    return config


def start(trainer, config: trainer_pb2.RunConfig) -> trainer_pb2.Run:
    return trainer.StartRun(trainer_pb2.StartRunRequest(request_id=uuid.uuid4().hex, config=config), timeout=60).run


def follow(trainer, run_id: str) -> list[common_pb2.MetricEvent]:
    """Every event of the run until it ends (the stream closes on a terminal state)."""
    request = trainer_pb2.StreamMetricsRequest(run_id=run_id)
    return [reply.event for reply in trainer.StreamMetrics(request, timeout=600)]


def train_steps(events) -> list[int]:
    return [e.step for e in events if e.kind == "train"]


def serving_version(policy_address: str) -> int:
    stub = connect("policy", policy_address, aio=False)
    try:
        return stub.GetModel(policy_pb2.GetModelRequest(name="policy")).model.version
    finally:
        stub.channel.close()


def test_one_step_changes_the_weights_advances_the_version_and_raises_the_advantage_weighted_logprob(
        services, tiny_model_dir, tmp_path):
    before = serving_version(services.policy)
    with leap_serve("trainer", *trainer_flags(tmp_path / "runs", services)) as (address, _):
        trainer = connect("trainer", address, aio=False)
        run = start(trainer, small_config(tiny_model_dir))
        events = follow(trainer, run.run_id)
        done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
        checkpoints = trainer.ListCheckpoints(trainer_pb2.ListCheckpointsRequest(run_id=run.run_id)).checkpoints
        listed = [r.run_id for r in trainer.ListRuns(trainer_pb2.ListRunsRequest()).runs]
    assert done.state == SUCCEEDED, done.error
    assert done.step == 1 and train_steps(events) == [1] and listed == [run.run_id]
    assert [c.step for c in checkpoints] == [1]
    assert [e.step for e in events if e.kind == "eval"] == [0, 1]  # held-out before and after
    train = next(e for e in events if e.kind == "train").values
    assert train["sandbox/evaluations"] >= 8 and "pass_at_1/turn_2" in train and "time/learn_s" in train
    after = serving_version(services.policy)
    assert after >= before + 2  # the run's starting weights, then the step's update

    # Score the step's own trajectories under the new weights: the policy-gradient objective
    # sum_t A_t log p(token_t) rose. That is what one small optimizer step on the loss
    # guarantees (to first order: Adam's first step moves every weight against its gradient's
    # sign); the mean change of the positive tokens alone is not guaranteed, since shared
    # weights can lower them a little while lowering the negative ones more (seen on one
    # machine's tiny model: -0.014 per positive token, with the objective up).
    records = [json.loads(line) for line in (Path(done.output_dir) / "rollouts" / "step-00000001.jsonl").open()]
    policy = connect("policy", services.policy, aio=False)
    items = [policy_pb2.ScoreItem(prompt_token_ids=r["token_ids"][:1], completion_token_ids=r["token_ids"][1:])
             for r in records]
    scored = policy.Score(policy_pb2.ScoreRequest(model="policy", items=items, temperature=1.0), timeout=120)
    policy.channel.close()
    moved = {+1: [], -1: []}
    objective = 0.0
    for record, result in zip(records, scored.results):
        new = [0.0, *result.logprobs]
        for position, turn in enumerate(record["owner"]):
            advantage = record["turn_advantages"][turn] if turn >= 0 else 0.0
            if advantage:
                change = new[position] - record["sampler_logprobs"][position]
                moved[1 if advantage > 0 else -1].append(change)
                objective += advantage * change
    assert moved[+1] and moved[-1], "the step's groups all tied: no advantage to learn from"
    mean = {sign: sum(values) / len(values) for sign, values in moved.items()}
    tokens = len(moved[+1]) + len(moved[-1])
    # Above the float noise between the sampler's and Score's logprobs of the same weights (at
    # most 1e-4 a token, tests/test_policy_service.py): a step that changed nothing fails here
    # (the step measured here: +0.057 a token).
    assert objective / tokens > 1e-3, (f"the advantage-weighted logprob fell by {-objective:.4f} (mean change of positive "
                           f"tokens {mean[+1]:+.4f}, of negative ones {mean[-1]:+.4f})")
    assert mean[+1] - mean[-1] > 0  # positive tokens gained on negative ones


def test_an_untimed_run_judges_correctness_only_and_reports_no_speed(services, tiny_model_dir, tmp_path):
    # sandbox_timing false: every verdict of the rollouts and of the evaluations is untimed
    # (no speedup, no interval, no timing flag), and no metric reports a speed.
    with leap_serve("trainer", *trainer_flags(tmp_path / "runs", services)) as (address, _):
        trainer = connect("trainer", address, aio=False)
        run = start(trainer, small_config(tiny_model_dir, sandbox_timing=False))
        events = follow(trainer, run.run_id)
        done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
    assert done.state == SUCCEEDED, done.error
    assert [e.kind for e in events if e.kind in ("train", "eval")] == ["eval", "train", "eval"]
    for event in events:
        assert not any(name.startswith("speedup/") for name in event.values), (event.kind, dict(event.values))
    turns = [turn for line in (Path(done.output_dir) / "rollouts" / "step-00000001.jsonl").open()
             for turn in json.loads(line)["turns"]]
    assert turns and any(turn["stage"] == "STAGE_PASSED" for turn in turns)  # the tiny model solves some
    for turn in turns:
        assert turn["speedup"] == 0.0 and turn["speedup_interval"] == [0.0, 0.0], turn["verdict"]
        assert not {"TIMING_UNRELIABLE", "SUSPICIOUS_SPEEDUP", "RETIMED"} & set(turn["flags"])
        if turn["stage"] == "STAGE_PASSED":
            assert "the reference" not in turn["verdict"]  # no "1.09x the reference"
    assert events[-1].values.get("sandbox/flagged_unreliable", 0.0) == 0.0


def checkpoint_state(run_dir: Path, step: int) -> tuple[dict, dict]:
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    weights = load_file(path / "model" / "model.safetensors")
    optimizer = torch.load(path / "optimizer.pt", weights_only=False)
    return weights, optimizer


def assert_same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for name in a[0]:
        torch.testing.assert_close(a[0][name], b[0][name], rtol=0, atol=1e-6, msg=f"weights {name}")
    for name, state in a[1]["state"].items():
        other = b[1]["state"][name]
        assert float(state["step"]) == float(other["step"]), name
        torch.testing.assert_close(state["exp_avg"], other["exp_avg"], rtol=0, atol=1e-7, msg=f"exp_avg {name}")
        torch.testing.assert_close(state["exp_avg_sq"], other["exp_avg_sq"], rtol=0, atol=1e-9, msg=f"exp_avg_sq {name}")


def resumable_config(model_dir: Path) -> trainer_pb2.RunConfig:
    """Two steps of one group, checkpointing every step. Speed cannot decide a rank (a huge
    margin), so timing noise cannot make two runs' advantages differ; the gate's history rule
    is off, so two reward services with different histories decide alike."""
    return small_config(model_dir, steps=2, tasks_per_step=1, group_size=4, checkpoint_every=1,
                        rank=reward_pb2.RankConfig(speedup_margin=1e6), gate=reward_pb2.GateConfig(never_solved_after=-1))


def gate_calls(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines() if "RewardService/Gate" in line)


def test_a_killed_trainer_resumes_with_the_same_step_counter_and_optimizer_state(services, tiny_model_dir, tmp_path):
    config = resumable_config(tiny_model_dir)
    with leap_serve("trainer", *trainer_flags(tmp_path / "whole", services)) as (address, _):
        trainer = connect("trainer", address, aio=False)
        whole = start(trainer, config)
        follow(trainer, whole.run_id)
    runs = tmp_path / "killed"
    reward_log = tmp_path / "reward.log"
    with contextlib.ExitStack() as stack:
        # A reward service of its own, with its history on disk, to count what the killed run records.
        reward, _ = stack.enter_context(leap_serve("reward", "--history-path", str(tmp_path / "history.sqlite3"),
                                                   log_path=reward_log))
        own = trainer_pb2.ServiceAddresses(policy=services.policy, sandbox=services.sandbox, reward=reward)
        with leap_serve("trainer", *trainer_flags(runs, own)) as (address, process):
            trainer = connect("trainer", address, aio=False)
            killed = start(trainer, config)
            first = Path(killed.output_dir) / "checkpoints" / "step-00000001"
            wait_for(first.is_dir, timeout=300, what="the checkpoint of step 1")
            wait_for(lambda: gate_calls(reward_log) >= 2, timeout=300, what="step 2's Gate call")
            os.killpg(process.pid, signal.SIGKILL)  # mid-step, no shutdown, no last checkpoint: as a crash
            process.wait()
        with leap_serve("trainer", *trainer_flags(runs, own)) as (address, _):  # auto_resume picks the run up
            trainer = connect("trainer", address, aio=False)
            events = follow(trainer, killed.run_id)
            resumed = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=killed.run_id)).run
        stub = connect("reward", reward, aio=False)
        histories = stub.GetTaskHistory(reward_pb2.GetTaskHistoryRequest()).histories
        gated = stub.GetStats(reward_pb2.GetStatsRequest()).groups_gated
    assert resumed.state == SUCCEEDED and resumed.step == 2, resumed.error
    # Step 2 was gated, killed and played again; its group is in the history once.
    assert gate_calls(reward_log) >= 3 and sum(h.groups for h in histories) == 2 and gated == 2
    assert train_steps(events) == [1, 2]  # the log was rewound to the checkpoint: no step twice
    a = [json.loads(x)["token_ids"] for x in (Path(whole.output_dir) / "rollouts" / "step-00000002.jsonl").open()]
    b = [json.loads(x)["token_ids"] for x in (Path(resumed.output_dir) / "rollouts" / "step-00000002.jsonl").open()]
    assert a == b, "the resumed run sampled other rollouts at step 2"
    assert_same_state(checkpoint_state(Path(whole.output_dir), 2), checkpoint_state(Path(resumed.output_dir), 2))


def test_a_sandbox_that_goes_away_fails_the_run_with_the_cause_and_resume_finishes_it(services, tiny_model_dir,
                                                                                       tmp_path):
    port = free_port()
    cache = ["--cache-dir", str(tmp_path / "cache")]
    sandbox = contextlib.ExitStack()
    address, process = sandbox.enter_context(leap_serve("sandbox", *cache, port=port))
    own = trainer_pb2.ServiceAddresses(policy=services.policy, sandbox=address, reward=services.reward)
    flags = trainer_flags(tmp_path / "runs", own, "--service-retry-seconds", "2")
    with leap_serve("trainer", *flags) as (trainer_address, _):
        trainer = connect("trainer", trainer_address, aio=False)
        run = start(trainer, small_config(tiny_model_dir, steps=2, tasks_per_step=1, checkpoint_every=10))
        stream = trainer.StreamMetrics(trainer_pb2.StreamMetricsRequest(run_id=run.run_id), timeout=600)
        next(r for r in stream if r.event.kind == "train")  # step 1 is done
        os.killpg(process.pid, signal.SIGKILL)
        sandbox.close()
        failed = [r.event for r in stream][-1]
        record = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
        assert failed.state == FAILED and record.state == FAILED
        assert f"sandbox service at {address} did not answer" in record.error
        checkpoints = trainer.ListCheckpoints(trainer_pb2.ListCheckpointsRequest(run_id=run.run_id)).checkpoints
        assert [c.step for c in checkpoints] == [1]  # saved on the way down: step 1 is not lost

        with leap_serve("sandbox", *cache, port=port):  # back at the same address
            trainer.ResumeRun(trainer_pb2.ResumeRunRequest(run_id=run.run_id))
            events = follow(trainer, run.run_id)
        done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
    assert done.state == SUCCEEDED and done.step == 2, done.error
    assert train_steps(events) == [1, 2]


def test_an_rgrpo_run_leaves_a_teacher_union_that_the_api_and_the_distiller_read(services, tiny_model_dir, tmp_path):
    from leap.union import TeacherUnion

    rgrpo = trainer_pb2.RgrpoConfig(rounds=2, steps_per_round=1, eval_samples=2, tau=0.5)
    config = small_config(tiny_model_dir, rgrpo=rgrpo, train_tasks=TRAIN_TASKS[:3])
    with leap_serve("trainer", *trainer_flags(tmp_path / "runs", services)) as (address, _):
        trainer = connect("trainer", address, aio=False)
        run = start(trainer, config)
        assert run.total_steps == 2
        events = follow(trainer, run.run_id)
        done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
        union = trainer.GetTeacherUnion(trainer_pb2.GetTeacherUnionRequest(run_id=run.run_id)).union
    assert done.state == SUCCEEDED and done.step == 2 and done.round == 2, done.error
    assert [t.name for t in union.teachers] == ["teacher-1", "teacher-2"] and [t.round for t in union.teachers] == [1, 2]
    assert list(union.task_ids) == TRAIN_TASKS[:3] and union.samples_per_task == 2
    rows = [list(row.pass_rates) for row in union.quality]
    assert [len(row) for row in rows] == [3, 3] and all(q in (0.0, 0.5, 1.0) for row in rows for q in row)
    covered = [max(column) >= 0.5 for column in zip(*rows)]
    assert union.coverage_by_round[-1] == pytest.approx(sum(covered) / 3)
    rounds = [e for e in events if e.kind == "eval" and "rgrpo/coverage" in e.values]
    assert [e.step for e in rounds] == [1, 2] and rounds[-1].values["rgrpo/coverage"] == union.coverage_by_round[-1]
    on_disk = TeacherUnion.read(union.path)  # what a distillation run reads: every teacher loadable
    assert on_disk.quality == tuple(map(tuple, rows)) and on_disk.toolchain == "cpu"


def test_a_restarted_policy_is_sent_the_learners_weights_before_the_next_step(services, tiny_model_dir, tmp_path):
    port = free_port()
    serve_policy = lambda: leap_serve("policy", "--models", f"policy={tiny_model_dir}", port=port)  # noqa: E731
    policy = contextlib.ExitStack()
    address, process = policy.enter_context(serve_policy())
    own = trainer_pb2.ServiceAddresses(policy=address, sandbox=services.sandbox, reward=services.reward)
    with leap_serve("trainer", *trainer_flags(tmp_path / "runs", own, "--service-retry-seconds", "60")) as (trainer_address, _):
        trainer = connect("trainer", trainer_address, aio=False)
        run = start(trainer, small_config(tiny_model_dir, steps=2, tasks_per_step=1))
        stream = trainer.StreamMetrics(trainer_pb2.StreamMetricsRequest(run_id=run.run_id), timeout=600)
        first = next(r.event for r in stream if r.event.kind == "train")
        os.killpg(process.pid, signal.SIGKILL)  # the policy forgets every update: it serves version 0 again
        policy.close()
        with serve_policy():
            events = [first, *(r.event for r in stream)]
        done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
    assert done.state == SUCCEEDED and done.step == 2, done.error
    assert any("sending the learner's weights again" in e.message for e in events if e.kind == "log")
    second = next(e for e in events if e.kind == "train" and e.step == 2)
    records = [json.loads(line) for line in (Path(done.output_dir) / "rollouts" / "step-00000002.jsonl").open()]
    versions = {turn["weight_version"] for record in records for turn in record["turns"]}
    assert versions == {second.values["weight_version"] - 1}  # sampled from the re-sent weights, not version 0


@pytest.fixture(scope="module")
def plain_trainer(services, tmp_path_factory):
    """One trainer for the tests below (each starts a trainer of its own above)."""
    runs = tmp_path_factory.mktemp("plain-trainer")
    with leap_serve("trainer", *trainer_flags(runs, services, "--no-signal-warning-steps", "2")) as (address, _):
        trainer = connect("trainer", address, aio=False)
        yield trainer
        trainer.channel.close()


def refused_fields(trainer, config: trainer_pb2.RunConfig) -> dict[str, str]:
    import grpc
    from google.rpc import error_details_pb2

    from leap.runtime.errors import details_of

    with pytest.raises(grpc.RpcError) as caught:
        start(trainer, config)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    (bad,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.BadRequest)]
    return {v.field: v.description for v in bad.field_violations}


def test_a_config_the_services_cannot_serve_is_refused_whole_before_the_run_starts(plain_trainer, tiny_model_dir,
                                                                                   tmp_path):
    config = small_config(tiny_model_dir, group_size=100, eval_samples=100_000, policy_model="../x",
                          sandbox_size="huge", output_dir="/proc/leap-run",
                          sampling=common_pb2.RolloutSampling(max_new_tokens=10**9),
                          optimizer=common_pb2.OptimizerConfig(learning_rate=5.0),
                          gate=reward_pb2.GateConfig(simple_threshold=1.5),
                          rank=reward_pb2.RankConfig(turn_discount=5.0))
    fields = refused_fields(plain_trainer, config)
    assert set(fields) == {"config.group_size", "config.eval_samples", "config.policy_model", "config.sandbox_size",
                           "config.output_dir", "config.sampling.max_new_tokens", "config.optimizer.learning_rate",
                           "config.gate.simple_threshold", "config.rank.turn_discount"}
    assert "allows at most 64" in fields["config.group_size"] and "allows at most 64" in fields["config.eval_samples"]
    assert "'huge' is not a size preset" in fields["config.sandbox_size"]
    assert "context of" in fields["config.sampling.max_new_tokens"]
    assert "path separators" in fields["config.policy_model"]
    # The reward service's own limit, asked with a dry-run Gate: a group larger than its max_group_size.
    assert "reward service" in refused_fields(plain_trainer, small_config(tiny_model_dir, group_size=2000))[
        "config.group_size"]
    # Feedback turns on a model without a chat template are refused; single-turn is not.
    plain = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = json.loads((plain / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    fields = refused_fields(plain_trainer, small_config(plain, eval_turns=2))
    assert set(fields) == {"config.max_turns", "config.eval_turns"} and "no chat template" in fields["config.max_turns"]
    assert list(plain_trainer.ListRuns(trainer_pb2.ListRunsRequest()).runs) == []


def test_a_run_whose_groups_all_tie_says_it_has_no_learning_signal(plain_trainer, tmp_path):
    from tests.tiny_lm import build_tiny_model

    random_init = build_tiny_model(tmp_path / "random-init")  # never writes a kernel: every group ties
    config = small_config(random_init, steps=2, tasks_per_step=1, group_size=2, mode=trainer_pb2.TRAIN_MODE_SINGLE,
                          max_turns=1, eval_turns=1, policy_model="random-init",
                          sampling=common_pb2.RolloutSampling(max_new_tokens=16))
    run = start(plain_trainer, config)
    events = follow(plain_trainer, run.run_id)
    done = plain_trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
    assert done.state == SUCCEEDED, done.error  # the run ends as it would; the warning says what happened
    train = [e for e in events if e.kind == "train"]
    assert [e.values["reward/zero_spread_share"] for e in train] == [1.0, 1.0]
    assert all(e.values["sequences/trained"] == 0 for e in train)
    (warning,) = [e for e in events if e.kind == "warning"]
    assert warning.step == 2 and "no learning signal" in warning.message and warning.values["steps"] == 2
