"""Runs as resources (leap.learning.registry and run_api), shared by the trainer and the
distiller: lifecycle, persistence across a restart, the event log with live followers, and
the run RPCs over a real gRPC server. The job is `tests.run_jobs.CountingJob`, which keeps a
real job's contract (metrics, checkpoints, stop, failure) without a model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2

from leap.clients import connect
from leap.learning.metrics import MetricsLog, plot_metrics, series
from leap.learning.registry import (
    FAILED, PENDING, RUNNING, STOPPED, SUCCEEDED, DirLock, OutputDirTaken, RequestConflict, RunNotFound, RunRegistry,
    RunStateError,
)
from leap.learning.run_api import RunApi
from leap.runtime import BackgroundServer, Registration, ServerConfig, Service, Violations
from leap.runtime.errors import details_of
from leap.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from tests.conftest import free_port, wait_for
from tests.run_jobs import factory


def wait_state(registry, run_id, *states, timeout: float = 30.0):
    return wait_for(lambda: (r := registry.get(run_id)).state in states and r, timeout, f"states {states}")


def start(registry, request_id, steps=6, **job):
    record, created = registry.start(request_id, {"steps": steps, "job": job}, f"fp-{request_id}-{steps}-{job}", steps)
    return record


@pytest.fixture
def registry(tmp_path):
    opened = RunRegistry(tmp_path / "runs", factory(step_seconds=0.02), tensorboard=False).open()
    yield opened
    opened.close(timeout=10)


def train_steps(registry, run_id):
    return [e["step"] for e in registry.metrics_log(run_id).read() if e["kind"] == "train"]


# --- the registry -----------------------------------------------------------------------------


def test_a_run_goes_from_pending_to_succeeded_with_metrics_and_checkpoints(registry):
    record = start(registry, "r1", steps=5)
    assert record.state in (PENDING, RUNNING)
    done = wait_state(registry, record.run_id, SUCCEEDED)
    assert done.step == 5 and done.latest_metrics["loss"] == pytest.approx(0.2)
    assert train_steps(registry, record.run_id) == [1, 2, 3, 4, 5]
    assert [c.step for c in registry.checkpoints(record.run_id)] == [2, 4, 5]
    states = [e["message"] for e in registry.metrics_log(record.run_id).read() if e["kind"] == "state"]
    assert states[0] == "accepted" and states[-1] == "finished 5 steps"


def test_start_is_idempotent_by_request_id(registry):
    first, created = registry.start("same", {"steps": 3}, "fp", 3)
    again, created_again = registry.start("same", {"steps": 3}, "fp", 3)
    assert created and not created_again and first.run_id == again.run_id
    with pytest.raises(RequestConflict):
        registry.start("same", {"steps": 4}, "other-fp", 4)


def test_stop_ends_after_the_current_step_with_a_checkpoint_and_resume_finishes_without_repeats(registry):
    record = start(registry, "stop-me", steps=200, step_seconds=0.02, checkpoint_every=1000)
    wait_for(lambda: registry.get(record.run_id).step >= 3, what="three steps")
    registry.stop(record.run_id)
    stopped = wait_state(registry, record.run_id, STOPPED)
    checkpoints = registry.checkpoints(record.run_id)
    assert checkpoints and checkpoints[-1].step == stopped.step  # a checkpoint of the very step it stopped at
    assert stopped.step < 200
    with pytest.raises(RunStateError):
        registry.stop(record.run_id)

    registry.resume(record.run_id)
    done = wait_state(registry, record.run_id, SUCCEEDED, timeout=60)
    assert done.step == 200 and done.attempts == 2
    assert train_steps(registry, record.run_id) == list(range(1, 201))  # no step lost or reported twice


def test_a_failing_job_leaves_a_failed_run_with_its_cause_and_a_resumable_checkpoint(registry):
    record = start(registry, "fails", steps=6, fail_at_step=4)
    failed = wait_state(registry, record.run_id, FAILED)
    assert failed.error == "sandbox at 127.0.0.1:1 stopped answering at step 4"
    assert registry.checkpoints(record.run_id)[-1].step == 3
    with pytest.raises(RunStateError):
        registry.stop(record.run_id)  # it has ended
    with pytest.raises(RunNotFound):
        registry.get("missing")


def test_pending_runs_wait_for_a_worker_and_can_be_stopped_before_starting(tmp_path):
    hold = threading.Event()
    registry = RunRegistry(tmp_path, factory(step_seconds=0.0, hold=hold), tensorboard=False).open()
    try:
        busy = start(registry, "busy", steps=2)
        waiting = start(registry, "waiting", steps=2)
        assert registry.get(waiting.run_id).state == PENDING  # one worker, and it is busy
        registry.stop(waiting.run_id)
        assert registry.get(waiting.run_id).state == STOPPED
        hold.set()
        wait_state(registry, busy.run_id, SUCCEEDED)
        assert registry.get(waiting.run_id).state == STOPPED and registry.get(waiting.run_id).attempts == 0
    finally:
        hold.set()
        registry.close(timeout=10)


def test_list_pages_newest_first_with_a_state_filter(registry):
    ids = []
    for index in range(5):
        ids.append(start(registry, f"page-{index}", steps=1).run_id)
        time.sleep(0.01)
    for run_id in ids:
        wait_state(registry, run_id, SUCCEEDED)
    seen, token = [], ""
    while True:
        page, token = registry.list(page_size=2, page_token=token)
        assert len(page) <= 2
        seen += [r.run_id for r in page]
        if not token:
            break
    assert seen == list(reversed(ids))
    assert [r.run_id for r in registry.list(state=SUCCEEDED)[0]] == list(reversed(ids))
    assert registry.list(state=FAILED) == ([], "")
    with pytest.raises(ValueError):
        registry.list(page_token="not-a-token")


def test_runs_survive_a_restart_and_an_interrupted_run_resumes_from_its_checkpoint(tmp_path):
    root = tmp_path / "runs"
    first = RunRegistry(root, factory(step_seconds=0.02), tensorboard=False).open()
    record = start(first, "survivor", steps=12, checkpoint_every=2)
    wait_for(lambda: first.get(record.run_id).step >= 5, what="five steps")
    first.stop(record.run_id)
    wait_state(first, record.run_id, STOPPED)
    first.close()
    # What a process killed mid-run leaves on disk: the record still says RUNNING, at a step
    # after its last checkpoint.
    run_file = root / record.run_id / "run.json"
    data = json.loads(run_file.read_text())
    last_checkpoint = max(c.step for c in first.checkpoints(record.run_id))
    data.update(state=RUNNING, step=last_checkpoint + 1)
    run_file.write_text(json.dumps(data))

    second = RunRegistry(root, factory(step_seconds=0.02), tensorboard=False).open()
    try:
        events = second.metrics_log(record.run_id).read()
        assert any("interrupted" in e["message"] for e in events if e["kind"] == "state")
        done = wait_state(second, record.run_id, SUCCEEDED)
        assert done.step == 12 and done.request_id == "survivor"
        assert train_steps(second, record.run_id) == list(range(1, 13))
        assert second.find_request("survivor").run_id == record.run_id
    finally:
        second.close()


def test_without_auto_resume_an_interrupted_run_waits_as_failed(tmp_path):
    first = RunRegistry(tmp_path, factory(step_seconds=0.0), tensorboard=False).open()
    record = start(first, "x", steps=2)
    wait_state(first, record.run_id, SUCCEEDED)
    first.close()
    run_file = tmp_path / record.run_id / "run.json"
    run_file.write_text(json.dumps({**json.loads(run_file.read_text()), "state": RUNNING}))
    second = RunRegistry(tmp_path, factory(), auto_resume=False, tensorboard=False).open()
    failed = second.get(record.run_id)
    assert failed.state == FAILED and "interrupted" in failed.error and "step 2" in failed.error


def test_events_replay_from_a_step_then_follow_live_until_the_run_ends(registry):
    record = start(registry, "followed", steps=30, step_seconds=0.03)
    wait_for(lambda: registry.get(record.run_id).step >= 2, what="two steps")

    async def collect(from_step, follow):
        return [e async for e in registry.events(record.run_id, from_step, follow)]

    followed = asyncio.run(collect(0, True))
    train = [e["step"] for e in followed if e["kind"] == "train"]
    assert train == list(range(1, 31))
    assert followed[-1]["kind"] == "state" and followed[-1]["state"] == SUCCEEDED
    assert [e["seq"] for e in followed] == sorted({e["seq"] for e in followed})  # in order, none twice
    later = asyncio.run(collect(25, False))
    assert [e["step"] for e in later if e["kind"] == "train"] == [25, 26, 27, 28, 29, 30]


def test_metrics_log_rewind_tensorboard_and_plot(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.append({"run_id": "r", "step": step, "time": 1000.0 + step, "kind": "train",
                    "values": {"loss": 1.0 / step, "pass_at_1/turn_1": step / 10}})
    log.append({"run_id": "r", "step": 5, "time": 1006.0, "kind": "eval", "values": {"pass_at_1/turn_1": 0.4}})
    log.rewind(3)
    log.append({"run_id": "r", "step": 4, "time": 1010.0, "kind": "train", "values": {"loss": 0.3}})
    log.close()
    events = MetricsLog(tmp_path, tensorboard=False).read()
    assert [(e["kind"], e["step"]) for e in events] == [("train", 1), ("train", 2), ("train", 3), ("train", 4)]
    assert series(events, "train", "loss")[1] == [1.0, 0.5, pytest.approx(1 / 3), 0.3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert [s.step for s in board.Scalars("train/loss")] == [1, 2, 3, 4]  # purged after the rewind
    png = plot_metrics(events, tmp_path / "curves.png", title="r")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the run RPCs over gRPC -------------------------------------------------------------------


class CountingTrainer(RunApi, trainer_pb2_grpc.TrainerServiceServicer):
    """The trainer contract's run RPCs over a registry of counting jobs: what a learner
    service's servicer looks like on top of leap.learning."""

    messages = trainer_pb2

    def __init__(self, registry):
        self.registry = registry

    async def prepare_config(self, config):
        Violations().check(config.steps >= 1, "config.steps", "must be at least 1").raise_if_any()
        filled = trainer_pb2.RunConfig()
        filled.CopyFrom(config)
        filled.checkpoint_every = config.checkpoint_every or 10
        return filled, config.steps


@pytest.fixture
def trainer(tmp_path):
    registry = RunRegistry(tmp_path / "runs", factory(step_seconds=0.02, checkpoint_every=3), tensorboard=False).open()
    service = Service("trainer", [Registration("leap.trainer.v1.TrainerService",
                                               trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                                               CountingTrainer(registry))])
    with BackgroundServer(service, ServerConfig(port=free_port(), drain_seconds=0.0)) as server:
        stub = connect("trainer", server.address, aio=False)
        yield stub
        stub.channel.close()
    registry.close(timeout=10)


def start_request(request_id, steps=4, **fields):
    return trainer_pb2.StartRunRequest(request_id=request_id, config=trainer_pb2.RunConfig(
        model_path="/models/x", steps=steps, **fields))


def rpc_error(call, *args):
    with pytest.raises(grpc.RpcError) as caught:
        call(*args)
    return caught.value


def wait_run(stub, run_id, state):
    return wait_for(lambda: (run := stub.GetRun(trainer_pb2.GetRunRequest(run_id=run_id)).run).state == state and run,
                    what=f"state {state}")


def test_run_api_start_get_stream_and_checkpoints(trainer):
    run = trainer.StartRun(start_request("grpc-1", steps=7, display_name="seven")).run
    assert run.run_id and run.config.checkpoint_every == 10 and run.total_steps == 7
    assert trainer.StartRun(start_request("grpc-1", steps=7, display_name="seven")).run.run_id == run.run_id
    events = list(trainer.StreamMetrics(trainer_pb2.StreamMetricsRequest(run_id=run.run_id)))
    assert [e.event.step for e in events if e.event.kind == "train"] == list(range(1, 8))
    assert events[-1].event.state == SUCCEEDED and events[-1].event.values == {} and events[0].event.run_id == run.run_id
    finished = wait_run(trainer, run.run_id, SUCCEEDED)
    assert finished.step == 7 and finished.latest_metrics["loss"] == pytest.approx(1 / 7)
    assert finished.update_time.ToSeconds() >= finished.create_time.ToSeconds()
    checkpoints = trainer.ListCheckpoints(trainer_pb2.ListCheckpointsRequest(run_id=run.run_id)).checkpoints
    assert [c.step for c in checkpoints] == [3, 6, 7] and all(c.size_bytes > 0 for c in checkpoints)
    replay = trainer.StreamMetrics(trainer_pb2.StreamMetricsRequest(run_id=run.run_id, from_step=6, no_follow=True))
    assert [e.event.step for e in replay if e.event.kind == "train"] == [6, 7]


def test_run_api_stop_resume_and_list(trainer):
    long = trainer.StartRun(start_request("long", steps=500)).run
    queued = trainer.StartRun(start_request("queued", steps=2)).run
    assert trainer.GetRun(trainer_pb2.GetRunRequest(run_id=queued.run_id)).run.state == PENDING
    page = trainer.ListRuns(trainer_pb2.ListRunsRequest(page_size=1))
    assert [r.run_id for r in page.runs] == [queued.run_id] and page.next_page_token
    rest = trainer.ListRuns(trainer_pb2.ListRunsRequest(page_size=1, page_token=page.next_page_token))
    assert [r.run_id for r in rest.runs] == [long.run_id] and not rest.next_page_token
    assert [r.run_id for r in trainer.ListRuns(trainer_pb2.ListRunsRequest(state=PENDING)).runs] == [queued.run_id]

    wait_for(lambda: trainer.GetRun(trainer_pb2.GetRunRequest(run_id=long.run_id)).run.step >= 2, what="progress")
    assert trainer.StopRun(trainer_pb2.StopRunRequest(run_id=long.run_id)).run.state in (3, STOPPED)  # STOPPING first
    stopped = wait_run(trainer, long.run_id, STOPPED)
    wait_run(trainer, queued.run_id, SUCCEEDED)  # the queue moved on
    resumed = trainer.ResumeRun(trainer_pb2.ResumeRunRequest(run_id=long.run_id)).run
    assert resumed.state in (PENDING, RUNNING)
    wait_for(lambda: trainer.GetRun(trainer_pb2.GetRunRequest(run_id=long.run_id)).run.step > stopped.step,
             what="progress after the resume")
    trainer.StopRun(trainer_pb2.StopRunRequest(run_id=long.run_id))
    wait_run(trainer, long.run_id, STOPPED)


def test_run_api_errors_name_the_field_or_the_state(trainer):
    error = rpc_error(trainer.StartRun, trainer_pb2.StartRunRequest(config=trainer_pb2.RunConfig(steps=1)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    (bad,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    assert [v.field for v in bad.field_violations] == ["request_id"]
    error = rpc_error(trainer.StartRun, start_request("zero", steps=0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "config.steps" in error.details()

    error = rpc_error(trainer.GetRun, trainer_pb2.GetRunRequest(run_id="nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert rpc_error(trainer.GetRun, trainer_pb2.GetRunRequest()).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_error(trainer.ListRuns, trainer_pb2.ListRunsRequest(page_token="garbage")).code() \
        == grpc.StatusCode.INVALID_ARGUMENT

    run = trainer.StartRun(start_request("short", steps=1)).run
    wait_run(trainer, run.run_id, SUCCEEDED)
    error = rpc_error(trainer.StopRun, trainer_pb2.StopRunRequest(run_id=run.run_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    (info,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert info.reason == "RUN_NOT_ACTIVE"
    error = rpc_error(trainer.ResumeRun, trainer_pb2.ResumeRunRequest(run_id=run.run_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "SUCCEEDED" in error.details()
    error = rpc_error(trainer.StartRun, start_request("short", steps=2))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "different config" in error.details()
    assert rpc_error(trainer.GetTeacherUnion, trainer_pb2.GetTeacherUnionRequest(run_id=run.run_id)).code() \
        == grpc.StatusCode.UNIMPLEMENTED


# --- one run owns its output directory ----------------------------------------------------------


def test_a_second_run_naming_an_owned_output_dir_is_refused_naming_it(registry, tmp_path):
    shared = tmp_path / "shared-out"
    first, _ = registry.start("owner", {"steps": 2}, "fp-owner", 2, output_dir=str(shared))
    wait_state(registry, first.run_id, SUCCEEDED)
    with pytest.raises(OutputDirTaken) as caught:  # even after it ended: its checkpoints are there
        registry.start("intruder", {"steps": 2}, "fp-intruder", 2, output_dir=str(shared / "." ))
    assert str(shared) in str(caught.value) and first.run_id in str(caught.value)
    # Another service (another registry: another process's runs) is refused through the owner file.
    other = RunRegistry(tmp_path / "other-runs", factory(step_seconds=0.01), tensorboard=False).open()
    try:
        with pytest.raises(OutputDirTaken) as caught:
            other.start("elsewhere", {"steps": 2}, "fp-elsewhere", 2, output_dir=str(shared))
        assert first.run_id in str(caught.value)
        stale = tmp_path / "old-run"  # a run of an older version: checkpoints but no owner file
        (stale / "checkpoints").mkdir(parents=True)
        with pytest.raises(OutputDirTaken) as caught:
            other.start("stale", {"steps": 2}, "fp-stale", 2, output_dir=str(stale))
        assert "checkpoints of an earlier run" in str(caught.value)
        assert [r.run_id for r in other.list()[0]] == [] and not (stale / ".leap-run").exists()
    finally:
        other.close(timeout=10)
    assert train_steps(registry, first.run_id) == [1, 2]  # nothing of the refused runs in its events


LOCK_HOLDER = """
import sys, time
from leap.learning.registry import DirLock
DirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_the_output_dir_lock_refuses_a_second_process_and_dies_with_its_holder(registry, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    directory = tmp_path / "locked-out"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(directory)], cwd=ROOT, env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirTaken) as caught:
            DirLock(directory).acquire()
        assert f"process {holder.pid}" in str(caught.value)
        with pytest.raises(OutputDirTaken):  # a new run there is refused while a process trains in it
            registry.start("while-locked", {"steps": 2}, "fp-wl", 2, output_dir=str(directory))
        os.kill(holder.pid, signal.SIGKILL)  # the holder dies without releasing anything
        holder.wait(30)
        DirLock(directory).acquire().release()  # the kernel dropped its lock
        run, _ = registry.start("after", {"steps": 2}, "fp-after", 2, output_dir=str(directory))
        assert wait_state(registry, run.run_id, SUCCEEDED).step == 2
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_run_whose_directory_another_process_trains_in_fails_with_the_reason(registry, tmp_path):
    hold = threading.Event()
    registry.job_factory = factory(step_seconds=0.01, hold=hold)  # runs wait on `hold`
    blocker = start(registry, "blocker", steps=1)  # holds the one worker
    directory = tmp_path / "busy"
    queued, _ = registry.start("queued", {"steps": 2}, "fp-queued", 2, output_dir=str(directory))
    assert registry.get(queued.run_id).state == PENDING
    lock = DirLock(directory).acquire()  # another open file: flock conflicts as with another process
    try:
        hold.set()  # the blocker ends; the queued run's worker finds its directory locked
        failed = wait_state(registry, queued.run_id, FAILED)
    finally:
        lock.release()
    assert wait_state(registry, blocker.run_id, SUCCEEDED)
    assert "is in use: process" in failed.error and str(directory) in failed.error and failed.step == 0
    registry.resume(queued.run_id)  # the lock is free again: the run trains
    assert wait_state(registry, queued.run_id, SUCCEEDED).step == 2


def test_run_api_refuses_a_taken_or_unusable_output_dir_with_the_right_code(trainer, tmp_path):
    shared = str(tmp_path / "out")
    run = trainer.StartRun(start_request("dir-1", steps=1, output_dir=shared)).run
    error = rpc_error(trainer.StartRun, start_request("dir-2", steps=1, output_dir=shared))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert shared in error.details() and run.run_id in error.details()
    (info,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert info.reason == "OUTPUT_DIR_IN_USE"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for bad in ("/proc/self/leap-out", "/sys/kernel/x", str(blocker), str(blocker / "below"), "x" * 5000):
        error = rpc_error(trainer.StartRun, start_request(f"bad-{len(bad)}-{bad[-3:]}", steps=1, output_dir=bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        (bad_request,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
        assert [v.field for v in bad_request.field_violations] == ["config.output_dir"], bad
