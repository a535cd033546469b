"""One candidate's evaluation: FORMAT -> COMPILE -> RUN -> CORRECT -> timed, into a Verdict.

What each stage means (docs/ARCHITECTURE.md, "Sandbox", has the full table):
- FORMAT: no code block, the entry point is missing, or the static check rejected the code
  (flag FORBIDDEN_CALL);
- COMPILE: the compiler failed or timed out, or the built object does not export the entry
  point; for kernelbench, the module failed to import or ModelNew failed to build (a
  `load_inline` build error included);
- RUN: the process crashed, timed out, hit a limit, raised, or a CUDA call failed; also a
  cuda candidate on a machine with no device (flag NO_DEVICE: compiled, not run);
- CORRECT: some output is outside tolerance, unwritten (sentinel) or an input changed, in a
  correctness trial or in the timed runs;
- PASSED: every trial within tolerance; then timed when timing is on.

The Evaluator is synchronous and runs on a worker thread with its own Zygote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from leap import prompts, tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import checking, static_check, toolchains
from svc_sandbox.compile_cache import CompileCache, cache_key
from svc_sandbox.isolation import ExitInfo, Limits, RunHandle, SandboxUnavailable, Zygote, classify, read_job_file
from svc_sandbox.references import ReferenceStore, TrialData
from svc_sandbox.telemetry import Telemetry
from svc_sandbox.wire import WireError, WireTimeout, recv_frame, send_frame

Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain
Flag = sandbox_pb2.VerdictFlag
Check = sandbox_pb2.Check
Role = sandbox_pb2.ArgumentRole
ROLE_WORDS = {Role.ARGUMENT_ROLE_INPUT: "input", Role.ARGUMENT_ROLE_OUTPUT: "output", Role.ARGUMENT_ROLE_SCALAR: "scalar"}
TOOLCHAIN_WORDS = {Toolchain.TOOLCHAIN_CPU: "cpu", Toolchain.TOOLCHAIN_CUDA: "cuda", Toolchain.TOOLCHAIN_KERNELBENCH: "kernelbench"}
SOURCE_NAMES = {Toolchain.TOOLCHAIN_CPU: "kernel.cpp", Toolchain.TOOLCHAIN_CUDA: "kernel.cu",
                Toolchain.TOOLCHAIN_KERNELBENCH: "candidate.py"}
CRASH_HINT = " (an out-of-bounds access hits the guard page after each buffer)"


@dataclasses.dataclass
class Settings:
    """Plain values the Evaluator needs (the server builds them from its config)."""

    work_dir: Path
    cpu_compiler: str = "g++"
    cpu_flags: list[str] = dataclasses.field(default_factory=lambda: ["-O3", "-march=native", "-fopenmp"])
    nvcc: str = "nvcc"
    cuda_flags: list[str] = dataclasses.field(default_factory=lambda: ["-O3"])
    cuda_arch: str = ""
    cuda_fallback_arch: str = "sm_80"
    compile_timeout: float = 60.0
    run_timeout: float = 30.0
    kernelbench_build_timeout: float = 600.0
    memory_bytes: int = 4 << 30
    file_bytes: int = 64 << 20
    processes: int = 64
    threads: int = 1
    correctness_trials_cpu: int = 3
    correctness_trials_gpu: int = 5
    timing_trials: int = 10
    warmup_runs: int = 2
    suspicious_speedup: float = 10.0
    max_log_bytes: int = 8192
    precompiled_header: bool = True
    kernelbench_device: str = "auto"
    task_dirs: tuple[str, ...] = ()
    telemetry_interval: float = 0.02
    uid_base: int | None = None  # slot k runs as uid_base + k; None: as the service's user


@dataclasses.dataclass
class Request:
    """A validated candidate with its options resolved to concrete values."""

    candidate: sandbox_pb2.Candidate
    task: sandbox_pb2.Task
    size: str
    trials: int
    timing: bool
    timing_trials: int
    warmup_runs: int
    seed: int
    disabled: frozenset[int]
    compile_timeout: float
    run_timeout: float
    compiler: str
    extra_flags: list[str]
    device_index: int
    raw_source: bool

    def on(self, check: int) -> bool:
        return check not in self.disabled


def resolve(candidate: sandbox_pb2.Candidate, options: sandbox_pb2.EvaluateOptions, task: sandbox_pb2.Task,
            settings: Settings) -> Request:
    """The request's options with every zero value replaced by the documented default."""
    toolchain = candidate.toolchain
    gpu = toolchain == Toolchain.TOOLCHAIN_CUDA
    if options.size:
        size = options.size
    else:
        preferred = "large" if gpu else "small"
        names = [p.name for p in task.sizes]
        size = preferred if preferred in names else names[0]
    default_compiler = {Toolchain.TOOLCHAIN_CPU: settings.cpu_compiler, Toolchain.TOOLCHAIN_CUDA: settings.nvcc,
                        Toolchain.TOOLCHAIN_KERNELBENCH: "python"}[toolchain]
    return Request(
        candidate=candidate, task=task, size=size,
        trials=options.correctness_trials or (settings.correctness_trials_gpu if gpu else settings.correctness_trials_cpu),
        timing=options.timing if options.HasField("timing") else True,
        timing_trials=options.timing_trials or settings.timing_trials,
        warmup_runs=options.warmup_runs or settings.warmup_runs,
        seed=options.seed, disabled=frozenset(options.disabled_checks),
        compile_timeout=options.stage_timeout_seconds or settings.compile_timeout,
        run_timeout=options.stage_timeout_seconds or settings.run_timeout,
        compiler=options.compiler or default_compiler, extra_flags=list(options.extra_compile_flags),
        device_index=options.device_index, raw_source=options.raw_source,
    )


class Devices:
    """What can run CUDA here: the runtime's device count (from a probe process), names from
    NVML, and one timing lock per device (timed candidates never contend)."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry
        self.cuda_count = 0
        self.cudart: str | None = None
        self.reason = "no CUDA toolkit runtime found"
        self._locks: dict[int, threading.Lock] = {}

    def lock(self, index: int) -> threading.Lock:
        return self._locks.setdefault(index, threading.Lock())

    def name(self, index: int) -> str:
        device = self.telemetry.device(index)
        return f"cuda:{index} {device.name}" if device else f"cuda:{index}"

    def arch(self, index: int, settings: Settings) -> str:
        if settings.cuda_arch:
            return settings.cuda_arch
        device = self.telemetry.device(index)
        if device and device.compute_capability:
            return "sm_" + device.compute_capability.replace(".", "")
        return settings.cuda_fallback_arch


class Evaluator:
    def __init__(self, settings: Settings, cache: CompileCache, references: ReferenceStore, telemetry: Telemetry, log: Any):
        self.settings = settings
        self.cache = cache
        self.references = references
        self.telemetry = telemetry
        self.devices = Devices(telemetry)
        self.log = log
        self.prelude: str | None = None
        self.jobs = settings.work_dir / "jobs"
        self._counter = 0
        self._counter_lock = threading.Lock()

    # ----------------------------------------------------------------------------------
    # start-up

    def prepare(self, zygote: Zygote) -> None:
        """Build the precompiled header and probe for CUDA devices (once, at start)."""
        self.jobs.mkdir(parents=True, exist_ok=True)
        os.chmod(self.settings.work_dir, 0o755)
        os.chmod(self.jobs, 0o711)
        if self.settings.precompiled_header:
            self.prelude = self._build_prelude()
        nvcc = toolchains.find(self.settings.nvcc)
        if nvcc is not None and nvcc.target:
            self.devices.cudart = toolchains.cudart_path(nvcc.target)
        if self.devices.cudart is None:
            self.devices.reason = "no CUDA runtime (nvcc's libcudart) found"
            return
        with self._job_dir(zygote) as cwd:
            try:
                events = self._talk(zygote, {"kind": "cuda_probe", "cudart": self.devices.cudart}, cwd, 30.0)
            except WireError as err:
                events = [{"event": "probe", "count": 0, "error": f"the probe failed: {err}"}]
        probe = next((e for e in events if e.get("event") == "probe"), {"count": 0, "error": "the probe did not answer"})
        self.devices.cuda_count = int(probe.get("count", 0))
        self.devices.reason = "" if self.devices.cuda_count else str(probe.get("error") or "no CUDA device")

    def _build_prelude(self) -> str | None:
        compiler = toolchains.find(self.settings.cpu_compiler)
        if compiler is None or "clang" in compiler.version.lower():
            return None
        folder = self.settings.work_dir / "pch"
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o755)
        header = folder / "prelude.h"
        header.write_text(toolchains.PRELUDE)
        command = [compiler.path, *self.settings.cpu_flags, "-std=c++17", "-fPIC", "-x", "c++-header", str(header),
                   "-o", str(header) + ".gch"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            self.log.warning("precompiled header not built; compiling without it", error=result.stderr[-500:])
            return None
        for path in folder.iterdir():
            os.chmod(path, 0o644)
        return str(header)

    # ----------------------------------------------------------------------------------
    # helpers

    def _job_dir(self, zygote: Zygote) -> _JobDir:
        with self._counter_lock:
            self._counter += 1
            number = self._counter
        return _JobDir(self.jobs / f"{zygote.slot}-{number}", zygote.uid)

    def _env(self, cwd: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
        threads = str(self.settings.threads)
        env = {"PATH": os.pathsep.join(dict.fromkeys([str(Path(os.sys.executable).parent), "/usr/local/bin", "/usr/bin",
                                                     "/bin"])),
               "HOME": str(cwd), "TMPDIR": str(cwd), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": threads, "OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": threads,
               "MKL_NUM_THREADS": threads}
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH"):
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(extra or {})
        return env

    def _run_limits(self, wall: float, memory: bool = True) -> Limits:
        return Limits(wall_seconds=wall, cpu_seconds=wall * max(1, self.settings.threads) + 1,
                      memory_bytes=self.settings.memory_bytes if memory else 0, file_bytes=self.settings.file_bytes,
                      processes=self.settings.processes if self.settings.uid_base is not None else 0)

    def _talk(self, zygote: Zygote, spec: dict[str, Any], cwd: Path, wall: float) -> list[dict[str, Any]]:
        """Run a trusted job (the CUDA probe, a PyTorch baseline: no candidate code) to
        completion, as the service's user; its frames' headers."""
        events = []
        deadline = time.monotonic() + wall
        limits = dataclasses.replace(self._run_limits(wall, memory=False), processes=0)
        with zygote.run(spec, str(cwd), self._env(cwd), limits, "run.log", drop_privileges=False) as handle:
            while True:
                try:
                    header, _ = recv_frame(handle.sock, deadline=deadline)
                except WireError:
                    break
                events.append(header)
                if header.get("event") == "trials_done":
                    send_frame(handle.sock, {"op": "stop"})
        return events

    # ----------------------------------------------------------------------------------
    # the pipeline

    def evaluate(self, request: Request, zygote: Zygote) -> sandbox_pb2.Verdict:
        """The verdict of one candidate. When the worker process itself fails (killed from
        outside, say), it is restarted and the candidate evaluated once more: a verdict is
        never made up from a sandbox failure."""
        try:
            return self._evaluate(request, zygote)
        except SandboxUnavailable as err:
            self.log.warning("sandbox worker failed; restarting it and evaluating again", slot=zygote.slot,
                             error=str(err), task=request.task.id)
            zygote.close()
            return self._evaluate(request, zygote)

    def _evaluate(self, request: Request, zygote: Zygote) -> sandbox_pb2.Verdict:
        candidate, task = request.candidate, request.task
        verdict = sandbox_pb2.Verdict(candidate_id=candidate.candidate_id, task_id=task.id, toolchain=candidate.toolchain,
                                      size=request.size)
        started = time.monotonic()
        try:
            code = self._format(request, verdict)
            if code is None:
                return verdict
            with self._job_dir(zygote) as cwd:
                if candidate.toolchain == Toolchain.TOOLCHAIN_KERNELBENCH:
                    self._kernelbench(request, code, verdict, zygote, cwd)
                else:
                    library = self._compile(request, code, verdict, zygote, cwd)
                    if library is not None:
                        self._run_native(request, verdict, zygote, cwd)
            return verdict
        finally:
            verdict.wall_seconds = time.monotonic() - started

    def _format(self, request: Request, verdict: sandbox_pb2.Verdict) -> str | None:
        source = request.candidate.source
        code = source if request.raw_source else prompts.extract_code(source)
        verdict.stage = Stage.STAGE_FORMAT
        if code is None or not code.strip():
            verdict.message = "no code: answer with one fenced code block"
            return None
        verdict.source_sha256 = hashlib.sha256(code.encode()).hexdigest()
        missing = static_check.missing_entry_point(code, request.candidate.toolchain, request.task.entry_point.name)
        if missing:
            verdict.message = missing
            return None
        if request.on(Check.CHECK_STATIC):
            findings = static_check.static_check(code, request.candidate.toolchain, list(request.task.forbidden_calls))
            if findings:
                verdict.flags.append(Flag.VERDICT_FLAG_FORBIDDEN_CALL)
                verdict.message = "forbidden: " + "; ".join(f.describe() for f in findings[:5])
                return None
        verdict.stage = Stage.STAGE_UNSPECIFIED  # set again by the stage that ends the evaluation
        return code

    # ---------------------------------------------------------------- compile (cpu, cuda)

    def _compile(self, request: Request, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> Path | None:
        cuda = request.candidate.toolchain == Toolchain.TOOLCHAIN_CUDA
        compiler = toolchains.find(request.compiler)
        assert compiler is not None  # the servicer checked it is installed
        source, output = SOURCE_NAMES[request.candidate.toolchain], "kernel.so"
        if cuda:
            arch = self.devices.arch(request.device_index, self.settings)
            flags = [*self.settings.cuda_flags, *request.extra_flags]
            command = toolchains.cuda_command(compiler, flags, arch, source, output)
        else:
            arch = ""
            flags = [*self.settings.cpu_flags, *request.extra_flags]
            prelude = self.prelude if (request.compiler == self.settings.cpu_compiler and not request.extra_flags) else None
            command = toolchains.cpu_command(compiler, flags, source, output, prelude)
        verdict.compile.compiler = request.compiler
        verdict.compile.compiler_version = compiler.version
        verdict.compile.flags.extend(command[1:-3])  # everything but the path, "-o kernel.so" and the source
        # The key names the prelude by its content, not its path (the work directory is new at
        # every start), so the cache survives restarts.
        stable = [("PRELUDE:" + toolchains.PRELUDE) if part == self.prelude else part for part in command[1:]]
        key = cache_key(TOOLCHAIN_WORDS[request.candidate.toolchain], compiler.identity, "\0".join(stable), arch, code)
        target = cwd / output
        with self.cache.hold(key):
            entry = self.cache.lookup(key)
            if entry is not None:
                verdict.compile.cache_hit = True
                verdict.flags.append(Flag.VERDICT_FLAG_CACHE_HIT)
                if entry.ok:
                    self.cache.place(entry, target)
            else:
                (cwd / source).write_text(code)
                limits = Limits(wall_seconds=request.compile_timeout, cpu_seconds=request.compile_timeout + 1,
                                memory_bytes=self.settings.memory_bytes, file_bytes=max(self.settings.file_bytes, 256 << 20),
                                processes=self.settings.processes if self.settings.uid_base is not None else 0)
                started = time.monotonic()
                exit = zygote.exec(command, str(cwd), self._env(cwd), limits, "compile.log")
                seconds = time.monotonic() - started
                log = _read(cwd / "compile.log")
                if exit.timed_out:  # not cached: a busy machine may finish it next time
                    verdict.compile.seconds = seconds
                    verdict.compile.log = self._trim(log, verdict)
                    verdict.stage = Stage.STAGE_COMPILE
                    verdict.flags.append(Flag.VERDICT_FLAG_TIMEOUT)
                    verdict.message = f"compile error: the compiler ran past {request.compile_timeout:g} s"
                    return None
                ok = exit.ok and target.is_file()
                if not ok and not log.strip():
                    log = f"{request.compiler} {exit.describe()}"
                entry = self.cache.store(key, ok, log, seconds, target if ok else None)
                verdict.compile.seconds = seconds
        verdict.compile.log = self._trim(entry.log, verdict)
        if not entry.ok:
            verdict.stage = Stage.STAGE_COMPILE
            verdict.message = "compile error: " + _first_error(entry.log)
            return None
        return target

    def _trim(self, log: str, verdict: sandbox_pb2.Verdict) -> str:
        text, cut = checking.trim_log(log, self.settings.max_log_bytes)
        if cut and Flag.VERDICT_FLAG_LOG_TRUNCATED not in verdict.flags:
            verdict.flags.append(Flag.VERDICT_FLAG_LOG_TRUNCATED)
        return text

    # ---------------------------------------------------------------- run (cpu, cuda)

    def _run_native(self, request: Request, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> None:
        cuda = request.candidate.toolchain == Toolchain.TOOLCHAIN_CUDA
        task = request.task
        if cuda:
            if request.device_index >= self.devices.cuda_count:
                verdict.stage = Stage.STAGE_RUN
                verdict.flags.append(Flag.VERDICT_FLAG_NO_DEVICE)
                verdict.device = f"cuda:{request.device_index}"
                verdict.message = f"compiled; not run: no CUDA device {request.device_index} here ({self.devices.reason})"
                return
            verdict.device = self.devices.name(request.device_index)
        else:
            verdict.device = "cpu"
        spec_task = tasks.task_spec(task.id)
        sizes = spec_task.preset(request.size)
        trials = [self.references.trial(spec_task, request.size, sizes, request.seed,
                                        t if request.on(Check.CHECK_FRESH_INPUTS) else 0) for t in range(request.trials)]
        arguments = [{"name": a.name, "role": ROLE_WORDS[a.role],
                      "dtype": np.dtype(tasks.NUMPY_DTYPE.get(a.dtype, np.int64)).str,
                      "shape": list(tasks.shape_of(a, sizes)), **({"value": int(sizes[a.name])} if a.role == Role.ARGUMENT_ROLE_SCALAR
                                                                 else {})}
                     for a in task.entry_point.arguments]
        timing = {"warmup": request.warmup_runs, "trials": request.timing_trials,
                  "alternate": request.on(Check.CHECK_ALTERNATE_ORDER), "l2_flush": request.on(Check.CHECK_L2_FLUSH),
                  "device_sync": request.on(Check.CHECK_DEVICE_SYNC),
                  "reference": "reference.py" if not cuda else None}
        spec = {"kind": "cuda" if cuda else "cpu", "library": "kernel.so", "entry": task.entry_point.name,
                "arguments": arguments, "trials": [t.files for t in trials], "sentinel": request.on(Check.CHECK_NAN_SENTINEL),
                "threads": self.settings.threads, "timing": timing}
        if cuda:
            spec.update(cudart=self.devices.cudart, device=request.device_index)
        outputs = [a.name for a in task.entry_point.arguments if a.role == Role.ARGUMENT_ROLE_OUTPUT]
        reference_stats = None
        if cuda and request.timing:  # before the candidate's run: a zygote runs one job at a time
            reference_stats = self._cuda_reference_timing(request, spec_task, arguments, trials[0], zygote, timing)
        _place(cwd / "reference.py", spec_task.reference_path.read_text())  # readable by the candidate's uid
        session = _Session(self, request, verdict)
        # Each phase (loading, every trial, the timed runs, a retime) has run_timeout; the
        # process as a whole gets their sum, so the per-phase deadlines are the ones that bind.
        limits = self._run_limits(request.run_timeout * (request.trials + 3), memory=not cuda)
        with zygote.run(spec, str(cwd), self._env(cwd), limits, "run.log") as handle:
            session.handle = handle
            if not session.expect("ready", request.run_timeout, phase="load"):
                return self._finish_failed(session, cwd, limits)
            if not session.check_trials(trials, outputs, request.run_timeout):
                return self._finish_failed(session, cwd, limits)
            if not request.timing:
                session.stop()
                verdict.stage = Stage.STAGE_PASSED
                return None
            if not session.time(trials[0], outputs, reference_stats):
                return self._finish_failed(session, cwd, limits)
            session.stop()
        return None

    def _finish_failed(self, session: _Session, cwd: Path, limits: Limits, stage: int = Stage.STAGE_RUN) -> None:
        """After a failure: when the verdict already says what went wrong (a mismatch, an
        error the harness reported), end the process; otherwise the way it ended is the verdict."""
        assert session.handle is not None
        if session.verdict.stage != Stage.STAGE_UNSPECIFIED:
            session.handle.kill()
            return
        exit = session.handle.kill() if session.must_kill else session.handle.finish()
        self._runtime_failure(session.verdict, exit, _read(cwd / "run.log"), limits, session.timed_out_phase, stage)

    def _runtime_failure(self, verdict: sandbox_pb2.Verdict, exit: ExitInfo, log: str, limits: Limits,
                         timed_out_after: float | None, stage: int = Stage.STAGE_RUN) -> None:
        exit.log = log
        description, flags = classify(exit, limits)
        if timed_out_after is not None:
            description = f"timed out after {timed_out_after:g} s and was killed"
            flags.add("TIMEOUT")
        for name in sorted(flags):
            flag = getattr(Flag, f"VERDICT_FLAG_{name}")
            if flag not in verdict.flags:
                verdict.flags.append(flag)
        text = description + (CRASH_HINT if "CRASHED" in flags and "SIGSEGV" in description else "")
        if "MEMORY_LIMIT" in flags:
            text += f" (out of memory: the limit is {limits.memory_bytes >> 20} MiB)"
        tail = log.strip()
        verdict.runtime_error = self._trim(text + ("\n" + tail if tail else ""), verdict)
        verdict.stage = stage
        verdict.message = ("compile error: " if stage == Stage.STAGE_COMPILE else "runtime error: ") + text

    def _cuda_reference_timing(self, request: Request, spec_task: tasks.TaskSpec, arguments: list[dict[str, Any]],
                               trial: TrialData, zygote: Zygote, timing: dict[str, Any]) -> sandbox_pb2.TimingStats | None:
        if spec_task.torch_reference is None:
            return None
        key = (request.task.id, request.size, "cuda", self.devices.name(request.device_index), request.timing_trials)

        def measure() -> sandbox_pb2.TimingStats | None:
            zygote.preload("torch")
            spec = {"kind": "torch_reference", "reference": "reference.py", "arguments": arguments,
                    "inputs": trial.files, "device": f"cuda:{request.device_index}", "timing": timing,
                    "threads": self.settings.threads}
            with self._job_dir(zygote) as cwd, self.devices.lock(request.device_index):
                _place(cwd / "reference.py", spec_task.reference_path.read_text())
                events = self._talk(zygote, spec, cwd, request.run_timeout * 3)
            result = next((e for e in events if e.get("event") == "timing"), None)
            if result is None:
                self.log.warning("reference timing failed", task=request.task.id, events=str(events)[-500:])
                return None
            return checking.timing_stats(_floats(result.get("reference")))

        return self.references.timing(key, measure)

    # ---------------------------------------------------------------- kernelbench

    @staticmethod
    def kernelbench_drops_privileges(zygote: Zygote) -> bool:
        """KernelBench candidates import lazily from the Python installation and build against
        its headers (load_inline). Where the candidates' uid cannot read it (a pyenv under
        /root, say), they run as the service's user instead, still in their own session,
        limits and network namespace; the service logs this at start."""
        return not zygote.python_unreadable

    def _kernelbench_limits(self, zygote: Zygote, wall: float, memory: bool) -> Limits:
        # No CPU-time limit (a build runs many compiler processes); no RLIMIT_NPROC without a
        # uid of its own (it would count the service user's processes).
        limits = dataclasses.replace(self._run_limits(wall, memory=memory), cpu_seconds=0)
        return limits if self.kernelbench_drops_privileges(zygote) else dataclasses.replace(limits, processes=0)

    def kernelbench_device(self, request: Request) -> str:
        wanted = self.settings.kernelbench_device
        if wanted == "cpu" or (wanted == "auto" and self.devices.cuda_count == 0):
            return "cpu"
        return f"cuda:{request.device_index}"

    def _kernelbench(self, request: Request, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> None:
        problem = tasks.kernelbench_file(request.task.id, self.settings.task_dirs).read_text()
        device = self.kernelbench_device(request)
        verdict.device = "cpu" if device == "cpu" else self.devices.name(request.device_index)
        errors = zygote.preload("torch")
        if errors:
            verdict.stage = Stage.STAGE_RUN
            verdict.message = f"runtime error: PyTorch cannot be imported: {errors['torch']}"
            return
        seeds = [int.from_bytes(hashlib.sha256(f"{request.seed}/{t if request.on(Check.CHECK_FRESH_INPUTS) else 0}".encode())
                                .digest()[:4], "little") for t in range(request.trials)]
        timing = {"warmup": request.warmup_runs, "trials": request.timing_trials, "l2_flush": request.on(Check.CHECK_L2_FLUSH),
                  "device_sync": request.on(Check.CHECK_DEVICE_SYNC)}
        # The problem travels as a copy in each job's directory: the task directory itself
        # need not be readable by the candidates' uid.
        base = {"kind": "kernelbench", "problem": "problem.py", "device": device, "seed": request.seed,
                "trial_seeds": seeds, "threads": self.settings.threads, "timing": timing}
        reference_key = ("kernelbench", request.task.id, device, tuple(seeds))
        reference_failure: list[str] = []

        def compute() -> list[TrialData]:
            with self._job_dir(zygote) as ref_cwd:
                _place(ref_cwd / "problem.py", problem)
                return self._kernelbench_reference(zygote, base, ref_cwd, reference_failure)

        expected = self.references.recorded(reference_key, compute)
        if not expected:
            verdict.stage = Stage.STAGE_RUN
            verdict.message = "runtime error: the reference Model failed: " + "".join(reference_failure)[-500:]
            return
        _place(cwd / "candidate.py", code)
        _place(cwd / "problem.py", problem)
        torch_version = _torch_version()
        verdict.compile.compiler = "python"
        verdict.compile.compiler_version = f"Python {os.sys.version.split()[0]}, torch {torch_version}"
        spec = {**base, "candidate": "candidate.py"}
        extensions = cwd / "torch_extensions"
        env = {"TORCH_EXTENSIONS_DIR": str(extensions), "MAX_JOBS": str(max(1, self.settings.threads)),
               "PYTHONDONTWRITEBYTECODE": "1"}
        build = self.settings.kernelbench_build_timeout
        limits = self._kernelbench_limits(zygote, build + request.run_timeout * (request.trials + 2), memory=device == "cpu")
        limits = dataclasses.replace(limits, file_bytes=max(self.settings.file_bytes, 1 << 30),
                                     processes=max(limits.processes, 256) if limits.processes else 0)
        reference_stats = None
        if request.timing:  # before the candidate's run: a zygote runs one job at a time
            reference_stats = self._kernelbench_reference_timing(request, zygote, base, device, reference_key, problem)
        session = _Session(self, request, verdict)
        started = time.monotonic()
        with zygote.run(spec, str(cwd), self._env(cwd, env), limits, "run.log",
                        drop_privileges=self.kernelbench_drops_privileges(zygote)) as handle:
            session.handle = handle
            if not session.expect("compiled", build, phase="compile"):
                verdict.compile.seconds = time.monotonic() - started
                verdict.compile.log = self._trim(session.compile_log or _read(cwd / "run.log"), verdict)
                return self._finish_failed(session, cwd, limits, stage=Stage.STAGE_COMPILE)
            verdict.compile.seconds = time.monotonic() - started
            verdict.compile.log = self._trim(_read(cwd / "run.log"), verdict)
            if not session.check_trials(expected, None, request.run_timeout):
                return self._finish_failed(session, cwd, limits)
            if not request.timing:
                session.stop()
                verdict.stage = Stage.STAGE_PASSED
                return None
            if not session.time(expected[0], None, reference_stats):
                return self._finish_failed(session, cwd, limits)
            session.stop()
        return None

    def _kernelbench_reference(self, zygote: Zygote, base: dict[str, Any], cwd: Path, failure: list[str]) -> list[TrialData]:
        """Run the problem's own Model once per (task, device, seeds): expected outputs and
        input digests for every trial."""
        deadline = time.monotonic() + self.settings.run_timeout * 4
        trials: list[TrialData] = []
        limits = self._kernelbench_limits(zygote, self.settings.run_timeout * 4, memory=False)
        with zygote.run(dict(base), str(cwd), self._env(cwd), limits, "run.log",
                        drop_privileges=self.kernelbench_drops_privileges(zygote)) as handle:
            while True:
                try:
                    header, payload = recv_frame(handle.sock, deadline=deadline)
                except WireError as err:
                    failure.append(f"{err}; {_read(cwd / 'run.log')[-2000:]}")
                    return []
                event = header.get("event")
                if event == "error":
                    failure.append(str(header.get("message", "")))
                    return []
                if event == "trial":
                    arrays = _decode_outputs(header, payload)
                    if arrays is None:
                        failure.append("malformed reference outputs")
                        return []
                    trials.append(TrialData({}, dict(header.get("input_digests_before") or {}), arrays))
                if event == "trials_done":
                    send_frame(handle.sock, {"op": "stop"})
                    return trials

    def _kernelbench_reference_timing(self, request: Request, zygote: Zygote, base: dict[str, Any], device: str,
                                      reference_key: tuple, problem: str) -> sandbox_pb2.TimingStats | None:
        key = (*reference_key, "timing", request.timing_trials, request.warmup_runs)

        def measure() -> sandbox_pb2.TimingStats | None:
            lock = self.devices.lock(request.device_index) if device != "cpu" else threading.Lock()
            with self._job_dir(zygote) as cwd, lock:
                _place(cwd / "problem.py", problem)
                deadline = time.monotonic() + self.settings.run_timeout * 4
                limits = self._kernelbench_limits(zygote, self.settings.run_timeout * 4, memory=False)
                with zygote.run(dict(base), str(cwd), self._env(cwd), limits, "run.log",
                                drop_privileges=self.kernelbench_drops_privileges(zygote)) as handle:
                    try:
                        while True:
                            header, _ = recv_frame(handle.sock, deadline=deadline)
                            if header.get("event") == "trials_done":
                                send_frame(handle.sock, {"op": "time"})
                            elif header.get("event") == "timing":
                                send_frame(handle.sock, {"op": "stop"})
                                return checking.timing_stats(_floats(header.get("reference")))
                            elif header.get("event") == "error":
                                return None
                    except WireError:
                        return None

        return self.references.timing(key, measure)


class _Session:
    """The service's side of one run of the harness on a candidate."""

    def __init__(self, evaluator: Evaluator, request: Request, verdict: sandbox_pb2.Verdict):
        self.evaluator = evaluator
        self.request = request
        self.verdict = verdict
        self.handle: RunHandle | None = None
        self.must_kill = False
        self.timed_out_phase: float | None = None
        self.compile_log = ""

    def _recv(self, seconds: float) -> tuple[dict[str, Any], bytearray] | None:
        assert self.handle is not None
        try:
            return recv_frame(self.handle.sock, deadline=time.monotonic() + seconds)
        except WireTimeout:
            self.must_kill = True
            self.timed_out_phase = seconds
            return None
        except WireError:
            return None  # the process ended or sent garbage; how it ended says why

    def _error(self, header: dict[str, Any]) -> None:
        phase, message = header.get("phase"), str(header.get("message", ""))[-4000:]
        verdict = self.verdict
        if phase == "load":
            verdict.stage = Stage.STAGE_COMPILE
            verdict.message = (f'compile error: the shared object does not export {self.request.task.entry_point.name} '
                               f'(declare it extern "C"): {message.splitlines()[-1] if message else ""}')
        elif phase == "compile":
            self.compile_log = message
            verdict.stage = Stage.STAGE_COMPILE
            verdict.message = "compile error: " + (message.strip().splitlines() or [""])[-1]
        else:
            verdict.stage = Stage.STAGE_RUN
            verdict.runtime_error = self.evaluator._trim(message, verdict)
            verdict.message = "runtime error: " + (message.strip().splitlines() or [""])[-1]
            if any(marker in message for marker in ("out of memory", "MemoryError", "DefaultCPUAllocator")):
                verdict.flags.append(Flag.VERDICT_FLAG_MEMORY_LIMIT)

    def expect(self, event: str, seconds: float, phase: str) -> bool:
        got = self._recv(seconds)
        if got is None:
            return False
        header, _ = got
        if header.get("event") == event:
            return True
        if header.get("event") == "error":
            self._error({**header, "phase": header.get("phase", phase)})
        return False

    def check_trials(self, trials: list[TrialData], outputs: list[str] | None, seconds: float) -> bool:
        """Receive each correctness trial and judge it; False on the first failure."""
        verdict = self.verdict
        for index, trial in enumerate(trials):
            got = self._recv(seconds)
            if got is None:
                verdict.trials_run = index + 1
                return False
            header, payload = got
            if header.get("event") == "error":
                verdict.trials_run = index + 1
                self._error(header)
                return False
            arrays = _decode_outputs(header, payload) if header.get("event") == "trial" else None
            if arrays is None:
                verdict.trials_run = index + 1
                self._error({"phase": "run", "message": "the harness sent malformed outputs"})
                return False
            verdict.trials_run = index + 1
            if not self._judge(index, trial, header, arrays, outputs):
                return False
            verdict.trials_passed = index + 1
        got = self._recv(seconds)
        return got is not None and got[0].get("event") == "trials_done"

    def _judge(self, index: int, trial: TrialData, header: dict[str, Any], arrays: dict[str, np.ndarray],
               outputs: list[str] | None) -> bool:
        request, verdict, task = self.request, self.verdict, self.request.task
        if request.on(Check.CHECK_INPUT_MUTATION):
            after = header.get("input_digests") or {}
            for name, want in trial.digests.items():
                if after.get(name) != want:
                    verdict.stage = Stage.STAGE_CORRECT
                    verdict.flags.append(Flag.VERDICT_FLAG_INPUT_MUTATED)
                    verdict.mismatch.CopyFrom(sandbox_pb2.Mismatch(output=name, trial=index, reason="input mutated"))
                    verdict.message = f"wrong: the kernel modified its input {name}"
                    return False
        names = outputs if outputs is not None else list(trial.expected)
        if outputs is None and len(arrays) != len(trial.expected):
            verdict.stage = Stage.STAGE_CORRECT
            verdict.mismatch.CopyFrom(sandbox_pb2.Mismatch(output="outputs", trial=index, reason="shape"))
            verdict.message = f"wrong: {len(arrays)} outputs returned, the reference returns {len(trial.expected)}"
            return False
        got_names = list(arrays) if outputs is None else names
        for name, got_name in zip(trial.expected if outputs is None else names, got_names):
            mismatch = checking.compare(name, index, arrays[got_name], trial.expected[name], task.tolerance.atol,
                                        task.tolerance.rtol, sentinel=request.on(Check.CHECK_NAN_SENTINEL))
            if mismatch is not None:
                verdict.stage = Stage.STAGE_CORRECT
                verdict.mismatch.CopyFrom(mismatch)
                if mismatch.reason == "output not written":
                    verdict.flags.append(Flag.VERDICT_FLAG_OUTPUT_NOT_WRITTEN)
                verdict.message = _mismatch_message(mismatch)
                return False
        return True

    def time(self, first: TrialData, outputs: list[str] | None, reference: sandbox_pb2.TimingStats | None) -> bool:
        """Time a correct candidate (retimed once when throttled); judge the timed runs' outputs."""
        request, verdict, evaluator = self.request, self.verdict, self.evaluator
        assert self.handle is not None
        gpu = verdict.device.startswith("cuda")
        device = request.device_index
        for attempt in range(2):
            lock = evaluator.devices.lock(device) if gpu else _NULL_LOCK
            with lock, evaluator.telemetry.sampling(device if gpu else -1, evaluator.settings.telemetry_interval) as samples:
                send_frame(self.handle.sock, {"op": "time"})
                got = self._recv(request.run_timeout)
            if got is None:
                return False
            header, payload = got
            if header.get("event") == "error":
                self._error(header)
                return False
            arrays = _decode_outputs(header, payload)
            if header.get("event") != "timing" or arrays is None:
                self._error({"phase": "run", "message": "the harness sent malformed timings"})
                return False
            del verdict.telemetry[:]
            verdict.telemetry.extend(samples)
            reasons = checking.throttled(samples)
            if reasons and attempt == 0:
                verdict.flags.append(Flag.VERDICT_FLAG_RETIMED)
                continue
            if reasons:
                verdict.flags.append(Flag.VERDICT_FLAG_TIMING_UNRELIABLE)
            break
        # The timed runs' outputs must still be right (a kernel that computes only when its
        # inputs change, or writes nothing after the first call, fails here).
        if not self._judge(request.trials, first, {"input_digests": first.digests}, arrays, outputs):
            verdict.message = "wrong during timing: " + verdict.message.removeprefix("wrong: ")
            return False
        verdict.stage = Stage.STAGE_PASSED
        verdict.candidate_timing.CopyFrom(checking.timing_stats(_floats(header.get("candidate"))))
        paired = _floats(header.get("reference"))
        if paired:
            reference = checking.timing_stats(paired)
        if reference is not None and reference.trials:
            verdict.reference_timing.CopyFrom(reference)
            verdict.speedup = checking.speedup(reference, verdict.candidate_timing)
        if request.on(Check.CHECK_SPEEDUP_BOUND) and verdict.speedup > evaluator.settings.suspicious_speedup:
            verdict.flags.append(Flag.VERDICT_FLAG_SUSPICIOUS_SPEEDUP)
        verdict.message = (f"passed: {verdict.speedup:.2f}x the reference" if verdict.speedup else "passed")
        return True

    def stop(self) -> None:
        if self.handle is not None:
            try:
                send_frame(self.handle.sock, {"op": "stop"})
            except OSError:
                pass


class _NullLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL_LOCK = _NullLock()


class _JobDir:
    """A candidate's working directory: owned by its slot's uid, removed afterwards."""

    def __init__(self, path: Path, uid: int | None):
        self.path = path
        self.uid = uid

    def __enter__(self) -> Path:
        self.path.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(self.path, self.uid, self.uid)
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _place(path: Path, text: str) -> None:
    """A file in a job directory that the candidate's uid can read but not change."""
    path.write_text(text)
    os.chmod(path, 0o644)


def _decode_outputs(header: dict[str, Any], payload: bytearray) -> dict[str, np.ndarray] | None:
    """Output arrays from an untrusted frame (None when the header does not describe the payload)."""
    described = header.get("outputs")
    if not isinstance(described, list):
        return None
    arrays, offset = {}, 0
    try:
        for item in described:
            dtype = np.dtype(str(item["dtype"]))
            if dtype.kind not in "fiub" or dtype.hasobject:
                return None
            shape = tuple(int(d) for d in item["shape"])
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if nbytes != int(item["nbytes"]) or offset + nbytes > len(payload):
                return None
            arrays[str(item["name"])] = np.frombuffer(payload, dtype=dtype, count=nbytes // dtype.itemsize,
                                                      offset=offset).reshape(shape)
            offset += nbytes
    except (KeyError, TypeError, ValueError):
        return None
    return arrays if offset == len(payload) else None


def _floats(values: Any) -> list[float]:
    if not isinstance(values, list):
        return []
    return [float(v) for v in values if isinstance(v, (int, float)) and v >= 0]


def _read(path: Path) -> str:
    return read_job_file(path)  # never follows a link the candidate left there


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["the compiler failed"])[0][:300]


def _mismatch_message(m: sandbox_pb2.Mismatch) -> str:
    if m.reason == "output not written":
        return f"wrong: {m.bad_elements} of {m.total_elements} elements of {m.output} were never written"
    if m.reason == "shape":
        return f"wrong: {m.output} has the wrong shape"
    return (f"wrong: {m.output}[{m.first_bad_index}] is {m.got:.6g}, expected {m.expected:.6g} "
            f"({m.bad_elements} of {m.total_elements} outside tolerance)")


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

