"""The cpu toolchain: g++ or clang++ builds the candidate's C entry point; the harness calls it
through ctypes on guarded buffers in shared memory; the reference is the task's NumPy
reference, in a process of its own, timed interleaved with it."""

from __future__ import annotations

from pathlib import Path

from leap import tasks
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import compilers, trust
from svc_sandbox.isolation import Zygote
from svc_sandbox.toolchains.base import ReferenceJob
from svc_sandbox.toolchains.native import NativeToolchain, signature


class CpuToolchain(NativeToolchain):
    source_name = "kernel.cpp"
    word = "cpu"

    def command(self, request, compiler: compilers.Compiler) -> tuple[list[str], str]:
        ev = self.evaluator
        flags = [*self.settings.cpu_flags, *request.extra_flags]
        prelude = ev.prelude if (request.compiler == self.settings.cpu_compiler and not request.extra_flags) else None
        return compilers.cpu_command(compiler, flags, self.source_name, "kernel.so", prelude), ""

    def evaluate(self, request, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> None:
        if self.compile(request, code, verdict, zygote, cwd) is None:
            return
        verdict.device = "cpu"
        task = request.task
        spec_task = tasks.task_spec(task.id)
        sizes = spec_task.preset(request.size)
        layout, arguments = signature(task, sizes)
        options = self.options(request, staged=False, load_timeout=request.run_timeout, tolerance=task.tolerance)
        limits = self.limits(options, cpu=True, processes=True)
        candidate = self.job({"kind": "cpu", "library": "kernel.so", "entry": task.entry_point.name,
                              "arguments": arguments, "memory_bytes": self.settings.memory_bytes}, cwd, limits, "run.log",
                             drop_privileges=True)
        reference = None
        if request.timing:
            reference = ReferenceJob({"kind": "numpy_reference", "reference": "reference.py", "arguments": arguments,
                                      "memory_bytes": self.settings.memory_bytes},
                                     self.limits(options, cpu=True, processes=False),
                                     {"reference.py": spec_task.task.reference_source})
        source = trust.BuiltinSource(self.evaluator.references, spec_task, request.size, sizes, request.seed)
        self.measure(zygote, layout, source, options, verdict, candidate=candidate, reference=reference)
        self.entry_missing(verdict, task.entry_point.name)
