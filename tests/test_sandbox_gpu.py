"""The sandbox on an NVIDIA GPU: every CUDA solution of the suite passes on the device and is
timed by the zygote's wall clock (STAGE, GO, FETCH through host staging in shared memory),
interleaved with the PyTorch baseline in the same session, with an interval; CUDA failures
are verdicts; the device synchronize inside GO counts side-stream work; work a kernel leaves
running after its launcher returns is counted or fails; NVML lists devices and samples them
while timing; kernelbench runs on the GPU. Skipped where no GPU is present (run them with
`scripts/gpu_checks.sh OUT` on a GPU machine)."""

from __future__ import annotations

import shutil

import pytest

from leap import tasks
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox.telemetry import Telemetry
from tests.sandbox_helpers import CUDA, KERNELBENCH, Check, Stage, candidate, describe, flags, running_sandbox

NVML = Telemetry()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not NVML.devices, reason=f"no NVIDIA GPU: {NVML.unavailable_reason}"),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed"),
]
SUITE = tasks.load_suite()
HEAD = "#include <math.h>\n#include <stdint.h>\n\n"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with running_sandbox(tmp_path_factory.mktemp("gpu")) as running:
        devices = running.servicer.evaluator.devices
        assert devices.cuda_count > 0, f"NVML sees a GPU but the CUDA runtime does not: {devices.reason}"
        yield running


def test_every_cuda_solution_passes_on_the_device(sandbox):
    batch = [candidate(t.id, tasks.examples(t, CUDA, tasks.ExampleKind.EXAMPLE_KIND_SOLUTION)[0].source, CUDA, t.id)
             for t in SUITE]
    verdicts = sandbox.batch(batch, timeout=1800)
    failed = [describe(v) for v in verdicts if v.stage != Stage.STAGE_PASSED]
    assert not failed, "\n".join(failed)
    for verdict in verdicts:
        assert verdict.size == "large" and verdict.device.startswith("cuda:0")
        assert verdict.trials_passed == 5 and verdict.candidate_timing.trials == verdict.reference_timing.trials >= 10
        assert 0 < verdict.speedup_low <= verdict.speedup <= verdict.speedup_high
        assert verdict.timing_clock == "wall" and verdict.calls_per_run >= 1
        assert verdict.telemetry and verdict.telemetry[0].sm_clock_mhz > 0
        assert "NO_DEVICE" not in flags(verdict)


def kernel(body: str, launch: str = "k<<<(n + 255) / 256, 256>>>(x, y, n);", prelude: str = "") -> str:
    return (f"{HEAD}{prelude}__global__ void k(const float* x, float* y, int64_t n) {{\n"
            f"    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n{body}\n}}\n\n"
            f'extern "C" void relu(const float* x, float* y, int64_t n) {{\n    {launch}\n}}\n')


RELU = "    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;"


@pytest.mark.parametrize("source, stage, text", [
    (kernel("    y[i + ((int64_t)1 << 40)] = 1.0f;"), Stage.STAGE_RUN, "illegal"),
    (kernel(RELU, launch="k<<<1, 4096>>>(x, y, n);"), Stage.STAGE_RUN, "invalid configuration"),
    (kernel("    if (i < n) y[i] = x[i];"), Stage.STAGE_CORRECT, "wrong"),
    (kernel("    if (i < n / 2) y[i] = x[i] > 0.0f ? x[i] : 0.0f;"), Stage.STAGE_CORRECT, "never written"),
    (kernel("    if (i < n) { ((float*)x)[i] = fmaxf(x[i], 0.0f); y[i] = x[i]; }"), Stage.STAGE_CORRECT, "modified"),
    (kernel(RELU).replace("y[i] = x[i]", "y[i] = x[i"), Stage.STAGE_COMPILE, "error"),
])
def test_cuda_failures_are_verdicts(sandbox, source, stage, text):
    verdict = sandbox.evaluate("relu", source, CUDA, size="small", timing=False)
    assert verdict.stage == stage, describe(verdict)
    assert text in verdict.message + verdict.runtime_error + verdict.compile.log, describe(verdict)


SIDE_STREAM = kernel(
    "    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;\n"
    "    if (i == 0) { long long start = clock64(); while (clock64() - start < 4000000) {} }",
    launch="static cudaStream_t s = 0;\n    if (!s) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);\n"
           "    k<<<(n + 255) / 256, 256, 0, s>>>(x, y, n);")


def test_device_sync_inside_the_timed_region_counts_side_stream_work(sandbox):
    synced = sandbox.evaluate("relu", SIDE_STREAM, CUDA, size="small", timing_trials=5)
    unsynced = sandbox.evaluate("relu", SIDE_STREAM, CUDA, size="small", timing_trials=5,
                                disabled_checks=[Check.CHECK_DEVICE_SYNC])
    assert synced.stage == unsynced.stage == Stage.STAGE_PASSED, describe(synced) + describe(unsynced)
    # ~4M cycles of spinning (over 1 ms at any clock) is in the synced timing, not the other
    assert synced.candidate_timing.median_ms > 1.0
    assert unsynced.candidate_timing.median_ms < synced.candidate_timing.median_ms / 3


# The launcher returns at once; the kernel writes the outputs ~1 ms later, on a stream of its
# own. GO ends with a device synchronize: the wait is counted, and the outputs are right.
LATE_WRITER = kernel(
    "    if (i == 0) { long long start = clock64(); while (clock64() - start < 2000000) {} }\n"
    "    __syncthreads();\n    if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;",
    launch="static cudaStream_t s = 0;\n    if (!s) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);\n"
           "    k<<<(n + 255) / 256, 256, 0, s>>>(x, y, n);")


def test_work_left_running_after_the_launcher_returns_is_counted(sandbox):
    honest = sandbox.evaluate("relu", kernel(RELU), CUDA, size="small", timing_trials=5)
    late = sandbox.evaluate("relu", LATE_WRITER, CUDA, size="small", timing_trials=5)
    assert honest.stage == late.stage == Stage.STAGE_PASSED, describe(honest) + describe(late)
    assert late.candidate_timing.median_ms > 0.5 > honest.candidate_timing.median_ms
    assert late.speedup < honest.speedup and "SUSPICIOUS_SPEEDUP" not in flags(late)


def test_nvml_lists_devices_and_streams_samples(sandbox):
    listed = sandbox.stub.ListDevices(sandbox_pb2.ListDevicesRequest(), timeout=10)
    assert listed.devices and not listed.unavailable_reason
    device = listed.devices[0]
    assert device.name and device.memory_total_bytes > 0 and "." in device.compute_capability and device.uuid
    samples = [r.sample for r in sandbox.stub.StreamTelemetry(
        sandbox_pb2.StreamTelemetryRequest(device_indices=[0], interval_seconds=0.1, max_samples=3), timeout=30)]
    assert len(samples) == 3 and all(s.device_index == 0 and s.sm_clock_mhz > 0 and s.power_watts > 0 for s in samples)


KB_PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.relu(a @ b)


def get_inputs():
    return [torch.randn(512, 256), torch.randn(256, 384)]


def get_init_inputs():
    return []
'''

KB_NEW = '''
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.clamp_min(torch.mm(a, b), 0.0)
'''


def test_kernelbench_runs_on_the_gpu(tmp_path):
    (tmp_path / "problems").mkdir()
    (tmp_path / "problems" / "1_Matmul_relu.py").write_text(KB_PROBLEM)
    with running_sandbox(tmp_path, task_dirs=[str(tmp_path / "problems")], workers=1) as sandbox:
        verdict = sandbox.evaluate("1_Matmul_relu", KB_NEW, KERNELBENCH)
        assert verdict.stage == Stage.STAGE_PASSED and verdict.device.startswith("cuda:0"), describe(verdict)
        assert verdict.reference_timing.trials >= 10 and verdict.speedup > 0 and verdict.timing_clock == "wall"
        assert verdict.telemetry
