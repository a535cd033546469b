"""The SandboxService contract over real gRPC: bad requests name their fields, a missing task
is NOT_FOUND, a full queue is RESOURCE_EXHAUSTED with a retry hint, EvaluateBatch streams
verdicts as they finish, a cancelled batch leaves the service healthy, ListTasks pages and
filters, and `leap serve sandbox` runs as a real process configured by flags."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2

from leap.common.v1 import common_pb2
from leap.runtime.errors import details_of
from leap.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.conftest import leap_serve
from tests.sandbox_helpers import CPU, KERNELBENCH, RELU_LOOP, Stage, candidate, describe, relu, running_sandbox

# Takes 1.5 s whatever the load on the machine (and burns no CPU meanwhile).
SLOW = relu("    usleep(1500000);\n" + RELU_LOOP, prelude="#include <unistd.h>\n")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with running_sandbox(tmp_path_factory.mktemp("service"), workers=2, max_queue=2, max_batch=8,
                         max_source_bytes=4096) as running:
        yield running


def violations(error: grpc.RpcError) -> dict[str, str]:
    (bad,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    return {v.field: v.description for v in bad.field_violations}


def evaluate_error(sandbox, request: sandbox_pb2.EvaluateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.stub.Evaluate(request, timeout=30)
    return caught.value


def test_bad_candidates_are_invalid_argument_naming_every_field(sandbox):
    error = evaluate_error(sandbox, sandbox_pb2.EvaluateRequest())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(error) == {"candidate": "is required"}
    error = evaluate_error(sandbox, sandbox_pb2.EvaluateRequest(candidate=sandbox_pb2.Candidate(source=" ")))
    assert set(violations(error)) == {"candidate.task_id", "candidate.toolchain", "candidate.source"}
    big = sandbox_pb2.Candidate(task_id="relu", toolchain=CPU, source="x" * 5000)
    error = evaluate_error(sandbox, sandbox_pb2.EvaluateRequest(candidate=big))
    assert "limit is 4096" in violations(error)["candidate.source"]
    unknown = sandbox_pb2.Candidate(task_id="relu", toolchain=42, source="int x;")
    assert "unknown toolchain" in violations(evaluate_error(sandbox, sandbox_pb2.EvaluateRequest(candidate=unknown)))[
        "candidate.toolchain"]
    wrong = sandbox_pb2.Candidate(task_id="relu", toolchain=KERNELBENCH, source="class ModelNew: pass")
    assert "supports TOOLCHAIN_CPU" in violations(evaluate_error(sandbox, sandbox_pb2.EvaluateRequest(candidate=wrong)))[
        "candidate.toolchain"]
    ok = sandbox_pb2.Candidate(task_id="relu", toolchain=CPU, source="int x;")
    options = sandbox_pb2.EvaluateOptions(size="huge", correctness_trials=-1, disabled_checks=[99],
                                          stage_timeout_seconds=-1, compiler="icc")
    error = evaluate_error(sandbox, sandbox_pb2.EvaluateRequest(candidate=ok, options=options))
    assert set(violations(error)) == {"options.size", "options.correctness_trials", "options.disabled_checks[0]",
                                      "options.stage_timeout_seconds", "options.compiler"}
    assert "small, large" in violations(error)["options.size"]


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf, 5e-324, 1e-9, -0.5, 3601.0])
def test_a_stage_timeout_that_is_not_a_number_of_seconds_is_invalid(sandbox, seconds):
    request = sandbox_pb2.EvaluateRequest(candidate=candidate("relu", relu(RELU_LOOP)),
                                          options=sandbox_pb2.EvaluateOptions(stage_timeout_seconds=seconds))
    error = evaluate_error(sandbox, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert set(violations(error)) == {"options.stage_timeout_seconds"}
    batch = sandbox_pb2.EvaluateBatchRequest(candidates=[candidate("relu", relu(RELU_LOOP))], options=request.options)
    with pytest.raises(grpc.RpcError) as caught:
        list(sandbox.stub.EvaluateBatch(batch, timeout=30))
    assert set(violations(caught.value)) == {"options.stage_timeout_seconds"}


def test_missing_task_is_not_found_with_resource_info(sandbox):
    error = evaluate_error(sandbox, sandbox_pb2.EvaluateRequest(candidate=sandbox_pb2.Candidate(
        task_id="no_such_task", toolchain=CPU, source="int x;")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    (info,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.ResourceInfo)]
    assert (info.resource_type, info.resource_name) == ("task", "no_such_task")
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.stub.GetTask(sandbox_pb2.GetTaskRequest(task_id="no_such_task"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_failing_candidate_is_a_verdict_not_an_error(sandbox):
    verdict = sandbox.evaluate("relu", "this is not C++ at all {", timing=False)
    assert verdict.stage == Stage.STAGE_FORMAT  # no entry point
    verdict = sandbox.evaluate("relu", "no code block here", timing=False)
    assert verdict.stage == Stage.STAGE_FORMAT
    reply = sandbox.stub.Evaluate(sandbox_pb2.EvaluateRequest(candidate=sandbox_pb2.Candidate(
        task_id="relu", toolchain=CPU, source="just prose, no fence")), timeout=30)
    assert reply.verdict.stage == Stage.STAGE_FORMAT and "code block" in reply.verdict.message
    raw = sandbox.stub.Evaluate(sandbox_pb2.EvaluateRequest(
        candidate=sandbox_pb2.Candidate(task_id="relu", toolchain=CPU, source=relu(RELU_LOOP), candidate_id="raw"),
        options=sandbox_pb2.EvaluateOptions(raw_source=True, timing=False)), timeout=60).verdict
    assert raw.stage == Stage.STAGE_PASSED and raw.candidate_id == "raw", describe(raw)


def test_batch_validation_names_the_candidate(sandbox):
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.stub.EvaluateBatch(sandbox_pb2.EvaluateBatchRequest(), timeout=10).next()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "candidates" in violations(caught.value)
    batch = [candidate("relu", relu(RELU_LOOP)), candidate("relu", relu(RELU_LOOP)),
             sandbox_pb2.Candidate(task_id="relu", toolchain=CPU, source="")]
    with pytest.raises(grpc.RpcError) as caught:
        list(sandbox.stub.EvaluateBatch(sandbox_pb2.EvaluateBatchRequest(candidates=batch), timeout=10))
    assert set(violations(caught.value)) == {"candidates[2].source"}
    too_many = [candidate("relu", relu(RELU_LOOP))] * 9
    with pytest.raises(grpc.RpcError) as caught:
        list(sandbox.stub.EvaluateBatch(sandbox_pb2.EvaluateBatchRequest(candidates=too_many), timeout=10))
    assert "at most 8" in violations(caught.value)["candidates"]


def test_batch_streams_verdicts_as_they_finish(sandbox):
    batch = [candidate("relu", SLOW, CPU, "slow")] + [candidate("relu", relu(RELU_LOOP), CPU, str(i)) for i in range(3)]
    request = sandbox_pb2.EvaluateBatchRequest(candidates=batch, options=sandbox_pb2.EvaluateOptions(timing=False))
    order = [reply.index for reply in sandbox.stub.EvaluateBatch(request, timeout=120)]
    assert sorted(order) == [0, 1, 2, 3] and order[-1] == 0  # the slow one is not waited for


def test_full_queue_is_resource_exhausted_with_a_retry_hint(sandbox):
    # 2 workers + 2 queued: a batch of 4 slow candidates fills it; one more does not fit.
    slow = [candidate("relu", SLOW, CPU, f"slow{i}") for i in range(4)]
    request = sandbox_pb2.EvaluateBatchRequest(candidates=slow, options=sandbox_pb2.EvaluateOptions(timing=False))
    stream = sandbox.stub.EvaluateBatch(request, timeout=120)
    first = threading.Thread(target=lambda: list(stream))
    first.start()
    deadline = time.monotonic() + 30
    while sandbox.servicer.pool.pending < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.evaluate("relu", relu(RELU_LOOP), timing=False)
    first.join()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    (retry,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.RetryInfo)]
    assert retry.retry_delay.ToTimedelta().total_seconds() > 0
    assert sandbox.servicer.pool.pending == 0
    assert sandbox.evaluate("relu", relu(RELU_LOOP), timing=False).stage == Stage.STAGE_PASSED


def test_a_cancelled_batch_frees_its_queue_and_the_service_carries_on(sandbox):
    slow = [candidate("relu", SLOW, CPU, f"c{i}") for i in range(4)]
    stream = sandbox.stub.EvaluateBatch(sandbox_pb2.EvaluateBatchRequest(
        candidates=slow, options=sandbox_pb2.EvaluateOptions(timing=False)), timeout=120)
    time.sleep(0.5)
    stream.cancel()
    deadline = time.monotonic() + 60
    while sandbox.servicer.pool.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox.servicer.pool.pending == 0
    assert sandbox.evaluate("relu", relu(RELU_LOOP), timing=False).stage == Stage.STAGE_PASSED


def test_a_worker_killed_from_outside_is_restarted_and_nothing_is_lost(sandbox):
    zygote = sandbox.servicer.pool.zygotes[0]
    zygote.ensure()
    os.kill(zygote.process.pid, signal.SIGKILL)
    zygote.process.wait(10)
    batch = [candidate("relu", relu(RELU_LOOP + f"\n// restart {i}"), CPU, str(i)) for i in range(4)]
    verdicts = sandbox.batch(batch, timing=False)
    assert all(v.stage == Stage.STAGE_PASSED for v in verdicts), [describe(v) for v in verdicts]
    assert zygote.alive


def test_list_tasks_filters_pages_and_views(sandbox):
    stub = sandbox.stub
    heldout = stub.ListTasks(sandbox_pb2.ListTasksRequest(split="heldout"), timeout=10)
    assert len(heldout.tasks) == 6 and all(t.split == "heldout" for t in heldout.tasks) and not heldout.next_page_token
    assert all(not t.examples for t in heldout.tasks)  # BASIC by default
    ids, token = [], ""
    while True:
        page = stub.ListTasks(sandbox_pb2.ListTasksRequest(page_size=10, page_token=token,
                                                           view=sandbox_pb2.TASK_VIEW_FULL), timeout=10)
        ids += [t.id for t in page.tasks]
        assert all(t.examples for t in page.tasks)
        token = page.next_page_token
        if not token:
            break
    assert ids == sorted(ids) and len(ids) == 25
    cuda = stub.ListTasks(sandbox_pb2.ListTasksRequest(toolchain=common_pb2.TOOLCHAIN_CUDA), timeout=10)
    assert len(cuda.tasks) == 25
    assert not stub.ListTasks(sandbox_pb2.ListTasksRequest(toolchain=KERNELBENCH), timeout=10).tasks
    with pytest.raises(grpc.RpcError) as caught:
        stub.ListTasks(sandbox_pb2.ListTasksRequest(page_token="garbage!", split="test"), timeout=10)
    assert set(violations(caught.value)) == {"page_token", "split"}
    task = stub.GetTask(sandbox_pb2.GetTaskRequest(task_id="gemm", view=sandbox_pb2.TASK_VIEW_FULL), timeout=10).task
    assert len(task.examples) == 6 and "cblas_sgemm" in task.forbidden_calls


def test_leap_serve_sandbox_runs_configured_by_flags(tmp_path):
    with leap_serve("sandbox", "--workers", "1", "--cpu-flags=-O2,-fopenmp", "--cache-dir", str(tmp_path / "c"),
                    "--max-source-bytes", "100000") as (address, _process):
        with grpc.insecure_channel(address) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            reply = stub.Evaluate(sandbox_pb2.EvaluateRequest(
                candidate=candidate("relu", relu(RELU_LOOP)), options=sandbox_pb2.EvaluateOptions(timing=False)),
                timeout=60)
            assert reply.verdict.stage == Stage.STAGE_PASSED, describe(reply.verdict)
            assert "-O2" in reply.verdict.compile.flags and "-O3" not in reply.verdict.compile.flags


def test_the_compile_cache_survives_a_restart(tmp_path):
    code = relu(RELU_LOOP + "\n// survives a restart")
    for run, hit in enumerate((False, True)):
        with running_sandbox(tmp_path / f"run{run}", workers=1, cache_dir=str(tmp_path / "shared-cache")) as sandbox:
            verdict = sandbox.evaluate("relu", code, timing=False)
            assert verdict.stage == Stage.STAGE_PASSED and verdict.compile.cache_hit == hit, describe(verdict)
