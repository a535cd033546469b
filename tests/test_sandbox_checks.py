"""Every anti-reward-hacking check catches a candidate written to exploit it, and with that
check switched off (EvaluateOptions.disabled_checks) the same candidate gets through, so
the check is what caught it. Also: the compile cache (hits, cached failures, duplicates in
one batch compiled once), the cuda toolchain on a machine without a GPU, and NVML absence."""

from __future__ import annotations

import shutil

import grpc
import pytest

from leap.runtime.errors import details_of
from leap.sandbox.v1 import sandbox_pb2
from tests.sandbox_helpers import (CPU, CUDA, HEADER, RELU_LOOP, Check, Stage, candidate, describe, flags, relu,
                                   running_sandbox)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    # A low speedup bound, so the do-nothing kernel below is over it however noisy the machine.
    with running_sandbox(tmp_path_factory.mktemp("checks"), workers=2, suspicious_speedup=3.0) as running:
        yield running


FAST = {"timing_trials": 3, "warmup_runs": 1}

# Computes only on its first call and relies on the output buffer keeping those values.
ONCE = relu("    static int calls = 0;\n    if (calls++ > 0) return;\n" + RELU_LOOP)


def test_nan_sentinel_catches_untouched_or_reused_output_memory(sandbox):
    verdict = sandbox.evaluate("relu", ONCE, disabled_checks=[Check.CHECK_FRESH_INPUTS], **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and "OUTPUT_NOT_WRITTEN" in flags(verdict), describe(verdict)
    assert verdict.mismatch.reason == "output not written" and verdict.mismatch.trial == 1
    assert verdict.trials_passed == 1


def test_fresh_inputs_catch_a_kernel_that_replays_its_first_result(sandbox):
    verdict = sandbox.evaluate("relu", ONCE, disabled_checks=[Check.CHECK_NAN_SENTINEL], **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and verdict.mismatch.reason == "values", describe(verdict)
    assert "OUTPUT_NOT_WRITTEN" not in flags(verdict)


# Remembers its last result under a fingerprint of its inputs (a few of their values); computes
# only when the fingerprint changes: the trick fresh timed inputs defeat.
GEMM_CACHE = HEADER + """#include <string.h>
static float seen = 0.0f, *saved = nullptr;
extern "C" void gemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
    float print = 0.0f;
    for (int p = 0; p < 8; p++) print += a[p] * (p + 1) + b[p] * (p + 11);
    if (saved && print == seen) {
        memcpy(c, saved, m * n * 4);
        return;
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (int64_t p = 0; p < k; p++) s += a[i * k + p] * b[p * n + j];
            c[i * n + j] = s;
        }
    if (!saved) saved = new float[m * n];
    memcpy(saved, c, m * n * 4);
    seen = print;
}
"""


def test_with_fresh_inputs_off_a_cache_passes_and_its_speedup_is_flagged(sandbox):
    # Every timed call reuses trial 0's inputs when FRESH_INPUTS is off: the cache always hits.
    cached = sandbox.evaluate("gemm", GEMM_CACHE, disabled_checks=[Check.CHECK_FRESH_INPUTS], timing_trials=5)
    assert cached.stage == Stage.STAGE_PASSED and cached.speedup > 3, describe(cached)
    assert "SUSPICIOUS_SPEEDUP" in flags(cached)
    unbounded = sandbox.evaluate("gemm", GEMM_CACHE, disabled_checks=[Check.CHECK_FRESH_INPUTS,
                                                                       Check.CHECK_SPEEDUP_BOUND], timing_trials=5)
    assert unbounded.stage == Stage.STAGE_PASSED and "SUSPICIOUS_SPEEDUP" not in flags(unbounded)
    # With the check on, every call's inputs are new: the cache never hits and gains nothing.
    honest = sandbox.evaluate("gemm", GEMM_CACHE, timing_trials=5)
    assert honest.stage == Stage.STAGE_PASSED and honest.speedup < cached.speedup / 3, describe(honest)


def test_timed_runs_are_checked_too(sandbox):
    # Right on every correctness trial (5 calls), then skips the work: caught in the timed runs.
    lazy = relu("    static int calls = 0;\n    if (calls++ >= 3) return;\n" + RELU_LOOP)
    verdict = sandbox.evaluate("relu", lazy, **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and "OUTPUT_NOT_WRITTEN" in flags(verdict), describe(verdict)
    assert verdict.trials_passed == 3 and verdict.mismatch.trial == 3 and "during timing" in verdict.message


def test_early_return_leaves_the_sentinel(sandbox):
    half = relu("    for (int64_t i = 0; i < n / 2; i++) {\n        y[i] = x[i] > 0.0f ? x[i] : 0.0f;\n    }")
    verdict = sandbox.evaluate("relu", half, **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and "OUTPUT_NOT_WRITTEN" in flags(verdict), describe(verdict)
    assert verdict.mismatch.bad_elements == verdict.mismatch.total_elements // 2
    assert verdict.mismatch.first_bad_index == verdict.mismatch.total_elements // 2


def test_input_mutation_is_caught(sandbox):
    in_place = relu("    float* xm = (float*)x;\n    for (int64_t i = 0; i < n; i++) {\n"
                    "        xm[i] = xm[i] > 0.0f ? xm[i] : 0.0f;\n        y[i] = xm[i];\n    }")
    verdict = sandbox.evaluate("relu", in_place, **FAST)
    assert verdict.stage == Stage.STAGE_CORRECT and "INPUT_MUTATED" in flags(verdict), describe(verdict)
    assert verdict.mismatch.output == "x" and verdict.mismatch.reason == "input mutated"
    allowed = sandbox.evaluate("relu", in_place, disabled_checks=[Check.CHECK_INPUT_MUTATION], **FAST)
    assert allowed.stage == Stage.STAGE_PASSED, describe(allowed)


GEMM_BY_BLAS = (HEADER + "extern \"C\" void cblas_sgemm(int, int, int, int, int, int, float, const float*, int, "
                "const float*, int, float, float*, int);\n"
                'extern "C" void gemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {\n'
                "    cblas_sgemm(101, 111, 111, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n);\n}\n")


def test_calling_the_reference_library_where_forbidden_is_rejected(sandbox):
    verdict = sandbox.evaluate("gemm", GEMM_BY_BLAS, **FAST)
    assert verdict.stage == Stage.STAGE_FORMAT and flags(verdict) == {"FORBIDDEN_CALL"}, describe(verdict)
    assert "cblas_sgemm" in verdict.message and not verdict.HasField("compile")
    # Without the static check it still cannot reach a BLAS: every symbol must resolve at link time.
    unchecked = sandbox.evaluate("gemm", GEMM_BY_BLAS, disabled_checks=[Check.CHECK_STATIC], **FAST)
    assert unchecked.stage == Stage.STAGE_COMPILE and "undefined reference to `cblas_sgemm'" in unchecked.compile.log


@pytest.mark.parametrize("prelude, body, rule", [
    ("#include <stdio.h>\n", '    FILE* f = fopen("/etc/passwd", "r");\n' + RELU_LOOP, "opens files or sockets"),
    ("#include <unistd.h>\n", "    if (fork() == 0) { _exit(0); }\n" + RELU_LOOP, "spawns processes"),
    ("#include <stdlib.h>\n", '    system("true");\n' + RELU_LOOP, "spawns processes"),
    ("#include <thread>\n", "    std::thread t([] {});\n    t.join();\n" + RELU_LOOP, "spawns threads"),
    ("#include <sys/socket.h>\n", "    int s = socket(AF_INET, SOCK_STREAM, 0);\n" + RELU_LOOP, "opens files or sockets"),
    ("#include <time.h>\n", "    struct timespec t;\n    clock_gettime(CLOCK_MONOTONIC, &t);\n" + RELU_LOOP,
     "patches or reads timers"),
    ("", "    asm volatile(\"mov $60, %eax; syscall\");\n" + RELU_LOOP, "issues system calls"),
])
def test_static_check_rejects_files_processes_threads_sockets_and_timers(sandbox, prelude, body, rule):
    verdict = sandbox.evaluate("relu", relu(body, prelude=prelude), **FAST)
    assert verdict.stage == Stage.STAGE_FORMAT and flags(verdict) == {"FORBIDDEN_CALL"}, describe(verdict)
    assert rule in verdict.message


def test_a_kernel_cannot_patch_the_harness_timer(sandbox):
    # Defining clock_gettime in the candidate does not interpose on the harness's clock
    # (RTLD_LOCAL), and the static check rejects it anyway.
    fake = relu(RELU_LOOP, prelude='#include <time.h>\nextern "C" int clock_gettime(clockid_t, struct timespec* t) '
                                   "{ t->tv_sec = 0; t->tv_nsec = 0; return 0; }\n")
    assert sandbox.evaluate("relu", fake, **FAST).stage == Stage.STAGE_FORMAT
    verdict = sandbox.evaluate("relu", fake, disabled_checks=[Check.CHECK_STATIC], **FAST)
    assert verdict.stage == Stage.STAGE_PASSED and 0 < verdict.speedup < 1000, describe(verdict)
    assert verdict.candidate_timing.min_ms > 0


def test_compile_cache_hits_cached_failures_and_duplicates_compiled_once(sandbox):
    code = relu(RELU_LOOP + "\n    // cache test")
    first = sandbox.evaluate("relu", code, timing=False)
    again = sandbox.evaluate("relu", code, timing=False)
    assert not first.compile.cache_hit and first.compile.seconds > 0
    assert again.compile.cache_hit and "CACHE_HIT" in flags(again) and again.compile.seconds == 0
    assert again.stage == first.stage == Stage.STAGE_PASSED and again.source_sha256 == first.source_sha256
    broken = relu("    y[0] = undefined_name;")
    failed = [sandbox.evaluate("relu", broken, timing=False) for _ in range(2)]
    assert [v.stage for v in failed] == [Stage.STAGE_COMPILE] * 2 and failed[1].compile.cache_hit
    assert "undefined_name" in failed[1].compile.log
    fresh = relu(RELU_LOOP + "\n    // duplicates in one batch")
    verdicts = sandbox.batch([candidate("relu", fresh, CPU, str(i)) for i in range(8)], timing=False)
    assert all(v.stage == Stage.STAGE_PASSED for v in verdicts)
    assert sum(not v.compile.cache_hit for v in verdicts) == 1  # one compile, seven hits


def test_flags_and_compiler_are_part_of_the_verdict_and_the_cache_key(sandbox):
    code = relu(RELU_LOOP + "\n    // flags")
    plain = sandbox.evaluate("relu", code, timing=False)
    tuned = sandbox.evaluate("relu", code, timing=False, extra_compile_flags=["-O2", "-DTILE=4"])
    assert not tuned.compile.cache_hit and tuned.stage == Stage.STAGE_PASSED
    assert {"-O2", "-DTILE=4", "-fopenmp"} <= set(tuned.compile.flags) and "-DTILE=4" not in plain.compile.flags
    assert plain.compile.compiler_version.startswith("g++")
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.evaluate("relu", code, extra_compile_flags=["-O2", "-include/etc/passwd"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (bad,) = [d for d in details_of(caught.value) if hasattr(d, "field_violations")]
    assert bad.field_violations[0].field == "options.extra_compile_flags[1]"


@pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ is not installed")
def test_clang_where_asked(sandbox):
    verdict = sandbox.evaluate("relu", relu(RELU_LOOP), compiler="clang++", timing=False)
    assert verdict.stage == Stage.STAGE_PASSED and verdict.compile.compiler == "clang++", describe(verdict)
    assert "clang" in verdict.compile.compiler_version


def test_clang_not_installed_is_a_named_bad_argument(sandbox):
    if shutil.which("clang++"):
        pytest.skip("clang++ is installed here")
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.evaluate("relu", relu(RELU_LOOP), compiler="clang++")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "options.compiler" in caught.value.details()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_candidate_compiles_with_nvcc_and_a_broken_one_fails_to(sandbox):
    if sandbox.servicer.evaluator.devices.cuda_count:
        pytest.skip("a GPU is present: the GPU tests cover the cuda run")
    kernel = ("#include <stdint.h>\n__global__ void k(const float* x, float* y, int64_t n) {\n"
              "    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n    if (i < n) y[i] = fmaxf(x[i], 0.0f);\n}\n"
              'extern "C" void relu(const float* x, float* y, int64_t n) { k<<<(n + 255) / 256, 256>>>(x, y, n); }\n')
    verdict = sandbox.evaluate("relu", kernel, CUDA)
    assert verdict.stage == Stage.STAGE_RUN and flags(verdict) == {"NO_DEVICE"}, describe(verdict)
    assert "no CUDA device" in verdict.message and verdict.compile.seconds > 0
    broken = sandbox.evaluate("relu", kernel.replace("fmaxf(x[i], 0.0f)", "fmaxf(x[i], 0.0f"), CUDA)
    assert broken.stage == Stage.STAGE_COMPILE and "error" in broken.compile.log, describe(broken)


def test_nvml_absence_is_reported_and_cpu_keeps_working(sandbox):
    telemetry = sandbox.servicer.telemetry
    if telemetry.devices:
        pytest.skip("NVML sees devices here: the GPU tests cover telemetry")
    listed = sandbox.stub.ListDevices(sandbox_pb2.ListDevicesRequest(), timeout=10)
    assert not listed.devices and "NVML" in listed.unavailable_reason
    with pytest.raises(grpc.RpcError) as caught:
        list(sandbox.stub.StreamTelemetry(sandbox_pb2.StreamTelemetryRequest(max_samples=1), timeout=10))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no devices" in caught.value.details()
    assert sandbox.evaluate("relu", relu(RELU_LOOP), timing=False).stage == Stage.STAGE_PASSED
