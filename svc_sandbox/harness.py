"""What runs inside the sandbox's child processes (forked by the zygote, already contained).

Two kinds of child:

- a *session* child (`session_main`), forked by the zygote's timer (timer.py): the
  candidate's harness, or the reference process that runs the task's own reference (no
  candidate code in it). It receives the memfd of its region over its socket, maps it, loads
  its code, answers READY, then runs one command at a time: run calls on the tensors of slots
  [first, first + count) and answer one byte. It reads its inputs from the region and writes
  its outputs there; the service wrote the former and reads the latter itself. It sends no
  data: nothing it could say is believed, so there is nothing to forge.
- a *trusted job* (`main`): the CUDA probe, and the KernelBench probe that learns a
  problem's tensor shapes by running its Model once. These talk in frames (wire.py) and
  never have candidate code in them.

The candidate's code is loaded after its region is mapped and after RLIMIT_AS is set to the
address space in use plus the memory limit, so the limit bounds what the candidate
allocates, not the inputs it is handed. A failure while loading or running is written to
the process's log (stderr) and answered with one byte (LOAD_ERROR, COMPILE_ERROR,
RUN_ERROR, SHAPE_ERROR); the service reads the log as text to show, never as a verdict.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import resource
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any


from svc_sandbox import shm
from svc_sandbox.timer import COMPILE_ERROR, DONE, LIMIT_TASKS, LOAD_ERROR, READY, RUN_ERROR, SHAPE_ERROR, STEP
from svc_sandbox.wire import WireError, send_frame

CUDA_MEMCPY_HOST_TO_DEVICE, CUDA_MEMCPY_DEVICE_TO_HOST = 1, 2
CUDA_ATTR_L2_CACHE_SIZE = 89
MIN_FLUSH_BYTES = 64 << 20
GENERATE, STAGE, GO, FETCH = b"N", b"S", b"G", b"F"
SENTINEL_BYTE = 0xFF


class Failed(Exception):
    """A failure to report: `answer` is the byte, the message goes to the log."""

    def __init__(self, answer: bytes, message: str):
        super().__init__(message)
        self.answer = answer


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def limit_memory(extra: int) -> None:
    """RLIMIT_AS = the address space in use now plus `extra`: what is mapped and imported so
    far (the inputs among it) is not counted against the limit."""
    if extra <= 0:
        return
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * shm.PAGE
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, used + extra))


def _log(message: str) -> None:
    try:
        os.write(2, ("\n" + message.rstrip() + "\n").encode(errors="replace"))
    except OSError:
        pass


PR_SET_DUMPABLE = 4


def session_main(sock: socket.socket, spec: dict[str, Any]) -> int:
    """Entry of a session child: receive the memfds, set up, then answer commands. The
    trusted reference first makes itself non-dumpable: where it shares the candidate's uid,
    the candidate cannot trace it or read its memory."""
    if spec.get("trusted"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    try:
        _, fds, _, _ = socket.recv_fds(sock, 16, 4)
    except OSError:
        return 2
    try:
        runner = RUNNERS[spec["kind"]](spec, fds)
    except Failed as failed:
        _log(str(failed))
        sock.send(failed.answer)
        return 1
    sock.send(READY)
    while True:
        try:
            data = sock.recv(STEP.size)
        except OSError:
            return 2
        if len(data) != STEP.size:
            return 0  # the zygote closed the socket: the session is over
        code, first, count, seed = STEP.unpack(data)
        try:
            if code == LIMIT_TASKS:  # no process (nor thread) beyond these while timed: the zygote checks it took
                resource.setrlimit(resource.RLIMIT_NPROC, (count, count))
            else:
                runner.step(code, first, count, seed)
        except Failed as failed:
            _log(str(failed))
            sock.send(failed.answer)
            return 1
        except BaseException:  # noqa: BLE001 - the candidate's failure is a verdict
            _log(traceback.format_exc())
            sock.send(RUN_ERROR)
            return 1
        sock.send(DONE)


def _layout(spec: dict[str, Any]) -> shm.Layout:
    return shm.Layout.from_dict(spec["layout"])


def _index(layout: shm.Layout) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(layout.tensors)}


# --------------------------------------------------------------------------------------
# cpu: a shared object with a C entry point, called through ctypes on guarded buffers


class CpuCandidate:
    def __init__(self, spec: dict[str, Any], fds: list[int]):
        layout = _layout(spec)
        self.mapping = shm.GuardedMapping(fds[0], layout)
        os.close(fds[0])
        limit_memory(int(spec.get("memory_bytes", 0)))
        try:
            library = ctypes.CDLL(os.path.abspath(spec["library"]), mode=os.RTLD_NOW | os.RTLD_LOCAL)
            self.entry = getattr(library, spec["entry"])
        except (OSError, AttributeError) as err:
            raise Failed(LOAD_ERROR, f"{type(err).__name__}: {err}") from None
        arguments = spec["arguments"]
        self.entry.restype = None
        self.entry.argtypes = [ctypes.c_int64 if a["role"] == "scalar" else ctypes.c_void_p for a in arguments]
        index = _index(layout)
        self.calls = [[a["value"] if a["role"] == "scalar" else self.mapping.address(slot, index[a["name"]])
                       for a in arguments] for slot in range(layout.slots)]

    def step(self, code: bytes, first: int, count: int, seed: int) -> None:
        if code != GO:
            raise Failed(RUN_ERROR, f"sandbox: unknown command {code!r}")
        entry, calls = self.entry, self.calls
        for slot in range(first, first + count):
            entry(*calls[slot])


class NumpyReference:
    """A built-in task's NumPy reference on the reference region (its outputs are not kept:
    the service judges against its own float64 oracle)."""

    def __init__(self, spec: dict[str, Any], fds: list[int]):
        layout = _layout(spec)
        self.mapping = shm.PlainMapping(fds[0], layout)
        for fd in fds:
            os.close(fd)
        limit_memory(int(spec.get("memory_bytes", 0)))
        module = _load_module(spec["reference"], "leap_reference")
        self.reference = module.reference
        index = _index(layout)
        self.kwargs = [{a["name"]: (a["value"] if a["role"] == "scalar" else self.mapping.array(slot, index[a["name"]]))
                        for a in spec["arguments"] if a["role"] != "output"} for slot in range(layout.slots)]

    def step(self, code: bytes, first: int, count: int, seed: int) -> None:
        if code != GO:
            return  # nothing to stage or fetch on a CPU
        reference, kwargs = self.reference, self.kwargs
        for slot in range(first, first + count):
            reference(**kwargs[slot])


# --------------------------------------------------------------------------------------
# cuda: a shared object with a C host launcher, called on device buffers through the CUDA
# runtime it links (loaded first, so both use one runtime and one context). Inputs and
# outputs go through host staging buffers in the region: STAGE uploads a batch's inputs (and
# fills its outputs with the sentinel, and flushes the L2 cache), GO runs it, FETCH downloads
# its outputs. The zygote clocks all three.


class CudaError(RuntimeError):
    pass


class CudaRuntime:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib.cudaGetErrorName.restype = ctypes.c_char_p
        for name in ("cudaMalloc", "cudaMemcpy", "cudaMemset", "cudaDeviceSynchronize", "cudaStreamSynchronize",
                     "cudaGetLastError"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self.lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

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


def _flush_bytes(cuda: CudaRuntime, device: int) -> int:
    l2 = ctypes.c_int()
    cuda.lib.cudaDeviceGetAttribute(ctypes.byref(l2), CUDA_ATTR_L2_CACHE_SIZE, device)
    return max(MIN_FLUSH_BYTES, 2 * l2.value)


class CudaCandidate:
    def __init__(self, spec: dict[str, Any], fds: list[int]):
        layout = _layout(spec)
        self.layout = layout
        self.mapping = shm.GuardedMapping(fds[0], layout)
        os.close(fds[0])
        device = int(spec.get("device", 0))
        try:
            self.cuda = cuda = CudaRuntime(spec["cudart"])
            cuda.check(cuda.lib.cudaSetDevice(device), "cudaSetDevice")
            library = ctypes.CDLL(os.path.abspath(spec["library"]), mode=os.RTLD_NOW | os.RTLD_LOCAL)
            self.entry = getattr(library, spec["entry"])
        except (OSError, AttributeError, CudaError) as err:
            raise Failed(LOAD_ERROR, f"{type(err).__name__}: {err}") from None
        self.sentinel = bool(spec.get("sentinel", True))
        self.device_sync = bool(spec.get("device_sync", True))
        self.n_inputs = len(layout.inputs)
        try:
            self.device = [[cuda.malloc(t.nbytes) for t in layout.tensors] for _ in range(layout.slots)]
            flush = _flush_bytes(cuda, device) if spec.get("l2_flush", True) else 0
            self.flush = (cuda.malloc(flush), flush) if flush else None
        except CudaError as err:
            raise Failed(RUN_ERROR, str(err)) from None
        self.entry.restype = None
        self.entry.argtypes = [ctypes.c_int64 if a["role"] == "scalar" else ctypes.c_void_p for a in spec["arguments"]]
        index = _index(layout)
        self.calls = [[a["value"] if a["role"] == "scalar" else self.device[slot][index[a["name"]]]
                       for a in spec["arguments"]] for slot in range(layout.slots)]
        self.flushes = 0

    def _copy(self, slot: int, index: int, kind: int) -> None:
        nbytes = self.layout.tensors[index].nbytes
        host, device = self.mapping.address(slot, index), self.device[slot][index]
        dst, src = (device, host) if kind == CUDA_MEMCPY_HOST_TO_DEVICE else (host, device)
        self.cuda.check(self.cuda.lib.cudaMemcpy(dst, src, nbytes, kind), "cudaMemcpy")

    def step(self, code: bytes, first: int, count: int, seed: int) -> None:
        cuda, slots = self.cuda, range(first, first + count)
        try:
            if code == STAGE:
                for slot in slots:
                    for index in range(self.n_inputs):
                        self._copy(slot, index, CUDA_MEMCPY_HOST_TO_DEVICE)
                    if self.sentinel:
                        for index in range(self.n_inputs, len(self.layout.tensors)):
                            cuda.check(cuda.lib.cudaMemset(self.device[slot][index], SENTINEL_BYTE,
                                                           self.layout.tensors[index].nbytes), "cudaMemset")
                if self.flush:
                    self.flushes += 1
                    cuda.check(cuda.lib.cudaMemset(self.flush[0], self.flushes & 0xFF, self.flush[1]), "cudaMemset")
                cuda.sync("before the launch")
            elif code == GO:
                entry, calls = self.entry, self.calls
                for slot in slots:
                    entry(*calls[slot])
                if self.device_sync:  # counts work on every stream, not just the default one
                    cuda.sync("the kernel failed")
                else:
                    cuda.check(cuda.lib.cudaStreamSynchronize(None), "the kernel failed")
                    cuda.check(cuda.lib.cudaGetLastError(), "the kernel failed")
            elif code == FETCH:
                cuda.sync("the kernel failed")  # side-stream work not timed (DEVICE_SYNC off) lands first
                for slot in slots:
                    for index in range(self.n_inputs, len(self.layout.tensors)):
                        self._copy(slot, index, CUDA_MEMCPY_DEVICE_TO_HOST)
                    for index in range(self.n_inputs):  # the device inputs, for the mutation check
                        self._copy(slot, index, CUDA_MEMCPY_DEVICE_TO_HOST)
            else:
                raise Failed(RUN_ERROR, f"sandbox: unknown command {code!r}")
        except CudaError as err:
            raise Failed(RUN_ERROR, str(err)) from None


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

TORCH_DTYPES = {"<f4": "float32", "<f8": "float64", "<f2": "float16", shm.BFLOAT16: "bfloat16", "<i8": "int64",
                "<i4": "int32", "<i2": "int16", "|i1": "int8", "|u1": "uint8", "|b1": "bool"}


def torch_dtype(torch: Any, dtype: str) -> Any:
    return getattr(torch, TORCH_DTYPES[dtype])


def dtype_name(torch: Any, dtype: Any) -> str | None:
    """The layout's dtype string of a torch dtype (None when unsupported)."""
    for name, torch_name in TORCH_DTYPES.items():
        if getattr(torch, torch_name) == dtype:
            return name
    return None


def _host_tensors(torch: Any, mapping: shm.GuardedMapping | shm.PlainMapping, layout: shm.Layout,
                  indexes: Sequence[int]) -> list[list[Any]]:
    """Torch tensors over the region's buffers, per slot."""
    rows = []
    for slot in range(layout.slots):
        row = []
        for index in indexes:
            tensor = layout.tensors[index]
            if isinstance(mapping, shm.GuardedMapping):
                buffer: Any = mapping.buffer(slot, index)
            else:
                buffer = memoryview(mapping.map)[layout.offset(slot, index):layout.offset(slot, index) + tensor.nbytes]
            dtype = torch_dtype(torch, tensor.dtype)
            row.append(torch.frombuffer(buffer, dtype=dtype).view(tensor.shape) if tensor.nbytes else
                       torch.empty(tensor.shape, dtype=dtype))
        rows.append(row)
    return rows


class _L2Flush:
    def __init__(self, torch: Any, device: str, enabled: bool):
        self.buffer = None
        self.count = 0
        if enabled and device.startswith("cuda"):
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            self.buffer = torch.empty(max(MIN_FLUSH_BYTES, 2 * l2), dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.count += 1
            self.buffer.fill_(self.count & 0xFF)


def _outputs(torch: Any, result: Any) -> list[Any]:
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    return [(v if isinstance(v, torch.Tensor) else torch.as_tensor(v)).detach() for v in values]


class TorchReference:
    """A built-in task's PyTorch baseline on the device (the reference of the cuda toolchain)."""

    def __init__(self, spec: dict[str, Any], fds: list[int]):
        import torch

        self.torch = torch
        layout = _layout(spec)
        self.mapping = shm.PlainMapping(fds[0], layout)
        for fd in fds:
            os.close(fd)
        self.device = spec["device"]
        torch.set_num_threads(max(1, int(spec.get("threads", 1))))
        module = _load_module(spec["reference"], "leap_reference")
        self.reference = module.torch_reference
        host = _host_tensors(torch, self.mapping, layout, range(len(layout.inputs)))
        self.staged = [[(name, h, torch.empty_like(h, device=self.device)) for name, h in
                        zip((t.name for t in layout.inputs), row)] for row in host]
        scalars = {a["name"]: a["value"] for a in spec["arguments"] if a["role"] == "scalar"}
        self.kwargs = [{**scalars, **{name: d for name, _, d in row}} for row in self.staged]
        self.flush = _L2Flush(torch, self.device, bool(spec.get("l2_flush", True)))
        self.device_sync = bool(spec.get("device_sync", True))

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize(self.device)

    def step(self, code: bytes, first: int, count: int, seed: int) -> None:
        slots = range(first, first + count)
        if code == STAGE:
            for slot in slots:
                for _, host, device in self.staged[slot]:
                    device.copy_(host)
            self.flush()
            self._sync()
        elif code == GO:
            reference, kwargs = self.reference, self.kwargs
            for slot in slots:
                reference(**kwargs[slot])
            self._sync()
        # FETCH: nothing to bring back (the service judges against its own oracle)


def _kernelbench_model(torch: Any, problem: Any, factory: Callable[..., Any], seed: int, device: str) -> Any:
    torch.manual_seed(seed)
    model = factory(*problem.get_init_inputs())
    if hasattr(model, "to"):
        model = model.to(device)
    if hasattr(model, "eval"):
        model.eval()
    return model


class _KernelbenchBase:
    """What the KernelBench candidate and reference share: the problem, the layout, inputs
    as tensors over the region (constants where get_inputs() gives a non-tensor)."""

    def __init__(self, spec: dict[str, Any]):
        import torch

        self.torch = torch
        self.layout = _layout(spec)
        self.device = spec["device"]
        self.cuda = self.device.startswith("cuda")
        self.device_sync = bool(spec.get("device_sync", True))
        self.inputs = spec["inputs"]  # per get_inputs() position: {"tensor": layout index} or {"value": constant}
        torch.set_num_threads(max(1, int(spec.get("threads", 1))))
        self.problem = _load_module(spec["problem"], "kernelbench_problem")
        self.flush = _L2Flush(torch, self.device, bool(spec.get("l2_flush", True)))
        self.n_inputs = len(self.layout.inputs)

    def _arguments(self, tensors: Sequence[Any]) -> list[Any]:
        return [tensors[item["tensor"]] if "tensor" in item else item["value"] for item in self.inputs]

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _store(self, result: Any, outputs: Sequence[Any]) -> list[Any]:
        """The call's result as output tensors of the right number and shapes."""
        values = _outputs(self.torch, result)
        wanted = self.layout.outputs
        if len(values) != len(wanted):
            raise Failed(SHAPE_ERROR, f"sandbox: {len(values)} outputs returned, the reference returns {len(wanted)}")
        for number, (value, tensor) in enumerate(zip(values, wanted)):
            if tuple(value.shape) != tensor.shape:
                raise Failed(SHAPE_ERROR, f"sandbox: output {number} has shape {tuple(value.shape)}, the reference's "
                                          f"is {tensor.shape}")
        for value, out in zip(values, outputs):
            out.copy_(value)
        return values


class KernelbenchCandidate(_KernelbenchBase):
    def __init__(self, spec: dict[str, Any], fds: list[int]):
        super().__init__(spec)
        torch = self.torch
        self.mapping = shm.GuardedMapping(fds[0], self.layout)
        os.close(fds[0])
        self.host = _host_tensors(torch, self.mapping, self.layout, range(len(self.layout.tensors)))
        if not self.cuda:
            limit_memory(int(spec.get("memory_bytes", 0)))
        try:
            sys.path.insert(0, os.getcwd())
            module = _load_module(spec["candidate"], "kernelbench_candidate")
            self.model = _kernelbench_model(torch, self.problem, module.ModelNew, int(spec.get("model_seed", 0)),
                                            self.device)
        except BaseException:  # noqa: BLE001 - the candidate's failure to build is a verdict
            raise Failed(COMPILE_ERROR, traceback.format_exc()) from None
        if self.cuda:
            self.staged = [[torch.empty_like(t, device=self.device) for t in row[:self.n_inputs]] for row in self.host]
            self.results: list[list[Any] | None] = [None] * self.layout.slots

    def step(self, code: bytes, first: int, count: int, seed: int) -> None:
        torch, slots = self.torch, range(first, first + count)
        if code == STAGE and self.cuda:
            for slot in slots:
                for device, host in zip(self.staged[slot], self.host[slot]):
                    device.copy_(host)
            self.flush()
            self._sync()
        elif code == GO:
            with torch.no_grad():
                for slot in slots:
                    if self.cuda:
                        result = self.model(*self._arguments(self.staged[slot]))
                        self.results[slot] = _outputs(torch, result)
                    else:
                        result = self.model(*self._arguments(self.host[slot][:self.n_inputs]))
                        self._store(result, self.host[slot][self.n_inputs:])
            if self.device_sync:
                self._sync()
        elif code == FETCH and self.cuda:
            self._sync()
            for slot in slots:
                self._store(self.results[slot], self.host[slot][self.n_inputs:])
                for device, host in zip(self.staged[slot], self.host[slot]):  # for the mutation check
                    host.copy_(device)
            self._sync()


class KernelbenchReference(_KernelbenchBase):
    """The problem's own Model. GENERATE makes a batch's inputs from get_inputs() with the
    service's seeds and writes them into both regions (its own copy stays pristine: the
    Model runs on private tensors, and the candidate cannot map this region)."""

    def __init__(self, spec: dict[str, Any], fds: list[int]):
        super().__init__(spec)
        torch = self.torch
        self.mapping = shm.PlainMapping(fds[0], self.layout)
        self.candidate = shm.PlainMapping(fds[1], self.layout)
        for fd in fds:
            os.close(fd)
        self.host = _host_tensors(torch, self.mapping, self.layout, range(len(self.layout.tensors)))
        self.candidate_inputs = _host_tensors(torch, self.candidate, self.layout, range(self.n_inputs))
        self.model = _kernelbench_model(torch, self.problem, self.problem.Model, int(spec.get("model_seed", 0)),
                                        self.device)
        self.private: list[list[Any] | None] = [None] * self.layout.slots
        self.results: list[list[Any] | None] = [None] * self.layout.slots

    def step(self, code: bytes, first: int, count: int, seed: int) -> None:
        torch, slots = self.torch, range(first, first + count)
        if code == GENERATE:
            for slot in slots:
                torch.manual_seed((seed + slot - first) & ((1 << 63) - 1))
                made = [x for x in self.problem.get_inputs() if isinstance(x, torch.Tensor)]
                if len(made) != self.n_inputs:
                    raise Failed(RUN_ERROR, "sandbox: get_inputs() changed how many tensors it returns")
                for value, own, theirs, tensor in zip(made, self.host[slot], self.candidate_inputs[slot],
                                                      self.layout.inputs):
                    if tuple(value.shape) != tensor.shape:
                        raise Failed(RUN_ERROR, f"sandbox: get_inputs() changed a shape to {tuple(value.shape)}")
                    own.copy_(value)
                    theirs.copy_(value)
                self.private[slot] = [x.to(self.device) for x in made]
        elif code == STAGE:
            self.flush()
            self._sync()
        elif code == GO:
            with torch.no_grad():
                for slot in slots:
                    result = self.model(*self._arguments(self.private[slot]))
                    if self.cuda:
                        self.results[slot] = _outputs(torch, result)
                    else:
                        self._store(result, self.host[slot][self.n_inputs:])
            self._sync()
        elif code == FETCH and self.cuda:
            self._sync()
            for slot in slots:
                self._store(self.results[slot], self.host[slot][self.n_inputs:])
            self._sync()


def run_kernelbench_probe(sock: socket.socket, spec: dict[str, Any]) -> int:
    """Run a problem's Model once (no candidate code here): the dtypes and shapes of its
    inputs and outputs, which size every later session's region."""
    import torch

    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    try:
        problem = _load_module(spec["problem"], "kernelbench_problem")
        device = spec["device"]
        model = _kernelbench_model(torch, problem, problem.Model, int(spec.get("model_seed", 0)), device)
        torch.manual_seed(int(spec.get("seed", 0)))
        made = list(problem.get_inputs())
        inputs, tensors = [], []
        for position, value in enumerate(made):
            if isinstance(value, torch.Tensor):
                name = dtype_name(torch, value.dtype)
                if name is None:
                    raise TypeError(f"input {position} has dtype {value.dtype}, which the sandbox does not support")
                inputs.append({"tensor": len(tensors)})
                tensors.append({"name": f"input{len(tensors)}", "dtype": name, "shape": list(value.shape)})
            elif value is None or isinstance(value, (bool, int, float, str)):
                inputs.append({"value": value})
            else:
                raise TypeError(f"get_inputs() item {position} is a {type(value).__name__}; tensors and numbers only")
        with torch.no_grad():
            result = _outputs(torch, model(*[x.to(device) if isinstance(x, torch.Tensor) else x for x in made]))
        outputs = []
        for number, value in enumerate(result):
            name = dtype_name(torch, value.dtype)
            if name is None:
                raise TypeError(f"output {number} has dtype {value.dtype}, which the sandbox does not support")
            outputs.append({"name": f"output{number}", "dtype": name, "shape": list(value.shape)})
    except BaseException:  # noqa: BLE001 - reported to the service
        send_frame(sock, {"event": "error", "message": traceback.format_exc()[-8000:]})
        return 1
    send_frame(sock, {"event": "probe", "inputs": inputs, "input_tensors": tensors, "output_tensors": outputs})
    return 0


RUNNERS: dict[str, Callable[[dict[str, Any], list[int]], Any]] = {
    "cpu": CpuCandidate, "cuda": CudaCandidate, "kernelbench": KernelbenchCandidate,
    "numpy_reference": NumpyReference, "torch_reference": TorchReference, "kernelbench_reference": KernelbenchReference,
}
JOBS = {"cuda_probe": run_cuda_probe, "kernelbench_probe": run_kernelbench_probe}


def main(sock: socket.socket, spec: dict[str, Any]) -> int:
    """Entry of a trusted job (called by the zygote after it contained the process)."""
    try:
        return JOBS[spec["kind"]](sock, spec)
    except (WireError, BrokenPipeError, ConnectionResetError):
        return 2

