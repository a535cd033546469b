"""The harness's GPU-side code paths, exercised on a machine without a GPU.

- The cuda job runs against a stand-in CUDA runtime: a small C library with the runtime's
  entry points working on host memory (a mock at the one edge that cannot exist here, the
  GPU). It checks the harness's use of the runtime (buffers, copies, sentinel fill,
  synchronization, events, error reporting), not CUDA; tests/test_sandbox_gpu.py runs the
  real thing on a GPU.
- The PyTorch baseline job (the GPU reference timing) runs on the CPU device.
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
from svc_sandbox import checking
from svc_sandbox.isolation import Limits, Zygote
from svc_sandbox.wire import recv_frame, send_frame

FAKE_CUDART = r"""
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef struct { double t; } Event;
static int last_error = 0;
int cudaSetDevice(int d) { return d == 0 ? 0 : 101; }
int cudaGetDeviceCount(int* n) { *n = 1; return 0; }
int cudaMalloc(void** p, size_t n) { *p = malloc(n); return *p ? 0 : 2; }
int cudaMemcpy(void* d, const void* s, size_t n, int kind) { memcpy(d, s, n); return 0; }
int cudaMemset(void* d, int v, size_t n) { memset(d, v, n); return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaGetLastError(void) { int e = last_error; last_error = 0; return e; }
const char* cudaGetErrorName(int e) { return e ? "cudaErrorLaunchFailure" : "cudaSuccess"; }
const char* cudaGetErrorString(int e) { return e ? "unspecified launch failure" : "no error"; }
int cudaEventCreate(void** e) { *e = calloc(1, sizeof(Event)); return 0; }
int cudaEventRecord(void* e, void* s) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); ((Event*)e)->t = ts.tv_sec + ts.tv_nsec * 1e-9; return 0;
}
int cudaEventSynchronize(void* e) { return 0; }
int cudaEventElapsedTime(float* ms, void* a, void* b) { *ms = (float)((((Event*)b)->t - ((Event*)a)->t) * 1e3); return 0; }
int cudaDeviceGetAttribute(int* v, int attr, int dev) { *v = 1 << 20; return 0; }
void fake_cuda_fail(int code) { last_error = code; }
"""

RELU = ('#include <stdint.h>\nextern "C" void fake_cuda_fail(int);\n'
        'extern "C" void relu(const float* x, float* y, int64_t n) {{\n{}\n}}\n')
LOOP = "    for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;"


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


def job(zygote: Zygote, workdir: Path, spec: dict, commands: list[str]) -> list[tuple[dict, bytearray]]:
    frames = []
    with zygote.run(spec, str(workdir), {"PATH": "/usr/bin:/bin"}, Limits(wall_seconds=120), "run.log",
                    drop_privileges=False) as handle:
        deadline = time.monotonic() + 120
        while True:
            try:
                header, payload = recv_frame(handle.sock, deadline=deadline)
            except Exception:
                break
            frames.append((header, payload))
            # a harness waits for a command after its trials and after each timing (retime or stop)
            if header.get("event") == "trials_done" or (header.get("event") == "timing" and "candidate" in header
                                                        and header["candidate"]):
                send_frame(handle.sock, {"op": commands.pop(0) if commands else "stop"})
    return frames


def relu_spec(tmp_path: Path) -> tuple[dict, list[dict]]:
    spec_task = tasks.task_spec("relu")
    sizes = spec_task.preset("small")
    trials, expected = [], []
    for trial in range(2):
        inputs = spec_task.inputs(sizes, 0, trial)
        path = tmp_path / f"x{trial}.bin"
        path.write_bytes(inputs["x"].tobytes())
        trials.append({"x": str(path)})
        expected.append(spec_task.expected(inputs, sizes)["y"])
    arguments = [{"name": "x", "role": "input", "dtype": "<f4", "shape": [sizes["n"]]},
                 {"name": "y", "role": "output", "dtype": "<f4", "shape": [sizes["n"]]},
                 {"name": "n", "role": "scalar", "dtype": "<i8", "shape": [], "value": sizes["n"]}]
    return {"arguments": arguments, "trials": trials, "sentinel": True, "entry": "relu",
            "timing": {"warmup": 1, "trials": 3, "l2_flush": True, "device_sync": True}}, expected


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_cuda_job_against_a_stand_in_runtime(zygote, tmp_path):
    cudart = build(tmp_path, "libcudart_fake", FAKE_CUDART, "-Wl,-soname,libcudart.so.13")
    spec, expected = relu_spec(tmp_path)
    spec.update(kind="cuda", cudart=str(cudart), device=0, library=str(build(tmp_path, "good", RELU.format(LOOP))))
    frames = job(zygote, tmp_path, spec, ["time"])
    events = [h["event"] for h, _ in frames]
    assert events == ["ready", "trial", "trial", "trials_done", "timing"], frames[-1][0]
    for (header, payload), want in zip(frames[1:3], expected):
        got = np.frombuffer(payload, dtype="<f4")
        assert checking.compare("y", 0, got, want, 1e-6, 1e-6) is None
        x = np.fromfile(spec["trials"][header["trial"]]["x"], dtype="<f4")
        assert header["input_digests"]["x"] == checking_digest(x)
    timing, payload = frames[-1]
    assert len(timing["candidate"]) == 3 and all(s >= 0 for s in timing["candidate"]) and timing["reference"] == []
    assert checking.compare("y", 0, np.frombuffer(payload, dtype="<f4"), expected[0], 1e-6, 1e-6) is None
    # a kernel that writes nothing: the sentinel comes back
    spec["library"] = str(build(tmp_path, "lazy", RELU.format("")))
    untouched = np.frombuffer(job(zygote, tmp_path, spec, [])[1][1], dtype="<f4")
    assert checking.sentinel_mask(untouched).all()
    # a failed launch: a run error with the runtime's own words
    spec["library"] = str(build(tmp_path, "failing", RELU.format("    fake_cuda_fail(4);")))
    header = job(zygote, tmp_path, spec, [])[1][0]
    assert header["event"] == "error" and header["phase"] == "run"
    assert "cudaErrorLaunchFailure: unspecified launch failure" in header["message"]
    # a missing entry point is reported at load
    spec["library"] = str(build(tmp_path, "unnamed", "int other(void) { return 0; }"))
    header = job(zygote, tmp_path, spec, [])[0][0]
    assert header["event"] == "error" and header["phase"] == "load" and "relu" in header["message"]


def checking_digest(array: np.ndarray) -> str:
    from svc_sandbox.references import input_digest

    return input_digest(array)


def test_probe_counts_devices_of_the_runtime(zygote, tmp_path):
    cudart = build(tmp_path, "libcudart_fake", FAKE_CUDART)
    (header, _), = job(zygote, tmp_path, {"kind": "cuda_probe", "cudart": str(cudart)}, [])
    assert header == {"event": "probe", "count": 1, "error": ""}
    (header, _), = job(zygote, tmp_path, {"kind": "cuda_probe", "cudart": str(tmp_path / "missing.so")}, [])
    assert header["count"] == 0 and "cannot load the CUDA runtime" in header["error"]


def test_pytorch_baseline_job_times_the_reference(zygote, tmp_path):
    pytest.importorskip("torch")
    zygote.preload("torch")
    spec, _ = relu_spec(tmp_path)
    shutil.copy(tasks.task_spec("relu").reference_path, tmp_path / "reference.py")
    spec = {"kind": "torch_reference", "reference": "reference.py", "arguments": spec["arguments"],
            "inputs": spec["trials"][0], "device": "cpu", "timing": spec["timing"], "threads": 1}
    (header, _), = job(zygote, tmp_path, spec, [])
    assert header["event"] == "timing" and len(header["reference"]) == 3 and header["candidate"] == []
    assert checking.timing_stats(header["reference"]).median_ms > 0
