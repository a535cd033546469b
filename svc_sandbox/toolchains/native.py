"""What the cpu and cuda toolchains share: compiling the candidate to a shared object with a
C entry point (through the compile cache, in the sandbox), and the built-in task's C
signature as the session's layout and the harness's arguments."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from leap import tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import compilers, shm, verdicts
from svc_sandbox.compile_cache import cache_key
from svc_sandbox.isolation import Limits, Zygote
from svc_sandbox.toolchains.base import Toolchain

Stage = common_pb2.Stage
Flag = sandbox_pb2.VerdictFlag
Role = sandbox_pb2.ArgumentRole
ROLE_WORDS = {Role.ARGUMENT_ROLE_INPUT: "input", Role.ARGUMENT_ROLE_OUTPUT: "output", Role.ARGUMENT_ROLE_SCALAR: "scalar"}


def signature(task: sandbox_pb2.Task, sizes: dict[str, int]) -> tuple[shm.Layout, list[dict[str, Any]]]:
    """The layout of one call (inputs, outputs in signature order) and the harness's
    arguments (every argument in order: buffers by name, scalars by value)."""
    inputs, outputs, arguments = [], [], []
    for arg in task.entry_point.arguments:
        entry: dict[str, Any] = {"name": arg.name, "role": ROLE_WORDS[arg.role]}
        if arg.role == Role.ARGUMENT_ROLE_SCALAR:
            entry["value"] = int(sizes[arg.name])
        else:
            tensor = shm.Tensor(arg.name, np.dtype(tasks.NUMPY_DTYPE[arg.dtype]).str, tuple(tasks.shape_of(arg, sizes)))
            (inputs if arg.role == Role.ARGUMENT_ROLE_INPUT else outputs).append(tensor)
        arguments.append(entry)
    return shm.Layout(tuple(inputs), tuple(outputs), 1), arguments


class NativeToolchain(Toolchain):
    """A C-ABI shared object: compiled here, loaded by the harness."""

    source_name = "kernel.cpp"
    word = "cpu"

    def command(self, request: Any, compiler: compilers.Compiler) -> tuple[list[str], str]:
        """The compiler's command line and the architecture it targets."""
        raise NotImplementedError

    def compile(self, request: Any, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> Path | None:
        """The built object, or None with the verdict at COMPILE."""
        ev, settings = self.evaluator, self.settings
        compiler = compilers.find(request.compiler)
        assert compiler is not None  # the servicer checked it is installed
        output = "kernel.so"
        command, arch = self.command(request, compiler)
        verdict.compile.compiler = request.compiler
        verdict.compile.compiler_version = compiler.version
        verdict.compile.flags.extend(command[1:-3])  # everything but the path, "-o kernel.so" and the source
        # The key names the prelude by its content, not its path (the work directory is new at
        # every start), so the cache survives restarts.
        stable = [("PRELUDE:" + compilers.PRELUDE) if part == ev.prelude else part for part in command[1:]]
        key = cache_key(self.word, compiler.identity, "\0".join(stable), arch, code)
        target = cwd / output
        with ev.cache.hold(key):
            entry = ev.cache.lookup(key)
            if entry is not None:
                verdict.compile.cache_hit = True
                verdict.flags.append(Flag.VERDICT_FLAG_CACHE_HIT)
                if entry.ok:
                    ev.cache.place(entry, target)
            else:
                (cwd / self.source_name).write_text(code)
                limits = Limits(wall_seconds=request.compile_timeout, cpu_seconds=request.compile_timeout + 1,
                                memory_bytes=settings.memory_bytes, file_bytes=max(settings.file_bytes, 256 << 20),
                                processes=settings.processes if settings.uid_base is not None else 0)
                started = time.monotonic()
                exit = zygote.exec(command, str(cwd), ev.env(cwd), limits, "compile.log")
                seconds = time.monotonic() - started
                log = verdicts.read_log(cwd / "compile.log")
                if exit.timed_out:  # not cached: a busy machine may finish it next time
                    verdict.compile.seconds = seconds
                    verdict.compile.log = verdicts.trim(verdict, log, settings.max_log_bytes)
                    verdict.stage = Stage.STAGE_COMPILE
                    verdict.flags.append(Flag.VERDICT_FLAG_TIMEOUT)
                    verdict.message = f"compile error: the compiler ran past {request.compile_timeout:g} s"
                    return None
                ok = exit.ok and target.is_file()
                if not ok and not log.strip():
                    log = f"{request.compiler} {exit.describe()}"
                entry = ev.cache.store(key, ok, log, seconds, target if ok else None)
                verdict.compile.seconds = seconds
        verdict.compile.log = verdicts.trim(verdict, entry.log, settings.max_log_bytes)
        if not entry.ok:
            verdict.stage = Stage.STAGE_COMPILE
            verdict.message = "compile error: " + verdicts.first_error(entry.log)
            return None
        return target

    def entry_missing(self, verdict: sandbox_pb2.Verdict, name: str) -> None:
        """After a LOAD_ERROR: the object does not export the entry point."""
        if verdict.stage == Stage.STAGE_COMPILE and verdict.message.startswith("compile error: "):
            detail = verdict.message.removeprefix("compile error: ")
            verdict.message = (f'compile error: the shared object does not export {name} (declare it extern "C"): '
                               f"{detail}")
