"""The cuda toolchain: nvcc builds the candidate's C host launcher; the harness calls it on
device buffers through the CUDA runtime nvcc linked (loaded first, so both share one runtime
and context). Inputs and outputs go through host staging buffers in shared memory: a timed
run is STAGE (upload the batch's inputs, fill its outputs with the sentinel, flush the L2
cache), GO (the calls, then a device synchronize), FETCH (download the outputs and the
inputs, for the mutation check). The zygote clocks all three: GO is the figure, and copies
slower than the reference's identical ones are charged to the candidate (trust.py). The
reference is the task's PyTorch baseline on the same device, in a process of its own,
interleaved run by run; NVML is sampled beside the timing. One timed session per device at
a time."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from leap import tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import compilers, trust
from svc_sandbox.isolation import Zygote
from svc_sandbox.toolchains.base import ReferenceJob
from svc_sandbox.toolchains.native import NativeToolchain, signature

Stage = common_pb2.Stage
Flag = sandbox_pb2.VerdictFlag
Check = sandbox_pb2.Check


class CudaToolchain(NativeToolchain):
    source_name = "kernel.cu"
    word = "cuda"

    def command(self, request, compiler: compilers.Compiler) -> tuple[list[str], str]:
        arch = self.evaluator.devices.arch(request.device_index, self.settings)
        flags = [*self.settings.cuda_flags, *request.extra_flags]
        return compilers.cuda_command(compiler, flags, arch, self.source_name, "kernel.so"), arch

    def evaluate(self, request, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> None:
        if self.compile(request, code, verdict, zygote, cwd) is None:
            return
        devices = self.evaluator.devices
        if request.device_index >= devices.cuda_count:
            verdict.stage = Stage.STAGE_RUN
            verdict.flags.append(Flag.VERDICT_FLAG_NO_DEVICE)
            verdict.device = f"cuda:{request.device_index}"
            verdict.message = f"compiled; not run: no CUDA device {request.device_index} here ({devices.reason})"
            return
        verdict.device = devices.name(request.device_index)
        task = request.task
        spec_task = tasks.task_spec(task.id)
        sizes = spec_task.preset(request.size)
        layout, arguments = signature(task, sizes)
        options = self.options(request, staged=True, load_timeout=request.run_timeout, tolerance=task.tolerance,
                               reference_timeout=max(request.run_timeout, 120.0), on_device=True)
        device = f"cuda:{request.device_index}"
        common = {"device_sync": request.on(Check.CHECK_DEVICE_SYNC), "l2_flush": request.on(Check.CHECK_L2_FLUSH)}
        # No RLIMIT_AS for CUDA processes: the driver reserves terabytes of address space.
        candidate = self.job({"kind": "cuda", "library": "kernel.so", "entry": task.entry_point.name,
                              "arguments": arguments, "cudart": devices.cudart, "device": request.device_index,
                              "sentinel": request.on(Check.CHECK_NAN_SENTINEL), **common},
                             cwd, self.limits(options, cpu=True, processes=True), "run.log", drop_privileges=True)
        reference = None
        if request.timing and spec_task.torch_reference is None:
            options = dataclasses.replace(options, timing=False)  # no baseline to time against: judged, not timed
        if options.timing:
            zygote.preload("torch")
            reference = ReferenceJob({"kind": "torch_reference", "reference": "reference.py", "arguments": arguments,
                                      "device": device, "threads": self.settings.threads, **common},
                                     self.limits(options, cpu=False, processes=False),
                                     {"reference.py": spec_task.task.reference_source})
        source = trust.BuiltinSource(self.evaluator.references, spec_task, request.size, sizes, request.seed)
        sampling = functools.partial(self.evaluator.telemetry.sampling, request.device_index,
                                     self.settings.telemetry_interval)
        self.measure(zygote, layout, source, options, verdict, candidate=candidate, reference=reference,
                     sampling=sampling, lock=devices.lock(request.device_index) if options.timing else None)
        self.entry_missing(verdict, task.entry_point.name)
