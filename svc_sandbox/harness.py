"""What runs inside a candidate's process (forked by the zygote, already contained): load the
candidate, run the correctness trials, report raw outputs, and time it when told to.

The harness never judges: outputs, input digests and timings go back to the service, which
compares them with its own oracle. It reads its inputs from files the service wrote and
keeps no expected values, so there is nothing in the process for a candidate to copy.

Timers and synchronization functions are bound when this module is imported (in the
zygote, before any candidate code exists), so a candidate that rebinds `time.perf_counter`
or `torch.cuda.Event` changes nothing the harness calls.

Buffers of the cpu toolchain end right before an inaccessible page, so writing or reading
one element past the end (a `<=` loop bound) is a segfault, not a silent corruption. They
are aligned to 64 bytes when their size is a multiple of 64 bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import mmap
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from svc_sandbox.checking import SENTINEL_BYTE, timing_schedule
from svc_sandbox.wire import WireError, recv_frame, send_frame

_now = time.perf_counter  # bound before any candidate code runs
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
CUDA_MEMCPY_HOST_TO_DEVICE, CUDA_MEMCPY_DEVICE_TO_HOST = 1, 2
CUDA_ATTR_L2_CACHE_SIZE = 89
MIN_FLUSH_BYTES = 64 << 20


def digest(buffer: memoryview | bytes) -> str:
    return hashlib.blake2b(buffer, digest_size=16).hexdigest()


class GuardedBuffer:
    """`nbytes` of memory whose last byte is followed by a PROT_NONE page."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        body = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self.map = mmap.mmap(-1, body + PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        if _libc.mprotect(base + body, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")
        self.offset = body - nbytes
        self.address = base + self.offset
        self.view = memoryview(self.map)[self.offset:self.offset + nbytes]

    def array(self, dtype: str, shape: Sequence[int]) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)),
                             offset=self.offset).reshape(shape)

    def fill(self, byte: int) -> None:
        ctypes.memset(self.address, byte, self.nbytes)

    def load(self, path: str) -> None:
        with open(path, "rb", buffering=0) as file:
            if file.readinto(self.view) != self.nbytes:
                raise OSError(f"{path} is shorter than {self.nbytes} bytes")


def _nbytes(arg: dict[str, Any]) -> int:
    return int(np.prod(arg["shape"], dtype=np.int64)) * np.dtype(arg["dtype"]).itemsize


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _wait_command(sock: socket.socket) -> str:
    try:
        command, _ = recv_frame(sock, max_payload=0)
    except WireError:
        return "stop"
    return str(command.get("op", "stop"))


def _error(sock: socket.socket, phase: str, message: str) -> int:
    send_frame(sock, {"event": "error", "phase": phase, "message": message[-8000:]})
    return 1


def _outputs_header(names: Sequence[str], arrays: Sequence[np.ndarray]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape), "nbytes": a.nbytes} for n, a in zip(names, arrays)]


def _send_payload(sock: socket.socket, header: dict[str, Any], parts: Sequence[memoryview | bytes]) -> None:
    total = sum(len(p) for p in parts)
    send_frame(sock, {**header, "payload_bytes": total}, b"".join(parts) if len(parts) != 1 else parts[0])


# --------------------------------------------------------------------------------------
# cpu: a shared object with a C entry point, called through ctypes on guarded host buffers


def run_cpu(sock: socket.socket, spec: dict[str, Any]) -> int:
    try:
        library = ctypes.CDLL(os.path.abspath(spec["library"]), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        entry = getattr(library, spec["entry"])
    except (OSError, AttributeError) as err:
        return _error(sock, "load", f"{type(err).__name__}: {err}")
    arguments = spec["arguments"]
    buffers = {a["name"]: GuardedBuffer(_nbytes(a)) for a in arguments if a["role"] != "scalar"}
    entry.restype = None
    entry.argtypes = [ctypes.c_int64 if a["role"] == "scalar" else ctypes.c_void_p for a in arguments]
    call_args = [a["value"] if a["role"] == "scalar" else buffers[a["name"]].address for a in arguments]
    inputs = [a for a in arguments if a["role"] == "input"]
    outputs = [a for a in arguments if a["role"] == "output"]
    sentinel = spec.get("sentinel", True)
    send_frame(sock, {"event": "ready"})
    for trial, files in enumerate(spec["trials"]):
        for arg in inputs:
            buffers[arg["name"]].load(files[arg["name"]])
        if sentinel or trial == 0:  # without the sentinel, later trials see the previous trial's outputs
            for arg in outputs:
                buffers[arg["name"]].fill(SENTINEL_BYTE if sentinel else 0)
        start = _now()
        entry(*call_args)
        seconds = _now() - start
        arrays = [buffers[a["name"]].array(a["dtype"], a["shape"]) for a in outputs]
        _send_payload(sock, {"event": "trial", "trial": trial, "seconds": seconds,
                             "input_digests": {a["name"]: digest(buffers[a["name"]].view) for a in inputs},
                             "outputs": _outputs_header([a["name"] for a in outputs], arrays)},
                      [buffers[a["name"]].view for a in outputs])
    send_frame(sock, {"event": "trials_done"})
    timing = spec.get("timing") or {}
    reference = None
    if timing.get("reference"):
        module = _load_module(timing["reference"], "leap_reference")
        kwargs = {a["name"]: (a["value"] if a["role"] == "scalar" else buffers[a["name"]].array(a["dtype"], a["shape"]))
                  for a in arguments if a["role"] != "output"}

        def reference() -> None:
            module.reference(**kwargs)

    while _wait_command(sock) == "time":
        for arg in inputs:
            buffers[arg["name"]].load(spec["trials"][0][arg["name"]])

        def candidate() -> None:
            entry(*call_args)

        def before_candidate() -> None:
            if sentinel:
                for arg in outputs:
                    buffers[arg["name"]].fill(SENTINEL_BYTE)

        times = _time_host(candidate, reference, before_candidate, timing)
        arrays = [buffers[a["name"]].array(a["dtype"], a["shape"]) for a in outputs]
        _send_payload(sock, {"event": "timing", **times, "outputs": _outputs_header([a["name"] for a in outputs], arrays)},
                      [buffers[a["name"]].view for a in outputs])
    return 0


def _time_host(candidate: Callable[[], None], reference: Callable[[], None] | None, before_candidate: Callable[[], None],
               timing: dict[str, Any]) -> dict[str, list[float]]:
    """Monotonic-clock timing on the host; with a reference, the two alternate (see
    checking.timing_schedule). Preparation (the sentinel fill) is outside the timed region."""
    for _ in range(int(timing.get("warmup", 2))):
        before_candidate()
        candidate()
        if reference is not None:
            reference()
    times: dict[str, list[float]] = {"candidate": [], "reference": []}
    for order in timing_schedule(int(timing.get("trials", 10)), bool(timing.get("alternate", True))):
        for who in order:
            if who == "reference" and reference is None:
                continue
            if who == "candidate":
                before_candidate()
            start = _now()
            (candidate if who == "candidate" else reference)()  # type: ignore[operator]
            times[who].append(_now() - start)
    return times


# --------------------------------------------------------------------------------------
# cuda: a shared object with a C host launcher, called on device buffers through the CUDA
# runtime it links (loaded first, so both use one runtime and one context)


class CudaRuntime:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib.cudaGetErrorName.restype = ctypes.c_char_p
        for name in ("cudaMalloc", "cudaMemcpy", "cudaMemset", "cudaEventRecord", "cudaEventElapsedTime"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def error(self, code: int) -> str:
        return f"{self.lib.cudaGetErrorName(code).decode()}: {self.lib.cudaGetErrorString(code).decode()}"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise CudaError(f"{what}: {self.error(code)}")

    def malloc(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(max(nbytes, 1))), "cudaMalloc")
        return int(pointer.value or 0)

    def sync(self, what: str) -> None:
        self.check(self.lib.cudaDeviceSynchronize(), what)
        self.check(self.lib.cudaGetLastError(), what)

    def event(self) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self.check(self.lib.cudaEventCreate(ctypes.byref(handle)), "cudaEventCreate")
        return handle

    def elapsed_seconds(self, start: ctypes.c_void_p, end: ctypes.c_void_p) -> float:
        ms = ctypes.c_float()
        self.check(self.lib.cudaEventElapsedTime(ctypes.byref(ms), start, end), "cudaEventElapsedTime")
        return ms.value / 1e3


class CudaError(RuntimeError):
    pass


def run_cuda(sock: socket.socket, spec: dict[str, Any]) -> int:
    try:
        cuda = CudaRuntime(spec["cudart"])
        cuda.check(cuda.lib.cudaSetDevice(int(spec.get("device", 0))), "cudaSetDevice")
        library = ctypes.CDLL(os.path.abspath(spec["library"]), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        entry = getattr(library, spec["entry"])
    except (OSError, AttributeError, CudaError) as err:
        return _error(sock, "load", f"{type(err).__name__}: {err}")
    arguments = spec["arguments"]
    inputs = [a for a in arguments if a["role"] == "input"]
    outputs = [a for a in arguments if a["role"] == "output"]
    sentinel = spec.get("sentinel", True)
    try:
        device = {a["name"]: cuda.malloc(_nbytes(a)) for a in arguments if a["role"] != "scalar"}
    except CudaError as err:
        return _error(sock, "run", str(err))
    host = {a["name"]: np.empty(a["shape"], dtype=a["dtype"]) for a in arguments if a["role"] != "scalar"}
    entry.restype = None
    entry.argtypes = [ctypes.c_int64 if a["role"] == "scalar" else ctypes.c_void_p for a in arguments]
    call_args = [a["value"] if a["role"] == "scalar" else device[a["name"]] for a in arguments]

    def upload(files: dict[str, str]) -> None:
        for arg in inputs:
            array = host[arg["name"]]
            array.reshape(-1)[:] = np.fromfile(files[arg["name"]], dtype=arg["dtype"])
            cuda.check(cuda.lib.cudaMemcpy(device[arg["name"]], array.ctypes.data, array.nbytes,
                                           CUDA_MEMCPY_HOST_TO_DEVICE), "cudaMemcpy")

    def download(args: list[dict[str, Any]]) -> list[np.ndarray]:
        for arg in args:
            array = host[arg["name"]]
            cuda.check(cuda.lib.cudaMemcpy(array.ctypes.data, device[arg["name"]], array.nbytes,
                                           CUDA_MEMCPY_DEVICE_TO_HOST), "cudaMemcpy")
        return [host[a["name"]] for a in args]

    def fill_outputs(byte: int) -> None:
        for arg in outputs:
            cuda.check(cuda.lib.cudaMemset(device[arg["name"]], byte, _nbytes(arg)), "cudaMemset")

    send_frame(sock, {"event": "ready"})
    try:
        for trial, files in enumerate(spec["trials"]):
            upload(files)
            if sentinel or trial == 0:
                fill_outputs(SENTINEL_BYTE if sentinel else 0)
            cuda.sync("before the launch")
            start = _now()
            entry(*call_args)
            cuda.sync("the kernel failed")
            seconds = _now() - start
            arrays = download(outputs)
            digests = {a["name"]: digest(memoryview(x).cast("B")) for a, x in zip(inputs, download(inputs))}
            _send_payload(sock, {"event": "trial", "trial": trial, "seconds": seconds, "input_digests": digests,
                                 "outputs": _outputs_header([a["name"] for a in outputs], arrays)},
                          [memoryview(a).cast("B") for a in arrays])
        send_frame(sock, {"event": "trials_done"})
        timing = spec.get("timing") or {}
        flush_bytes = 0
        if timing.get("l2_flush", True):
            l2 = ctypes.c_int()
            cuda.lib.cudaDeviceGetAttribute(ctypes.byref(l2), CUDA_ATTR_L2_CACHE_SIZE, int(spec.get("device", 0)))
            flush_bytes = max(MIN_FLUSH_BYTES, 2 * l2.value)
        flush = cuda.malloc(flush_bytes) if flush_bytes else 0
        start_event, end_event = cuda.event(), cuda.event()
        while _wait_command(sock) == "time":
            upload(spec["trials"][0])
            seconds: list[float] = []
            for run in range(int(timing.get("warmup", 2)) + int(timing.get("trials", 10))):
                if flush:
                    cuda.check(cuda.lib.cudaMemset(flush, run & 0xFF, flush_bytes), "cudaMemset")
                if sentinel:
                    fill_outputs(SENTINEL_BYTE)
                cuda.sync("before the launch")
                cuda.check(cuda.lib.cudaEventRecord(start_event, None), "cudaEventRecord")
                entry(*call_args)
                if timing.get("device_sync", True):  # counts work on every stream, not just the default one
                    cuda.sync("the kernel failed")
                cuda.check(cuda.lib.cudaEventRecord(end_event, None), "cudaEventRecord")
                cuda.check(cuda.lib.cudaEventSynchronize(end_event), "cudaEventSynchronize")
                cuda.check(cuda.lib.cudaGetLastError(), "the kernel failed")
                if run >= int(timing.get("warmup", 2)):
                    seconds.append(cuda.elapsed_seconds(start_event, end_event))
            cuda.sync("the kernel failed")  # whatever the timed region left running, before reading outputs
            arrays = download(outputs)
            _send_payload(sock, {"event": "timing", "candidate": seconds, "reference": [],
                                 "outputs": _outputs_header([a["name"] for a in outputs], arrays)},
                          [memoryview(a).cast("B") for a in arrays])
    except CudaError as err:
        return _error(sock, "run", str(err))
    return 0


def run_cuda_probe(sock: socket.socket, spec: dict[str, Any]) -> int:
    try:
        cuda = CudaRuntime(spec["cudart"])
    except OSError as err:
        send_frame(sock, {"event": "probe", "count": 0, "error": f"cannot load the CUDA runtime: {err}"})
        return 0
    count = ctypes.c_int()
    code = cuda.lib.cudaGetDeviceCount(ctypes.byref(count))
    send_frame(sock, {"event": "probe", "count": count.value if code == 0 else 0,
                      "error": "" if code == 0 else cuda.error(code)})
    return 0


# --------------------------------------------------------------------------------------
# PyTorch: the GPU baseline of built-in tasks, and KernelBench modules (Model or ModelNew)


class TorchTimer:
    """CUDA events with a device synchronize inside the timed region and an L2 flush
    between runs on a GPU; the monotonic clock on a CPU. Bound before candidate code loads."""

    def __init__(self, torch: Any, device: str, timing: dict[str, Any]):
        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.timing = timing
        if self.cuda:
            self.event = torch.cuda.Event
            self.elapsed = torch.cuda.Event.elapsed_time
            self.record = torch.cuda.Event.record
            self.sync = torch.cuda.synchronize
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            size = max(MIN_FLUSH_BYTES, 2 * l2) if timing.get("l2_flush", True) else 0
            self.flush = torch.empty(size, dtype=torch.uint8, device=device) if size else None

    def time(self, run: Callable[[], Any]) -> list[float]:
        warmup, trials = int(self.timing.get("warmup", 2)), int(self.timing.get("trials", 10))
        seconds = []
        for index in range(warmup + trials):
            if self.cuda:
                if self.flush is not None:
                    self.flush.fill_(index & 0xFF)
                self.sync()
                start, end = self.event(enable_timing=True), self.event(enable_timing=True)
                self.record(start)
                run()
                if self.timing.get("device_sync", True):
                    self.sync()
                self.record(end)
                end.synchronize()
                took = self.elapsed(start, end) / 1e3
            else:
                start_time = _now()
                run()
                took = _now() - start_time
            if index >= warmup:
                seconds.append(took)
        return seconds


def _torch_outputs(torch: Any, result: Any) -> tuple[list[str], list[np.ndarray]]:
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    arrays = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        value = value.detach()
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()
        arrays.append(np.ascontiguousarray(value.cpu().numpy()))
    return [f"output{i}" for i in range(len(arrays))], arrays


def _tensor_digests(torch: Any, values: Sequence[Any]) -> dict[str, str]:
    return {f"input{i}": digest(np.ascontiguousarray(v.detach().cpu().numpy()).tobytes())
            for i, v in enumerate(values) if isinstance(v, torch.Tensor)}


def run_torch_reference(sock: socket.socket, spec: dict[str, Any]) -> int:
    """Time a built-in task's PyTorch baseline on the device."""
    import torch

    device = spec["device"]
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    module = _load_module(spec["reference"], "leap_reference")
    kwargs = {}
    for arg in spec["arguments"]:
        if arg["role"] == "scalar":
            kwargs[arg["name"]] = arg["value"]
        elif arg["role"] == "input":
            array = np.fromfile(spec["inputs"][arg["name"]], dtype=arg["dtype"]).reshape(arg["shape"])
            kwargs[arg["name"]] = torch.from_numpy(array).to(device)
    timer = TorchTimer(torch, device, spec.get("timing") or {})
    seconds = timer.time(lambda: module.torch_reference(**kwargs))
    send_frame(sock, {"event": "timing", "candidate": [], "reference": seconds})
    return 0


def run_kernelbench(sock: socket.socket, spec: dict[str, Any]) -> int:
    """A KernelBench module: the problem's Model (reference job) or the candidate's ModelNew."""
    import torch

    device = spec["device"]
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    timer_settings = spec.get("timing") or {}
    try:
        problem = _load_module(spec["problem"], "kernelbench_problem")
        init_inputs = problem.get_init_inputs()
        timer = TorchTimer(torch, device, timer_settings)
        if spec.get("candidate"):
            sys.path.insert(0, os.getcwd())
            module = _load_module(spec["candidate"], "kernelbench_candidate")
            factory = module.ModelNew
        else:
            factory = problem.Model
        torch.manual_seed(int(spec.get("seed", 0)))
        model = factory(*init_inputs)
        if hasattr(model, "to"):
            model = model.to(device)
        if hasattr(model, "eval"):
            model.eval()
    except BaseException:  # noqa: BLE001 - the candidate's failure to build is a verdict
        return _error(sock, "compile", traceback.format_exc())
    send_frame(sock, {"event": "compiled"})
    try:
        for trial, seed in enumerate(spec["trial_seeds"]):
            torch.manual_seed(int(seed))
            inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in problem.get_inputs()]
            before = _tensor_digests(torch, inputs)
            start = _now()
            with torch.no_grad():
                result = model(*inputs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = _now() - start
            names, arrays = _torch_outputs(torch, result)
            _send_payload(sock, {"event": "trial", "trial": trial, "seconds": seconds, "input_digests_before": before,
                                 "input_digests": _tensor_digests(torch, inputs),
                                 "outputs": _outputs_header(names, arrays)}, [a.tobytes() for a in arrays])
        send_frame(sock, {"event": "trials_done"})
        while _wait_command(sock) == "time":
            torch.manual_seed(int(spec["trial_seeds"][0]))
            inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in problem.get_inputs()]
            results: list[Any] = []

            def run(inputs: list[Any] = inputs, results: list[Any] = results) -> None:
                with torch.no_grad():
                    results[:] = [model(*inputs)]

            seconds_list = timer.time(run)
            names, arrays = _torch_outputs(torch, results[0])
            key = "candidate" if spec.get("candidate") else "reference"
            _send_payload(sock, {"event": "timing", "candidate": [], "reference": [], key: seconds_list,
                                 "outputs": _outputs_header(names, arrays)}, [a.tobytes() for a in arrays])
    except BaseException:  # noqa: BLE001
        return _error(sock, "run", traceback.format_exc())
    return 0


JOBS = {"cpu": run_cpu, "cuda": run_cuda, "cuda_probe": run_cuda_probe, "torch_reference": run_torch_reference,
        "kernelbench": run_kernelbench}


def main(sock: socket.socket, spec: dict[str, Any]) -> int:
    """Entry of a run child (called by the zygote after it contained the process)."""
    if spec.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(spec["threads"])  # read by libgomp when the candidate loads it
    try:
        return JOBS[spec["kind"]](sock, spec)
    except (WireError, BrokenPipeError, ConnectionResetError):
        return 2  # the service hung up (a deadline, a mismatch, a cancellation): nothing to report to
