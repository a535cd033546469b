"""The trainer service as a real `leap serve trainer` process: a bad run config is refused
before the run starts, with the reason and the field named."""

from __future__ import annotations

import uuid

import grpc
import pytest
from google.rpc import error_details_pb2

from leap.clients import connect
from leap.runtime.errors import details_of
from leap.trainer.v1 import trainer_pb2
from tests.conftest import free_port, leap_serve
from tests.tiny_lm import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    flags = ["--runs-dir", str(runs), "--policy-address", dead, "--sandbox-address", dead, "--reward-address", dead,
             "--preflight-timeout-seconds", "1"]
    with leap_serve("trainer", *flags) as (address, _process):
        stub = connect("trainer", address, aio=False)
        yield stub
        stub.channel.close()


def refused(stub, config: trainer_pb2.RunConfig) -> dict[str, str]:
    """The fields a StartRun with `config` is refused for, with their reasons."""
    with pytest.raises(grpc.RpcError) as caught:
        stub.StartRun(trainer_pb2.StartRunRequest(request_id=uuid.uuid4().hex, config=config), timeout=30)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    (bad,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    return {v.field: v.description for v in bad.field_violations}


def test_a_missing_model_directory_is_refused(trainer, tmp_path):
    fields = refused(trainer, trainer_pb2.RunConfig(model_path=str(tmp_path / "no-such-model"), steps=1))
    assert "not a directory" in fields["config.model_path"]
    fields = refused(trainer, trainer_pb2.RunConfig(model_path=str(tmp_path), steps=1))
    assert "config.json" in fields["config.model_path"]


@pytest.mark.parametrize("change, field, words", [
    (dict(steps=0), "config.steps", "at least 1"),
    (dict(group_size=1), "config.group_size", "at least 2"),
    (dict(max_turns=-1), "config.max_turns", "at least 1"),
    (dict(tasks_per_step=-3), "config.tasks_per_step", "at least 1"),
    (dict(sampling={"temperature": 0.0}), "config.sampling.temperature", "greedy"),
    (dict(optimizer={"schedule": "linear"}), "config.optimizer.schedule", "constant, cosine"),
    (dict(loss={"clip_low": 1.5}), "config.loss.clip_low", "[0, 1)"),
    (dict(mode=trainer_pb2.TRAIN_MODE_SINGLE, max_turns=3), "config.max_turns", "single-turn"),
    (dict(train_tasks=["relu"], eval_tasks=["relu"]), "config.eval_tasks", "held-out"),
    (dict(eval_train_task_count=-1), "config.eval_train_task_count", "at least 0"),
    (dict(flagged_verdicts=7), "config.flagged_verdicts", "unknown value 7"),
    (dict(report_to=["tensorboard"]), "config.report_to[0]", "must be one of mlflow, wandb, trackio"),
    (dict(report_to=["mlflow", "mlflow"]), "config.report_to[1]", "twice"),
    # a reward that needs speedups from a run that asks for none
    (dict(sandbox_timing=False, rank={"method": "REWARD_METHOD_LOG_SPEEDUP"}), "config.rank.method", "unmeasured"),
    (dict(sandbox_timing=False, gate={"improve_below_speedup": 1.5}), "config.gate.improve_below_speedup",
     "unmeasured"),
])
def test_bad_fields_are_refused_with_the_field_named(trainer, model_dir, change, field, words):
    config = trainer_pb2.RunConfig(model_path=str(model_dir), **{"steps": 2, **change})
    fields = refused(trainer, config)
    assert words in fields[field]


def test_every_bad_field_is_reported_at_once(trainer, tmp_path):
    fields = refused(trainer, trainer_pb2.RunConfig(model_path=str(tmp_path / "x"), steps=0, group_size=1))
    assert {"config.model_path", "config.steps", "config.group_size"} <= set(fields)


def test_unreachable_services_are_refused_naming_each(trainer, model_dir):
    fields = refused(trainer, trainer_pb2.RunConfig(model_path=str(model_dir), steps=1))
    assert set(fields) == {"config.services.policy", "config.services.sandbox", "config.services.reward"}
    assert "unreachable" in fields["config.services.sandbox"]
    config = trainer_pb2.RunConfig(model_path=str(model_dir), steps=1,
                                   services=trainer_pb2.ServiceAddresses(sandbox="127.0.0.1:9"))
    assert "'127.0.0.1:9' is unreachable" in refused(trainer, config)["config.services.sandbox"]


def test_nothing_was_started_by_refused_requests(trainer):
    assert list(trainer.ListRuns(trainer_pb2.ListRunsRequest()).runs) == []


@pytest.mark.parametrize("rgrpo, field, words", [
    (dict(rounds=-1), "config.rgrpo.rounds", "negative"),
    (dict(rounds=2, tau=1.5), "config.rgrpo.tau", "[0, 1]"),
    (dict(rounds=2, alpha=-0.1), "config.rgrpo.alpha", "[0, 1]"),
    (dict(rounds=2, steps_per_round=-1), "config.rgrpo.steps_per_round", "at least 1"),
])
def test_bad_rgrpo_settings_are_refused_with_the_field_named(trainer, model_dir, rgrpo, field, words):
    config = trainer_pb2.RunConfig(model_path=str(model_dir), steps=1, rgrpo=trainer_pb2.RgrpoConfig(**rgrpo))
    assert words in refused(trainer, config)[field]


def test_the_teacher_union_of_an_unknown_run_is_not_found(trainer):
    with pytest.raises(grpc.RpcError) as caught:
        trainer.GetTeacherUnion(trainer_pb2.GetTeacherUnionRequest(run_id="no-such-run"), timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
