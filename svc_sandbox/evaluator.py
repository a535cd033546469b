"""One candidate's evaluation: FORMAT -> COMPILE -> RUN -> CORRECT -> timed, into a Verdict.

What each stage means (docs/ARCHITECTURE.md, "Sandbox", has the full table):
- FORMAT: no code block, the entry point is missing, or the static check rejected the code
  (flag FORBIDDEN_CALL): decided here, the same for every toolchain;
- COMPILE, RUN, CORRECT and the timing: decided by the candidate's toolchain
  (toolchains/cpu.py, cuda.py, kernelbench.py, one module each behind `Toolchain`), which
  runs the candidate's measured session through trust.py, the one place that says what the
  service believes and why.

The Evaluator is synchronous and runs on a worker thread with its own Zygote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from leap import prompts
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import compilers, static_check
from svc_sandbox.compile_cache import CompileCache
from svc_sandbox.isolation import SandboxUnavailable, Zygote
from svc_sandbox.references import ReferenceStore
from svc_sandbox.telemetry import Telemetry
from svc_sandbox.wire import WireError, recv_frame

Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain
Flag = sandbox_pb2.VerdictFlag
Check = sandbox_pb2.Check


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
    timing_run_seconds: float = 1e-3
    timing_cpu_run_seconds: float = 2e-3
    timing_max_runs: int = 20
    timing_budget_seconds: float = 0.3
    timing_interval_width: float = 0.15
    timing_unreliable_width: float = 0.25
    timing_verified_calls: int = 2
    timing_clock: str = "auto"
    session_memory_bytes: int = 64 << 20
    suspicious_speedup: float = 10.0
    max_log_bytes: int = 8192
    precompiled_header: bool = True
    kernelbench_device: str = "auto"
    task_dirs: tuple[str, ...] = ()
    telemetry_interval: float = 0.02
    uid_base: int | None = None  # slot k runs as uid_base + k; None: as the service's user
    slot_cores: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # pinning; empty: none


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


class JobDir:
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


def place(path: Path, text: str) -> None:
    """A file in a job directory that the candidate's uid can read but not change."""
    path.write_text(text)
    os.chmod(path, 0o644)


class Evaluator:
    def __init__(self, settings: Settings, cache: CompileCache, references: ReferenceStore, telemetry: Telemetry, log: Any):
        from svc_sandbox.toolchains import TOOLCHAINS

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
        self.toolchains = {key: factory(self) for key, factory in TOOLCHAINS.items()}

    # ----------------------------------------------------------------------------------
    # start-up

    def prepare(self, zygote: Zygote) -> None:
        """Build the precompiled header and probe for CUDA devices (once, at start)."""
        self.jobs.mkdir(parents=True, exist_ok=True)
        os.chmod(self.settings.work_dir, 0o755)
        os.chmod(self.jobs, 0o711)
        if self.settings.precompiled_header:
            self.prelude = self._build_prelude()
        nvcc = compilers.find(self.settings.nvcc)
        if nvcc is not None and nvcc.target:
            self.devices.cudart = compilers.cudart_path(nvcc.target)
        if self.devices.cudart is None:
            self.devices.reason = "no CUDA runtime (nvcc's libcudart) found"
            return
        with self.job_dir(zygote) as cwd:
            try:
                events = self.talk(zygote, {"kind": "cuda_probe", "cudart": self.devices.cudart}, cwd, 30.0)
            except WireError as err:
                events = [{"event": "probe", "count": 0, "error": f"the probe failed: {err}"}]
        probe = next((e for e in events if e.get("event") == "probe"), {"count": 0, "error": "the probe did not answer"})
        self.devices.cuda_count = int(probe.get("count", 0))
        self.devices.reason = "" if self.devices.cuda_count else str(probe.get("error") or "no CUDA device")

    def _build_prelude(self) -> str | None:
        compiler = compilers.find(self.settings.cpu_compiler)
        if compiler is None or "clang" in compiler.version.lower():
            return None
        folder = self.settings.work_dir / "pch"
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o755)
        header = folder / "prelude.h"
        header.write_text(compilers.PRELUDE)
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
    # helpers the toolchains share

    def job_dir(self, zygote: Zygote, service_owned: bool = False) -> JobDir:
        """A new job directory, owned by the slot's uid (or by the service's user: where the
        trusted reference process's code lives)."""
        with self._counter_lock:
            self._counter += 1
            number = self._counter
        return JobDir(self.jobs / f"{zygote.slot}-{number}", None if service_owned else zygote.uid)

    def env(self, cwd: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
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

    def talk(self, zygote: Zygote, spec: dict[str, Any], cwd: Path, wall: float) -> list[dict[str, Any]]:
        """Run a trusted job (the CUDA probe, a KernelBench probe: no candidate code) to
        completion; its frames' headers."""
        from svc_sandbox.isolation import Limits

        events = []
        deadline = time.monotonic() + wall
        limits = Limits(wall_seconds=wall, file_bytes=self.settings.file_bytes)
        with zygote.run(spec, str(cwd), self.env(cwd), limits, "run.log") as handle:
            while True:
                try:
                    header, _ = recv_frame(handle.sock, deadline=deadline, max_payload=0)
                except WireError:
                    break
                events.append(header)
                if header.get("event") in ("probe", "error"):  # its one frame: it exits after it
                    break
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

    def pin(self, zygote: Zygote) -> None:
        """Pin the worker's zygote (so every process it forks) and this thread (which writes and
        judges the worker's buffers) to the slot's cores: workers never share a core."""
        cores = self.settings.slot_cores.get(zygote.slot)
        if not cores:
            return
        zygote.ensure()
        if zygote.process is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(zygote.process.pid, cores)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)  # 0: the calling thread (Linux)

    def _evaluate(self, request: Request, zygote: Zygote) -> sandbox_pb2.Verdict:
        self.pin(zygote)
        candidate, task = request.candidate, request.task
        verdict = sandbox_pb2.Verdict(candidate_id=candidate.candidate_id, task_id=task.id, toolchain=candidate.toolchain,
                                      size=request.size)
        started = time.monotonic()
        try:
            code = self._format(request, verdict)
            if code is None:
                return verdict
            with self.job_dir(zygote) as cwd:
                self.toolchains[candidate.toolchain].evaluate(request, code, verdict, zygote, cwd)
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
