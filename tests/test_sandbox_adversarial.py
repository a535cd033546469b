"""The measurement trust boundary, attacked: real candidates written to fool the timing or the
checks, through a real SandboxService, each expecting the verdict it must get: failed at the
right stage, or passed with the speed it honestly has (the trick gains nothing). After each,
the service is SERVING, no candidate process is left and no job directory remains.

What a candidate could try, having read the harness (svc_sandbox/trust.py says what the
service believes and why):
- talk to the service: write a timing frame (or anything) to fd 3, which was the service's
  socket and is now its one-byte channel to the zygote; answer "done" early; claim a huge
  frame;
- remember results: cache them on a fingerprint of the inputs (every timed call's inputs
  are new), compute only on the calls it guesses are checked, or only at first;
- work outside the timed region: write its outputs after answering "done", leave a thread
  spinning to slow the reference, start a process that is not stopped with it;
- KernelBench: rebind the clocks it can reach (the harness's module, time, sys.modules),
  return a view of its inputs, change them in place.
Escapes (reading secrets, files, the network, killing the service) are the confinement's
tests (test_sandbox_isolation.py).
"""

from __future__ import annotations

import os
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leap import tasks
from tests.sandbox_helpers import (AS_ROOT, CPU, KERNELBENCH, RELU_LOOP, Check, Stage, describe, flags,
                                   processes_in, processes_of_uids, relu, running_sandbox)

WORKERS = 2
FAST = {"timing_trials": 4, "warmup_runs": 1}
NO_STATIC = {**FAST, "disabled_checks": [Check.CHECK_STATIC]}
TASK = "level1/7_Scale_relu"
PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return torch.relu(x * self.scale)


def get_inputs():
    return [torch.randn(256, 512)]


def get_init_inputs():
    return [512]
'''


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    problems = tmp_path_factory.mktemp("kernelbench")
    (problems / "level1").mkdir()
    (problems / "level1" / "7_Scale_relu.py").write_text(PROBLEM)
    with running_sandbox(tmp_path_factory.mktemp("adversarial"), workers=WORKERS, task_dirs=[str(problems)],
                         timing_max_runs=12, timing_budget_seconds=1.0) as running:
        yield running


@pytest.fixture(autouse=True)
def clean_afterwards(request):
    yield
    if "sandbox" in request.fixturenames:
        sandbox = request.getfixturevalue("sandbox")
        health = health_pb2_grpc.HealthStub(sandbox.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        jobs = sandbox.work_dir / "jobs"
        deadline = time.monotonic() + 5
        while (processes_in(jobs) or os.listdir(jobs)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes_in(jobs), "a candidate process is left"
        assert not os.listdir(jobs), f"job directories are left: {os.listdir(jobs)}"
        if AS_ROOT:
            assert not processes_of_uids(sandbox.servicer.uids)


def solution(task_id: str) -> str:
    return tasks.examples(tasks.get_task(task_id), CPU, tasks.ExampleKind.EXAMPLE_KIND_SOLUTION)[0].source


@pytest.fixture(scope="module")
def honest(sandbox):
    """The honest relu solution's verdict: what a trick that gains nothing should look like."""
    verdict = sandbox.evaluate("relu", solution("relu"), **FAST)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    return verdict


def gains_nothing(verdict, honest) -> None:
    """Passed, not flagged suspicious, and no faster than the honest solution beyond noise."""
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    assert "SUSPICIOUS_SPEEDUP" not in flags(verdict), describe(verdict)
    assert verdict.speedup <= 2 * max(honest.speedup_high, honest.speedup), (describe(verdict), honest.speedup)


# ------------------------------------------------------------------------------ talking

# The old harness's timing frame (header length, payload length, JSON), claiming 8x.
FRAME = ('    static const char json[] = "{\\"event\\":\\"timing\\",\\"candidate\\":[0.000001],'
         '\\"reference\\":[0.000008],\\"outputs\\":[]}";\n'
         "    unsigned char head[12] = {0, 0, 0, (unsigned char)(sizeof json - 1), 0, 0, 0, 0, 0, 0, 0, 0};\n")


def test_a_forged_timing_frame_on_fd_3_breaks_the_protocol(sandbox):
    body = FRAME + "    write(3, head, 12);\n    write(3, json, sizeof json - 1);\n" + RELU_LOOP
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **FAST)
    assert verdict.stage == Stage.STAGE_RUN and "protocol" in verdict.message, describe(verdict)


def test_the_frame_or_a_done_written_to_every_descriptor_gains_nothing(sandbox):
    body = (FRAME + "    for (int fd = 0; fd <= 64; fd++) { write(fd, head, 12); write(fd, json, sizeof json - 1);"
            ' write(fd, "D", 1); }\n' + RELU_LOOP)
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **FAST)
    assert verdict.stage == Stage.STAGE_RUN and "protocol" in verdict.message, describe(verdict)


def test_answering_done_early_leaves_the_outputs_unwritten(sandbox):
    # "done" before the work: the zygote stops the process at once; the outputs are not there.
    body = '    write(3, "D", 1);\n' + RELU_LOOP
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **FAST)
    assert verdict.stage in (Stage.STAGE_CORRECT, Stage.STAGE_RUN), describe(verdict)
    assert "OUTPUT_NOT_WRITTEN" in flags(verdict) or "protocol" in verdict.message, describe(verdict)


def test_a_huge_claimed_frame_is_one_bad_answer(sandbox):
    # 16 GiB claimed: the zygote reads at most 64 bytes of an answer, and nothing is allocated.
    body = ("    unsigned char head[12] = {0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 0};\n"
            '    write(3, head, 12);\n    write(3, "{}", 2);\n' + RELU_LOOP)
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **FAST)
    assert verdict.stage == Stage.STAGE_RUN and "protocol" in verdict.message, describe(verdict)


# ------------------------------------------------------------------------------ remembering

FINGERPRINT_CACHE = relu(
    "    float print = x[0] + 3.0f * x[1] + 7.0f * x[n - 1];\n"
    "    if (saved && print == seen) { memcpy(y, saved, n * 4); return; }\n" + RELU_LOOP +
    "\n    if (!saved) saved = new float[n];\n    memcpy(saved, y, n * 4);\n    seen = print;",
    prelude="#include <string.h>\nstatic float seen = 0.0f, *saved = nullptr;\n")


def test_an_input_fingerprint_cache_never_hits(sandbox, honest):
    gains_nothing(sandbox.evaluate("relu", FINGERPRINT_CACHE, **FAST), honest)


def test_computing_only_the_calls_it_guesses_are_checked_fails(sandbox):
    # Right on the correctness trials, then only every fourth call: the service checks calls
    # of every timed run, chosen after the run.
    body = "    static int64_t calls = 0;\n    if (calls++ >= 3 && calls % 4 != 0) return;\n" + RELU_LOOP
    verdict = sandbox.evaluate("relu", relu(body), **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and "OUTPUT_NOT_WRITTEN" in flags(verdict), describe(verdict)
    assert verdict.trials_passed == 3 and "during timing" in verdict.message


def test_plausible_garbage_after_the_trials_fails(sandbox):
    body = ("    static int64_t calls = 0;\n"
            "    if (calls++ >= 3) { for (int64_t i = 0; i < n; i++) y[i] = x[i]; return; }\n" + RELU_LOOP)
    verdict = sandbox.evaluate("relu", relu(body), **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and verdict.mismatch.reason == "values", describe(verdict)
    assert "during timing" in verdict.message and "OUTPUT_NOT_WRITTEN" not in flags(verdict)


# ------------------------------------------------------------------------------ working outside the clock
# (the static check rejects threads and processes; it is off here so the runtime is what is tested)

def test_outputs_written_after_done_are_not_seen(sandbox):
    body = ("    struct Job { const float* x; float* y; int64_t n; };\n"
            "    pthread_t t;\n    Job* job = new Job{x, y, n};\n"
            "    pthread_create(&t, nullptr, [](void* p) -> void* {\n"
            "        Job* j = (Job*)p; usleep(20000);\n"
            "        for (int64_t i = 0; i < j->n; i++) j->y[i] = j->x[i] > 0.0f ? j->x[i] : 0.0f;\n"
            "        return nullptr; }, job);\n    pthread_detach(t);")
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <pthread.h>\n#include <unistd.h>\n"), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_CORRECT and "OUTPUT_NOT_WRITTEN" in flags(verdict), describe(verdict)
    assert verdict.mismatch.trial == 0


def test_a_thread_left_spinning_cannot_slow_the_reference(sandbox, honest):
    # Stopped with the candidate while the reference runs: it only slows the candidate.
    body = ("    static bool started = false;\n    if (!started) { started = true; pthread_t t;\n"
            "        pthread_create(&t, nullptr, [](void*) -> void* { volatile uint64_t k = 0; for (;;) k++; }, nullptr);\n"
            "        pthread_detach(t); }\n" + RELU_LOOP)
    gains_nothing(sandbox.evaluate("relu", relu(body, prelude="#include <pthread.h>\n"), **NO_STATIC), honest)


def test_a_process_cannot_be_started_while_timed(sandbox, honest):
    # A child in a session of its own would not be stopped with the candidate. With a uid of
    # its own the candidate's task limit is lowered to what it has before it is timed, so the
    # fork fails (and the kernel, which writes -1 everywhere once it has a child, stays
    # right); without one, the child is found at the end of the run and the verdict fails.
    body = ("    static int64_t calls = 0;\n    static bool forked = false;\n"
            "    if (calls++ == 6) { pid_t p = fork(); if (p == 0) { setsid(); volatile uint64_t k = 0; for (;;) k++; }"
            " forked = p > 0; }\n"
            "    for (int64_t i = 0; i < n; i++) y[i] = forked ? -1.0f : (x[i] > 0.0f ? x[i] : 0.0f);")
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **NO_STATIC)
    if AS_ROOT:
        gains_nothing(verdict, honest)
    else:
        assert verdict.stage == Stage.STAGE_RUN and "started 1 processes while it was timed" in verdict.message, \
            describe(verdict)


def test_a_process_started_before_timing_is_gone_when_it_is_timed(sandbox, honest):
    body = ("    static bool started = false;\n"
            "    if (!started) { started = true; if (fork() == 0) { setsid(); volatile uint64_t k = 0; for (;;) k++; } }\n"
            + RELU_LOOP)
    gains_nothing(sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **NO_STATIC), honest)


# ------------------------------------------------------------------------------ KernelBench

MODEL_NEW = '''
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
{init}
    def forward(self, x):
{forward}
'''
HONEST_FORWARD = "        return torch.clamp_min(x * self.scale, 0.0)"
# Rebinds every clock and timer it can reach without a forbidden call: the old harness's
# module, time, and through sys.modules whatever else is loaded.
PATCH_CLOCKS = '''
        import sys
        zero = lambda *args, **kwargs: 0
        for name, module in list(vars(sys)["modules"].items()):
            if module is None:
                continue
            if name.startswith("svc_sandbox") or name in ("time", "timeit"):
                space = vars(module)
                for key in list(space):
                    if key in ("_now", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time",
                               "time_ns", "process_time"):
                        space[key] = zero
        vars(sys)["modules"]["svc_sandbox.harness"] = None
        if torch.cuda.is_available():
            vars(torch.cuda)["synchronize"] = zero
'''


def kernelbench(init: str = "", forward: str = HONEST_FORWARD) -> str:
    return MODEL_NEW.format(init=init, forward=forward)


@pytest.fixture(scope="module")
def honest_kernelbench(sandbox):
    verdict = sandbox.evaluate(TASK, kernelbench(), KERNELBENCH, **FAST)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    return verdict


def test_rebinding_the_clocks_changes_nothing(sandbox, honest_kernelbench):
    # The static check refuses the reflection (vars) it goes through; without the check, the
    # patches run and reach nothing that measures.
    refused = sandbox.evaluate(TASK, kernelbench(init=PATCH_CLOCKS), KERNELBENCH, **FAST)
    assert refused.stage == Stage.STAGE_FORMAT and "FORBIDDEN_CALL" in flags(refused), describe(refused)
    gains_nothing(sandbox.evaluate(TASK, kernelbench(init=PATCH_CLOCKS), KERNELBENCH, **NO_STATIC), honest_kernelbench)


def test_a_kernelbench_fingerprint_cache_never_hits(sandbox, honest_kernelbench):
    forward = ("        key = float(x[0, 0]) + 3 * float(x[-1, -1])\n"
               "        if getattr(self, 'key', None) == key:\n            return self.saved\n"
               "        self.key, self.saved = key, torch.clamp_min(x * self.scale, 0.0)\n        return self.saved")
    gains_nothing(sandbox.evaluate(TASK, kernelbench(forward=forward), KERNELBENCH, **FAST), honest_kernelbench)


def test_returning_a_view_of_the_inputs_is_wrong(sandbox):
    verdict = sandbox.evaluate(TASK, kernelbench(forward="        return x"), KERNELBENCH, **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and verdict.mismatch.reason == "values", describe(verdict)


def test_computing_in_place_in_the_inputs_is_caught(sandbox):
    forward = "        x.mul_(self.scale).clamp_min_(0.0)\n        return x"
    verdict = sandbox.evaluate(TASK, kernelbench(forward=forward), KERNELBENCH, **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and "INPUT_MUTATED" in flags(verdict), describe(verdict)


def test_a_wrong_output_shape_is_a_verdict(sandbox):
    forward = "        return torch.clamp_min(x * self.scale, 0.0)[:, :7]"
    verdict = sandbox.evaluate(TASK, kernelbench(forward=forward), KERNELBENCH, **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and verdict.mismatch.reason == "shape", describe(verdict)
    assert "(256, 7)" in verdict.message
