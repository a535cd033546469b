"""The distill service over real gRPC: a `leap serve distill` process, a policy service and a
sandbox on threads of this process, a tiny student and two tiny teachers (the same tokenizer,
different weights). Bad configs are refused with the field named; one TU-OPD step brings the
student closer to the target, measured independently through Score; a stopped and resumed run
ends exactly where an uninterrupted one does; and the run RPCs work end to end."""

from __future__ import annotations

import math
import shutil
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from safetensors.torch import load_file

from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.distill.v1 import distill_pb2
from leap.learning import load_tokenizer
from leap.learning.checkpoint import read_state
from leap.learning.data import draw_tasks
from leap.policy.v1 import policy_pb2
from leap.runtime import BackgroundServer
from leap.runtime.errors import details_of
from leap.sandbox.v1 import sandbox_pb2
from leap.tokenization import tokenizer_fingerprint
from leap.union import Teacher, TeacherUnion
from svc_distill.config import tu_opd_config, with_defaults
from svc_distill.losses import target_logps, teacher_weights
from svc_distill.steps import generate_request, score_items
from svc_policy.server import PolicyConfig, build as build_policy
from tests.conftest import free_port, leap_serve
from tests.sandbox_helpers import running_sandbox
from tests.test_runs import wait_for
from tests.test_union import rewrite
from tests.tiny_lm import build_tiny_model

RunState = common_pb2.RunState
CPU = common_pb2.Toolchain.TOOLCHAIN_CPU
TASKS = ("relu", "softmax", "gemm")
# teacher-1 is reliable (q >= 0.5) on relu only, teacher-2 on relu and softmax; gemm has none.
QUALITY = ((0.75, 0.0, 0.25), (0.5, 0.625, 0.0))
TRAIN = ["relu", "softmax"]
TEACHERS = ("teacher-1", "teacher-2")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    student = build_tiny_model(root / "student", seed=0)
    union_dir = root / "union"
    for k in (1, 2):
        build_tiny_model(union_dir / f"teacher-{k}", seed=k)
    write_union(union_dir, tokenizer_fingerprint(load_tokenizer(student)))
    return {"root": root, "student": student, "union": union_dir}


def write_union(directory, fingerprint: str, teachers=None, quality=QUALITY) -> None:
    teachers = teachers or (Teacher("teacher-1", 1, "teacher-1"), Teacher("teacher-2", 2, "teacher-2"))
    TeacherUnion(run_id="rgrpo-test", toolchain="cpu", task_ids=TASKS, teachers=teachers, quality=quality,
                 samples_per_task=8, seed=0, tau=0.5, coverage_by_round=(0.33, 0.67),
                 tokenizer_fingerprint=fingerprint).write(directory)


def start_policy(port: int, models: list[str] | None = None) -> BackgroundServer:
    config = PolicyConfig(port=port, drain_seconds=0.0, grace_seconds=1.0, models=models or [])
    return BackgroundServer(build_policy(config), config).start()


@pytest.fixture(scope="module")
def policy(models):
    server = start_policy(free_port())
    stub = connect("policy", server.address, aio=False)
    yield stub, server.address
    stub.channel.close()
    server.stop()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with running_sandbox(tmp_path_factory.mktemp("sandbox"), workers=1) as running:
        yield running


@pytest.fixture(scope="module")
def distill(models, policy, sandbox):
    flags = ["--runs-dir", str(models["root"] / "runs"), "--student-address", policy[1],
             "--sandbox-address", sandbox.server.address, "--tensorboard", "false", "--preflight-timeout-seconds", "5",
             "--service-retry-seconds", "1"]
    with leap_serve("distill", *flags, log_path=models["root"] / "distill.log") as (address, _process):
        stub = connect("distill", address, aio=False)
        yield stub
        stub.channel.close()


def run_config(models, **changes) -> distill_pb2.DistillConfig:
    """A small run: 2 examples of 2 samples of 16 tokens per step; each run its own student name,
    so runs never share served weights."""
    fields = dict(student_model_path=str(models["student"]), teacher_union_path=str(models["union"]), steps=1,
                  examples_per_step=2, samples_per_example=2, train_tasks=TRAIN, eval_tasks=["silu"], eval_samples=1,
                  sampling=common_pb2.RolloutSampling(max_new_tokens=16),
                  optimizer=common_pb2.OptimizerConfig(learning_rate=1e-3), seed=7)
    return distill_pb2.DistillConfig(**{**fields, **changes})


def start(distill, config) -> distill_pb2.Run:
    return distill.StartRun(distill_pb2.StartRunRequest(request_id=uuid.uuid4().hex, config=config), timeout=60).run


def wait_run(distill, run_id: str, *states) -> distill_pb2.Run:
    def ended():
        run = distill.GetRun(distill_pb2.GetRunRequest(run_id=run_id)).run
        return run if run.state in states or run.state == RunState.RUN_STATE_FAILED else None

    run = wait_for(ended, timeout=300, what=f"run {run_id} in {states}")
    assert run.state in states, run.error
    return run


def refused(distill, config) -> dict[str, str]:
    """The fields a StartRun with `config` is refused for, with their reasons."""
    with pytest.raises(grpc.RpcError) as caught:
        start(distill, config)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    (bad,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.BadRequest)]
    return {v.field: v.description for v in bad.field_violations}


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, field, words", [
    (dict(steps=0), "config.steps", "at least 1"),
    (dict(samples_per_example=-1), "config.samples_per_example", "at least 1"),
    (dict(reliability_threshold=1.5), "config.reliability_threshold", "[0, 1]"),
    (dict(crd_lambda=-1.0), "config.crd_lambda", "0 or more"),
    (dict(sampling=common_pb2.RolloutSampling(temperature=0.0)), "config.sampling.temperature", "greedy"),
    (dict(eval_tasks=["relu"]), "config.eval_tasks", "held-out"),
    (dict(teachers=[distill_pb2.TeacherEndpoint(name="teacher-1")] * 2), "config.teachers[1].name", "twice"),
    (dict(teacher_union_path=""), "config.teacher_union_path", "required"),
    (dict(report_to=["mlflow", "neptune"]), "config.report_to[1]", "must be one of mlflow, wandb, trackio"),
    (dict(samples_per_example=100), "config.samples_per_example", "allows at most 64"),  # the policy's limit, asked
    (dict(sampling=common_pb2.RolloutSampling(max_new_tokens=5000)), "config.sampling.max_new_tokens", "context of"),
    (dict(student_model="../student"), "config.student_model", "path separators"),
    (dict(optimizer=common_pb2.OptimizerConfig(learning_rate=float("inf"))), "config.optimizer.learning_rate", "(0, 1]"),
])
def test_bad_fields_are_refused_with_the_field_named(distill, models, changes, field, words):
    assert words in refused(distill, run_config(models, **changes))[field]


def test_a_quality_matrix_that_does_not_match_the_tasks_is_refused(distill, models, tmp_path):
    teachers = [Teacher(f"teacher-{k}", k, str(models["union"] / f"teacher-{k}")) for k in (1, 2)]
    write_union(tmp_path, "f" * 64, teachers)
    rewrite(tmp_path, quality=[[0.75, 0.0, 0.25, 0.5], [0.5, 0.625, 0.0, 0.5]])
    fields = refused(distill, run_config(models, teacher_union_path=str(tmp_path)))
    assert "quality[0] (teacher 'teacher-1') has 4 values for 3 tasks" in fields["config.teacher_union_path"]
    fields = refused(distill, run_config(models, train_tasks=["relu", "conv2d"]))
    assert "'conv2d' is not a column of the union's quality matrix" in fields["config.train_tasks[1]"]


def test_a_quality_matrix_that_does_not_match_the_teachers_is_refused(distill, models, tmp_path):
    teachers = [Teacher(f"teacher-{k}", k, str(models["union"] / f"teacher-{k}")) for k in (1, 2)]
    write_union(tmp_path, "f" * 64, teachers)
    rewrite(tmp_path, quality=[[0.1, 0.2, 0.3], *map(list, QUALITY)])
    fields = refused(distill, run_config(models, teacher_union_path=str(tmp_path)))
    assert "quality has 3 rows for 2 teachers" in fields["config.teacher_union_path"]


def test_a_teacher_with_another_tokenizer_is_refused_by_name(distill, models, tmp_path):
    shutil.copytree(models["union"] / "teacher-1", tmp_path / "teacher-1")
    build_tiny_model(tmp_path / "teacher-2", seed=2, vocab_size=320)
    write_union(tmp_path, "f" * 64)
    fields = refused(distill, run_config(models, teacher_union_path=str(tmp_path)))
    assert set(fields) == {"config.teacher_union_path"}
    assert "teacher 'teacher-2'" in fields["config.teacher_union_path"]
    assert "tokenizes differently from the student" in fields["config.teacher_union_path"]


def test_a_reliability_threshold_no_teacher_reaches_is_refused(distill, models):
    fields = refused(distill, run_config(models, reliability_threshold=0.8))
    assert "no teacher reaches rho = 0.8 on any training task (the highest pass rate there is 0.75)" \
        in fields["config.reliability_threshold"]
    # Gated off, every teacher teaches: the same threshold is then no reason to refuse.
    ungated = start(distill, run_config(models, reliability_threshold=0.8, disable_reliability_gating=True,
                                        student_model="student-ungated"))
    done = wait_run(distill, ungated.run_id, RunState.RUN_STATE_SUCCEEDED)
    assert done.latest_metrics["skipped_examples"] == 0  # gated at rho 0.8, both examples would be skipped


def test_a_listed_teacher_that_is_not_served_is_refused(distill, models):
    endpoint = distill_pb2.TeacherEndpoint(name="teacher-2", model="nobody")
    fields = refused(distill, run_config(models, teachers=[endpoint]))
    assert "model 'nobody' is not loaded" in fields["config.teachers[0].model"]


# --- one step, measured from outside --------------------------------------------------------------


def k2_to_target(policy, student: str, completions, teacher_logps, weights, quality, loss_config) -> float:
    """Mean over every sampled token of (s_t - T_t)^2 / 2: the k2 estimate of the student's
    per-token KL to the target, with s_t from Score on the policy service."""
    request = policy_pb2.ScoreRequest(model=student, items=score_items(completions), temperature=1.0)
    student_logps = [r.logprobs for r in policy.Score(request, timeout=120).results]
    total, count = 0.0, 0
    for i, s in enumerate(student_logps):
        target = target_logps(teacher_logps[i], quality[:, [i]], weights[:, [i]], loss_config)[0]
        total += float(((torch.tensor(list(s)) - target) ** 2 / 2).sum())
        count += len(s)
    return total / count


def test_one_step_brings_the_student_closer_to_the_target(distill, models, policy, sandbox):
    stub, address = policy
    config = run_config(models, student_model="student-kl")
    filled = with_defaults(config, student_address=address, sandbox_address=sandbox.server.address)
    loss_config = tu_opd_config(filled)
    # The samples the run's step 1 draws: its examples in order, its seed, the initial weights.
    stub.LoadModel(policy_pb2.LoadModelRequest(name="student-kl", path=str(models["student"])), timeout=120)
    drawn, _ = draw_tasks(TRAIN, 2, 0, config.seed)
    tasks = [sandbox.stub.GetTask(sandbox_pb2.GetTaskRequest(task_id=t)).task for t in drawn]
    completions = list(stub.Generate(generate_request("student-kl", tasks, CPU, filled, step=1), timeout=120).completions)

    run = start(distill, config)
    done = wait_run(distill, run.run_id, RunState.RUN_STATE_SUCCEEDED)
    assert done.latest_metrics["tokens"] == sum(len(c.token_ids) for c in completions)  # the very samples it trained on

    # Teachers are frozen: their scores are the same before and after.
    scores = {k: [r.logprobs for r in stub.Score(policy_pb2.ScoreRequest(
        model=f"teacher-{k + 1}", items=score_items(completions), temperature=1.0), timeout=120).results]
        for k in range(2)}
    teacher_logps = [torch.tensor([list(scores[k][i]) for k in range(2)])[:, None, :] for i in range(len(completions))]
    quality = torch.tensor([[QUALITY[k][TASKS.index(drawn[c.prompt_index])] for c in completions] for k in range(2)])
    weights = teacher_weights(quality, loss_config)
    after = k2_to_target(stub, "student-kl", completions, teacher_logps, weights, quality, loss_config)

    stub.UnloadModel(policy_pb2.UnloadModelRequest(name="student-kl"), timeout=60)
    stub.LoadModel(policy_pb2.LoadModelRequest(name="student-kl", path=str(models["student"])), timeout=120)
    before = k2_to_target(stub, "student-kl", completions, teacher_logps, weights, quality, loss_config)
    assert math.isfinite(before) and after < before


# --- resume, and the run API ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(distill, models):
    run = start(distill, run_config(models, steps=2, student_model="student-a"))
    return wait_run(distill, run.run_id, RunState.RUN_STATE_SUCCEEDED)


def final_checkpoint(distill, run_id: str):
    checkpoints = distill.ListCheckpoints(distill_pb2.ListCheckpointsRequest(run_id=run_id)).checkpoints
    return checkpoints[-1]


def test_a_stopped_and_resumed_run_continues_exactly(distill, models, uninterrupted):
    run = start(distill, run_config(models, steps=2, student_model="student-b"))
    # Asked to stop while its first step is under way: it finishes that step, checkpoints, stops.
    assert distill.StopRun(distill_pb2.StopRunRequest(run_id=run.run_id)).run.state == RunState.RUN_STATE_STOPPING
    stopped = wait_run(distill, run.run_id, RunState.RUN_STATE_STOPPED)
    assert stopped.step == 1 and final_checkpoint(distill, run.run_id).step == 1

    distill.ResumeRun(distill_pb2.ResumeRunRequest(run_id=run.run_id))
    events = list(distill.StreamMetrics(distill_pb2.StreamMetricsRequest(run_id=run.run_id)))  # live, to the end
    assert events[-1].event.state == RunState.RUN_STATE_SUCCEEDED
    assert [e.event.step for e in events if e.event.kind == "train"] == [1, 2]  # no step lost or repeated

    pinned, original = TeacherUnion.read(Path(stopped.output_dir) / "union"), TeacherUnion.read(models["union"])
    assert (pinned.task_ids, pinned.quality) == (original.task_ids, original.quality)  # what the run read first
    assert [pinned.model_dir(t) for t in TEACHERS] == [original.model_dir(t) for t in TEACHERS]
    resumed = Path(final_checkpoint(distill, run.run_id).path)
    whole = Path(final_checkpoint(distill, uninterrupted.run_id).path)
    a, b = read_state(resumed), read_state(whole)
    assert (a["step"], a["updates"], a["cursor"]) == (b["step"], b["updates"], b["cursor"]) == (2, 2, {"examples": 4})
    assert_same_tensors(load_file(resumed / "model" / "model.safetensors"), load_file(whole / "model" / "model.safetensors"))
    assert_same_tensors(optimizer_tensors(resumed), optimizer_tensors(whole))


def optimizer_tensors(path) -> dict[str, torch.Tensor]:
    state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)["state"]
    return {f"{name}/{key}": value for name, entry in state.items() for key, value in entry.items()
            if isinstance(value, torch.Tensor)}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-5, atol=1e-6), name


def test_the_run_api_reports_a_finished_run(distill, models, policy, uninterrupted):
    run_id = uninterrupted.run_id
    assert uninterrupted.step == uninterrupted.total_steps == 2
    assert uninterrupted.config.student_address == policy[1] and uninterrupted.config.toolchain == CPU
    assert uninterrupted.config.reliability_threshold == 0.5 and uninterrupted.config.objective == distill_pb2.OBJECTIVE_CRD
    assert {"loss", "kl/target", "kl/teacher/teacher-1", "kl/teacher/teacher-2", "skipped_examples"} \
        <= set(uninterrupted.latest_metrics)
    # gated at rho 0.5: relu has both teachers, softmax teacher-2 alone (each step draws both)
    assert uninterrupted.latest_metrics["skipped_examples"] == 0
    assert uninterrupted.latest_metrics["reliable_teachers_mean"] == 1.5
    # held-out pass@1 through the shared evaluator: the student after training, teachers and union before
    assert {"eval/pass_at_1/turn_1", "eval/teacher/teacher-1/pass_at_1/turn_1", "eval/union/pass_at_1/turn_1"} \
        <= set(uninterrupted.latest_metrics)
    assert run_id in [r.run_id for r in distill.ListRuns(distill_pb2.ListRunsRequest()).runs]
    succeeded = distill.ListRuns(distill_pb2.ListRunsRequest(state=RunState.RUN_STATE_SUCCEEDED)).runs
    assert run_id in [r.run_id for r in succeeded] and all(r.state == RunState.RUN_STATE_SUCCEEDED for r in succeeded)

    replay = list(distill.StreamMetrics(distill_pb2.StreamMetricsRequest(run_id=run_id, no_follow=True)))
    assert [e.event.step for e in replay if e.event.kind == "eval"] == [0, 2]  # before and after
    replay = list(distill.StreamMetrics(distill_pb2.StreamMetricsRequest(run_id=run_id, from_step=2, no_follow=True)))
    assert [e.event.step for e in replay if e.event.kind == "train"] == [2]
    assert [e.event.step for e in replay if e.event.kind == "checkpoint"] == [2]
    assert [c.step for c in distill.ListCheckpoints(distill_pb2.ListCheckpointsRequest(run_id=run_id)).checkpoints] == [2]
    assert (Path(uninterrupted.output_dir) / "metrics.png").is_file()

    models_served = {m.name for m in policy[0].ListModels(policy_pb2.ListModelsRequest()).models}
    assert {"student-a", "teacher-1", "teacher-2"} <= models_served  # teachers loaded by the distiller

    with pytest.raises(grpc.RpcError) as caught:
        distill.StopRun(distill_pb2.StopRunRequest(run_id=run_id))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as caught:
        distill.GetRun(distill_pb2.GetRunRequest(run_id="no-such-run"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


# --- a service that stops answering ---------------------------------------------------------------


def test_a_teacher_that_stops_answering_fails_the_run_with_the_cause_and_it_resumes(distill, models):
    port = free_port()
    teacher_server = start_policy(port, [f"teacher-2={models['union'] / 'teacher-2'}"])
    endpoint = distill_pb2.TeacherEndpoint(name="teacher-2", address=teacher_server.address)
    run = start(distill, run_config(models, steps=2, student_model="student-f", teachers=[endpoint]))
    distill.StopRun(distill_pb2.StopRunRequest(run_id=run.run_id))
    wait_run(distill, run.run_id, RunState.RUN_STATE_STOPPED)
    teacher_server.stop()

    distill.ResumeRun(distill_pb2.ResumeRunRequest(run_id=run.run_id))
    failed = wait_run(distill, run.run_id, RunState.RUN_STATE_FAILED)
    assert failed.error.startswith(f"Score by teacher 'teacher-2': the policy service at {teacher_server.address} "
                                   "did not answer for 1 s (UNAVAILABLE")
    assert failed.step == 1 and final_checkpoint(distill, run.run_id).step == 1  # resumable from the last step done

    teacher_server = start_policy(port, [f"teacher-2={models['union'] / 'teacher-2'}"])
    try:
        distill.ResumeRun(distill_pb2.ResumeRunRequest(run_id=run.run_id))
        assert wait_run(distill, run.run_id, RunState.RUN_STATE_SUCCEEDED).step == 2
    finally:
        teacher_server.stop()
