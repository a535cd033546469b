"""Bounded measurement work: every timed run has its own time limit (not one for all of
them); the memory limit bounds what a candidate allocates, not the inputs it is handed (a
KernelBench problem whose inputs alone are over the limit passes); comparing a large output
costs the service a small fraction of its size (the comparison streams and drops what it
read), measured as the peak RSS of a real `leap serve sandbox` process."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from leap.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.conftest import leap_serve
from tests.sandbox_helpers import KERNELBENCH, RELU_LOOP, Stage, candidate, describe, flags, relu, running_sandbox

MIB = 1 << 20
INPUT_BYTES = 256 * MIB


def test_each_timed_run_has_its_own_time_limit(tmp_path):
    # 150 ms a call, 0.6 s a run: nine calls (trials, warm-up, four pairs) would not fit one limit.
    slow = relu("    usleep(150000);\n" + RELU_LOOP, prelude="#include <unistd.h>\n")
    over = relu("    usleep(900000);\n" + RELU_LOOP, prelude="#include <unistd.h>\n")
    with running_sandbox(tmp_path, workers=1) as sandbox:
        for code in (slow, over):  # compiled (and cached) under the default limit: the stage limit also binds a compile
            assert sandbox.evaluate("relu", code, timing=False, correctness_trials=1).stage == Stage.STAGE_PASSED
        verdict = sandbox.evaluate("relu", slow, stage_timeout_seconds=0.6, timing_trials=4, warmup_runs=1)
        assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
        assert verdict.candidate_timing.trials >= 4 and verdict.calls_per_run == 1
        assert verdict.candidate_timing.median_ms > 140
        late = sandbox.evaluate("relu", over, stage_timeout_seconds=0.6, timing_trials=4, warmup_runs=1)
        assert late.stage == Stage.STAGE_RUN and "TIMEOUT" in flags(late), describe(late)


def test_every_evaluation_of_a_task_runs_the_same_calls_per_run(tmp_path):
    # The first timed evaluation of a task measures its reference's pace before its timed
    # runs; every evaluation runs the same power of two of calls a run, whatever its own warm-up runs measured (sized from
    # them, one honest relu solution got 6 to 128). A candidate too slow for that count in its
    # correctness trials gets fewer (the run keeps inside its time limit).
    slow = relu("    usleep(20000);\n" + RELU_LOOP, prelude="#include <unistd.h>\n")
    with running_sandbox(tmp_path, workers=1) as sandbox:
        verdicts = [sandbox.evaluate("relu", relu(RELU_LOOP)) for _ in range(4)]
        assert all(v.stage == Stage.STAGE_PASSED for v in verdicts), [describe(v) for v in verdicts]
        (calls,) = {v.calls_per_run for v in verdicts}  # the first too: it measured the pace before its runs
        assert calls > 1 and calls & (calls - 1) == 0, calls
        slower = sandbox.evaluate("relu", slow, stage_timeout_seconds=0.4, timing_trials=2, warmup_runs=1)
        assert slower.stage == Stage.STAGE_PASSED, describe(slower)
        assert 1 < slower.calls_per_run < calls and slower.calls_per_run * 0.02 <= 0.4 / 4, slower.calls_per_run


SUM_PROBLEM = f'''
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)


def get_inputs():
    return [torch.randn(1024, {INPUT_BYTES // 4 // 1024})]


def get_init_inputs():
    return []
'''
OUTPUT_BYTES = 96 * MIB  # under the limit: the candidate allocates its output
SHIFT_PROBLEM = SUM_PROBLEM.replace("x.sum(dim=1)", "x + 1.0").replace(str(INPUT_BYTES // 4 // 1024),
                                                                         str(OUTPUT_BYTES // 4 // 1024))
SUM = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n{}        return x.sum(dim=1)\n"
SHIFT = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x + 1.0\n"


def vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.fixture(scope="module")
def big_sandbox(tmp_path_factory):
    pytest.importorskip("torch")
    problems = tmp_path_factory.mktemp("big-problems")
    (problems / "1_Big_sum.py").write_text(SUM_PROBLEM)
    (problems / "2_Big_shift.py").write_text(SHIFT_PROBLEM)
    with leap_serve("sandbox", "--workers", "1", "--task-dirs", str(problems), "--memory-limit-bytes",
                    str(128 * MIB), "--cache-dir", str(tmp_path_factory.mktemp("cache"))) as (address, process):
        with grpc.insecure_channel(address) as channel:
            yield sandbox_pb2_grpc.SandboxServiceStub(channel), process


def evaluate(stub, task_id: str, code: str) -> sandbox_pb2.Verdict:
    request = sandbox_pb2.EvaluateRequest(candidate=candidate(task_id, code, KERNELBENCH),
                                          options=sandbox_pb2.EvaluateOptions(timing=False, correctness_trials=1))
    return stub.Evaluate(request, timeout=600).verdict


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="no /proc/PID/clear_refs to reset the peak RSS")
def test_comparing_a_large_output_streams(big_sandbox):
    stub, process = big_sandbox
    evaluate(stub, "2_Big_shift", SHIFT)  # the problem's probe, PyTorch imported: the service's steady state
    Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    before = vm(process.pid, "VmRSS")
    verdict = evaluate(stub, "2_Big_shift", SHIFT)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    extra = vm(process.pid, "VmHWM") - before
    # The output (and the input, checked for mutation) are in shared memory twice each: the
    # candidate's copy and the reference's. Read whole, that would be 4x the output's size in
    # the service; streamed and dropped chunk by chunk it is a few chunks.
    assert extra <= OUTPUT_BYTES, f"comparing a {OUTPUT_BYTES >> 20} MiB output cost the service {extra >> 20} MiB"


def test_the_memory_limit_bounds_what_the_candidate_allocates_not_its_inputs(big_sandbox):
    stub, _ = big_sandbox
    # 256 MiB of inputs, a 128 MiB limit: handed over in shared memory, they do not count.
    verdict = evaluate(stub, "1_Big_sum", SUM.format(""))
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    # What the candidate allocates does: 192 MiB of its own is over the limit.
    hungry = SUM.format("        hog = torch.ones(192 << 20, dtype=torch.uint8)\n")
    verdict = evaluate(stub, "1_Big_sum", hungry)
    assert verdict.stage == Stage.STAGE_RUN and "MEMORY_LIMIT" in flags(verdict), describe(verdict)
    assert os.path.exists(f"/proc/{big_sandbox[1].pid}")  # the service is fine
