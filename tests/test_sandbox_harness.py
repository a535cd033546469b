"""The measured session below the service, on a machine without a GPU: a real zygote forks
the harness and the reference process (timer.py), each maps its shared-memory region, and
commands are driven one by one.

- The cuda harness runs against a stand-in CUDA runtime: a small C library with the
  runtime's entry points working on host memory (a mock at the one edge that cannot exist
  here, the GPU). It checks the harness's use of the runtime (device buffers, staging,
  sentinel fill, synchronization, error reporting) and the STAGE/GO/FETCH protocol, not
  CUDA; tests/test_sandbox_gpu.py runs the real thing on a GPU.
- trust.Measurement runs a whole session of that stand-in cuda candidate against the NumPy
  reference (the cuda toolchain's staged timing on a CPU).
- The PyTorch baseline (the cuda toolchain's reference) runs on the CPU device.
- The trusted probe jobs (CUDA device count, a KernelBench problem's shapes).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import structlog

from leap import tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import checking, shm, trust
from svc_sandbox.isolation import Limits, Zygote
from svc_sandbox.references import ReferenceStore
from svc_sandbox.toolchains.native import signature
from svc_sandbox.wire import recv_frame

FAKE_CUDART = r"""
#include <stdlib.h>
#include <string.h>
static int last_error = 0;
int cudaSetDevice(int d) { return d == 0 ? 0 : 101; }
int cudaGetDeviceCount(int* n) { *n = 1; return 0; }
int cudaMalloc(void** p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaMemcpy(void* d, const void* s, size_t n, int kind) { memcpy(d, s, n); return 0; }
int cudaMemset(void* d, int v, size_t n) { memset(d, v, n); return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaStreamSynchronize(void* s) { return 0; }
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
const char* cudaGetErrorName(int e) { return e ? "cudaErrorLaunchFailure" : "cudaSuccess"; }
const char* cudaGetErrorString(int e) { return e ? "unspecified launch failure" : "no error"; }
int cudaDeviceGetAttribute(int* v, int attr, int dev) { *v = 1 << 20; return 0; }
void fake_cuda_fail(int code) { last_error = code; }
"""

RELU = ('#include <stdint.h>\nextern "C" void fake_cuda_fail(int);\n'
        'extern "C" void relu(const float* x, float* y, int64_t n) {{\n{}\n}}\n')
LOOP = "    for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;"
SPEC_TASK = tasks.task_spec("relu")
SIZES = SPEC_TASK.preset("small")


def build(directory: Path, name: str, source: str, *flags: str) -> Path:
    (directory / f"{name}.c").write_text(source)
    out = directory / f"{name}.so"
    compiler = "gcc" if source is FAKE_CUDART else "g++"
    subprocess.run([compiler, "-O1", "-fPIC", "-shared", *flags, "-o", str(out), str(directory / f"{name}.c"),
                    *([] if source is FAKE_CUDART else ["-x", "c++"])], check=True, capture_output=True)
    out.chmod(0o755)
    return out


@pytest.fixture(scope="module")
def zygote():
    running = Zygote(0, None, log=structlog.get_logger())
    running.start()
    yield running
    running.close()


def job(spec: dict, cwd: Path, log: str) -> dict:
    return {"spec": spec, "cwd": str(cwd), "env": {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
            "limits": Limits(wall_seconds=120).as_dict(), "log": log, "drop_privileges": False}


def relu_layout(slots: int) -> tuple[shm.Layout, list[dict]]:
    layout, arguments = signature(SPEC_TASK.task, SIZES)
    return layout.with_slots(slots), arguments


def cuda_spec(tmp_path: Path, library: Path, layout: shm.Layout, arguments: list[dict]) -> dict:
    cudart = build(tmp_path, "libcudart_fake", FAKE_CUDART, "-Wl,-soname,libcudart.so.13")
    return {"kind": "cuda", "library": str(library), "entry": "relu", "arguments": arguments, "cudart": str(cudart),
            "device": 0, "sentinel": True, "device_sync": True, "l2_flush": True, "layout": layout.as_dict()}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_cuda_harness_stages_runs_and_fetches_against_a_stand_in_runtime(zygote, tmp_path):
    layout, arguments = relu_layout(slots=4)
    region = shm.Region(layout, "candidate")
    try:
        spec = cuda_spec(tmp_path, build(tmp_path, "good", RELU.format(LOOP)), layout, arguments)
        inputs = [SPEC_TASK.inputs(SIZES, 0, slot)["x"] for slot in range(4)]
        with zygote.session(job(spec, tmp_path, "run.log"), None, [region.fd]) as link:
            assert link.await_ready("candidate", 30) == {"answer": "R"}
            for slot, x in enumerate(inputs):
                region.write(slot, 0, x)
            region.fill(range(4), [1], checking.SENTINEL_BYTE)
            for code in (b"S", b"G", b"F"):
                reply = link.step("candidate", code, 0, 4, 30)
                assert reply["answer"] == "D" and reply["ns"] >= reply["answer_ns"] > 0, reply
            for slot, x in enumerate(inputs):  # FETCH brought the device outputs (and inputs) back
                assert np.array_equal(region.view(slot, 1), np.maximum(x, 0))
                assert np.array_equal(region.view(slot, 0), x)
            # STAGE filled the device outputs with the sentinel: a run that writes nothing fetches it
            region.fill(range(4), [1], 0)
            link.step("candidate", b"S", 0, 2, 30)
            link.step("candidate", b"F", 0, 2, 30)
            assert checking.sentinel_mask(region.view(0, 1)).all() and not region.view(2, 1).any()
    finally:
        region.close()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_cuda_failures_are_answered_with_one_byte_and_the_reason_in_the_log(zygote, tmp_path):
    layout, arguments = relu_layout(slots=1)
    for name, body, answer, text in (("failing", "    fake_cuda_fail(4);", "E",
                                      "cudaErrorLaunchFailure: unspecified launch failure"),
                                     ("unnamed", None, "L", "undefined symbol: relu")):
        source = RELU.format(body) if body else "int other(void) { return 0; }"
        region = shm.Region(layout, "candidate")
        try:
            spec = cuda_spec(tmp_path, build(tmp_path, name, source), layout, arguments)
            with zygote.session(job(spec, tmp_path, f"{name}.log"), None, [region.fd]) as link:
                reply = link.await_ready("candidate", 30)
                if answer == "E":
                    assert reply == {"answer": "R"}
                    link.step("candidate", b"S", 0, 1, 30)
                    reply = link.step("candidate", b"G", 0, 1, 30)
                assert reply["answer"] == answer, reply
        finally:
            region.close()
        assert text in (tmp_path / f"{name}.log").read_text()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_a_staged_session_measures_the_cuda_path_on_a_cpu(zygote, tmp_path):
    """trust.Measurement end to end with staging: correctness trials, interleaved timed runs
    with STAGE and FETCH clocked and compared with the reference's, checked outputs."""
    layout, arguments = relu_layout(slots=1)
    layout = layout.with_slots(shm.slots_for(layout, 16 << 20, 64))
    candidate_region, reference_region = shm.Region(layout, "candidate"), shm.Region(layout, "reference")
    shutil.copy(SPEC_TASK.reference_path, tmp_path / "reference.py")
    spec = cuda_spec(tmp_path, build(tmp_path, "good", RELU.format(LOOP)), layout, arguments)
    reference = {"kind": "numpy_reference", "reference": str(tmp_path / "reference.py"), "arguments": arguments,
                 "layout": layout.as_dict()}
    options = trust.Options(trials=2, timing=True, min_pairs=4, warmup_runs=1, run_timeout=30, load_timeout=30,
                            sentinel=True, input_mutation=True, fresh_inputs=True, alternate=True, speedup_bound=None,
                            atol=1e-6, rtol=1e-6, run_seconds=2e-4, max_pairs=8, budget_seconds=5, interval_width=10.0,
                            verify_per_run=2, staged=True, max_log_bytes=4096, unreliable_width=10.0)
    verdict = sandbox_pb2.Verdict()
    source = trust.BuiltinSource(ReferenceStore(1 << 26), SPEC_TASK, "small", SIZES, seed=3)
    try:
        with zygote.session(job(spec, tmp_path, "run.log"), job(reference, tmp_path, "reference.log"),
                            [candidate_region.fd, reference_region.fd]) as link:
            trust.Measurement(link, candidate_region, reference_region, source, options, verdict,
                              {"candidate": tmp_path / "run.log", "reference": tmp_path / "reference.log"},
                              Limits(wall_seconds=120)).measure()
    finally:
        candidate_region.close()
        reference_region.close()
    assert verdict.stage == common_pb2.Stage.STAGE_PASSED, verdict
    assert verdict.trials_passed == 2 and 4 <= verdict.candidate_timing.trials <= 8 and verdict.calls_per_run >= 1
    assert 0 < verdict.speedup_low <= verdict.speedup <= verdict.speedup_high


def test_pytorch_baseline_runs_in_a_session(zygote, tmp_path):
    pytest.importorskip("torch")
    zygote.preload("torch")
    layout, arguments = relu_layout(slots=2)
    region = shm.Region(layout, "reference")
    shutil.copy(SPEC_TASK.reference_path, tmp_path / "reference.py")
    spec = {"kind": "torch_reference", "reference": "reference.py", "arguments": arguments, "device": "cpu",
            "threads": 1, "layout": layout.as_dict()}
    try:
        with zygote.session(job(spec, tmp_path, "torch.log"), None, [region.fd]) as link:
            assert link.await_ready("candidate", 60) == {"answer": "R"}, (tmp_path / "torch.log").read_text()
            region.write(0, 0, SPEC_TASK.inputs(SIZES, 0, 0)["x"])
            times = [link.step("candidate", code, 0, 2, 30) for code in (b"S", b"G", b"F")]
            assert all(t["answer"] == "D" for t in times) and times[1]["ns"] > 0
    finally:
        region.close()


def frames(zygote: Zygote, workdir: Path, spec: dict) -> list[dict]:
    found = []
    with zygote.run(spec, str(workdir), {"PATH": "/usr/bin:/bin"}, Limits(wall_seconds=120), "run.log",
                    drop_privileges=False) as handle:
        deadline = time.monotonic() + 120
        while True:
            try:
                header, _ = recv_frame(handle.sock, deadline=deadline)
            except Exception:
                return found
            found.append(header)


def test_probe_counts_devices_of_the_runtime(zygote, tmp_path):
    cudart = build(tmp_path, "libcudart_fake", FAKE_CUDART)
    (header,) = frames(zygote, tmp_path, {"kind": "cuda_probe", "cudart": str(cudart)})
    assert header == {"event": "probe", "count": 1, "error": ""}
    (header,) = frames(zygote, tmp_path, {"kind": "cuda_probe", "cudart": str(tmp_path / "missing.so")})
    assert header["count"] == 0 and "cannot load the CUDA runtime" in header["error"]


def test_kernelbench_probe_reports_the_problems_tensors(zygote, tmp_path):
    pytest.importorskip("torch")
    zygote.preload("torch")
    (tmp_path / "problem.py").write_text(
        "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x, k):\n"
        "        return x.topk(k, dim=1).values, x.argmax(dim=1)\n"
        "def get_inputs():\n    return [torch.randn(4, 9), 3]\ndef get_init_inputs():\n    return []\n")
    (header,) = frames(zygote, tmp_path, {"kind": "kernelbench_probe", "problem": "problem.py", "device": "cpu"})
    assert header["event"] == "probe", header
    assert header["inputs"] == [{"tensor": 0}, {"value": 3}]
    assert header["input_tensors"] == [{"name": "input0", "dtype": "<f4", "shape": [4, 9]}]
    assert header["output_tensors"] == [{"name": "output0", "dtype": "<f4", "shape": [4, 3]},
                                        {"name": "output1", "dtype": "<i8", "shape": [4]}]
