"""What every toolchain shares: the interface, and running a measured session (the regions,
the two processes' jobs and their limits, trust.Measurement)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import shm, trust
from svc_sandbox.isolation import Limits, Zygote

from svc_sandbox.evaluator import place

if TYPE_CHECKING:
    from svc_sandbox.evaluator import Evaluator, Request

Stage = common_pb2.Stage
Check = sandbox_pb2.Check
MOST_SLOTS = 256  # calls in one timed run, at most


@dataclasses.dataclass
class ReferenceJob:
    """The reference process of a session: its spec (without the layout), limits, the files
    its directory holds (its code) and extra environment."""

    spec: dict[str, Any]
    limits: Limits
    files: dict[str, str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    log: str = "reference.log"


class Toolchain:
    """Builds and measures candidates of one toolchain; fills their verdicts."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator
        self.settings = evaluator.settings

    def evaluate(self, request: Request, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> None:
        """Everything after FORMAT: compile, run, check, time (the evaluator made `cwd`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared

    def clock(self, on_device: bool) -> str:
        """The figure timed runs are measured by: each process's CPU time on a CPU with one
        thread per candidate (a busy machine's wait for a core is left out, and the sum over
        threads would hide what parallelism gains), else the wall clock (a GPU's work is not
        CPU time)."""
        wanted = self.settings.timing_clock
        if on_device:
            return "wall"
        if wanted == "auto":
            return "cpu" if self.settings.threads == 1 else "wall"
        return wanted

    def options(self, request: Request, *, staged: bool, load_timeout: float, tolerance: sandbox_pb2.Tolerance,
                reference_timeout: float = 0.0, on_device: bool = False) -> trust.Options:
        s = self.settings
        return trust.Options(
            trials=request.trials, timing=request.timing, min_pairs=request.timing_trials,
            warmup_runs=request.warmup_runs, run_timeout=request.run_timeout, load_timeout=load_timeout,
            sentinel=request.on(Check.CHECK_NAN_SENTINEL), input_mutation=request.on(Check.CHECK_INPUT_MUTATION),
            fresh_inputs=request.on(Check.CHECK_FRESH_INPUTS), alternate=request.on(Check.CHECK_ALTERNATE_ORDER),
            speedup_bound=s.suspicious_speedup if request.on(Check.CHECK_SPEEDUP_BOUND) else None,
            atol=tolerance.atol, rtol=tolerance.rtol,
            run_seconds=s.timing_cpu_run_seconds if self.clock(on_device) == "cpu" else s.timing_run_seconds,
            max_pairs=max(s.timing_max_runs, request.timing_trials), budget_seconds=s.timing_budget_seconds,
            interval_width=s.timing_interval_width, unreliable_width=max(s.timing_unreliable_width,
                                                                          s.timing_interval_width),
            verify_per_run=s.timing_verified_calls, staged=staged, charge_copies=request.on(Check.CHECK_DEVICE_SYNC),
            max_log_bytes=s.max_log_bytes, reference_timeout=reference_timeout, clock=self.clock(on_device))

    def limits(self, options: trust.Options, *, cpu: bool, processes: bool) -> Limits:
        """A session process's limits. The wall clock is a backstop (every command has its
        own limit, which binds first); RLIMIT_AS is set by the harness itself once its region
        is mapped (harness.limit_memory), so it is not set here."""
        runs = 3 * (options.trials + options.warmup_runs + 4) if options.timing else 3 * options.trials
        wall = options.load_timeout + options.run_timeout * runs + (options.budget_seconds if options.timing else 0) + 30
        s = self.settings
        return Limits(wall_seconds=wall, cpu_seconds=(wall * max(1, s.threads) + 1) if cpu else 0.0,
                      file_bytes=s.file_bytes, processes=s.processes if processes and s.uid_base is not None else 0)

    def job(self, spec: dict[str, Any], cwd: Path, limits: Limits, log: str, drop_privileges: bool,
            env: dict[str, str] | None = None) -> dict[str, Any]:
        return {"spec": spec, "cwd": str(cwd), "env": self.evaluator.env(cwd, env), "limits": limits.as_dict(),
                "log": log, "drop_privileges": drop_privileges}

    def measure(self, zygote: Zygote, layout: shm.Layout, source: trust.Source, options: trust.Options,
                verdict: sandbox_pb2.Verdict, *, candidate: dict[str, Any], reference: ReferenceJob | None,
                sampling: Callable[[], Any] | None = None,
                lock: contextlib.AbstractContextManager | None = None) -> trust.Measurement:
        """Run the session: regions sized for the layout, the candidate's harness (job
        `candidate`, its spec without the layout) and the reference process in a directory
        of its own, then trust.Measurement."""
        slots = shm.slots_for(layout, self.settings.session_memory_bytes, MOST_SLOTS) if options.timing else 1
        layout = layout.with_slots(slots)
        regions = [shm.Region(layout, "candidate")]
        if reference is not None:
            regions.append(shm.Region(layout, "reference"))
        cwd = Path(candidate["cwd"])
        display_limits = dataclasses.replace(Limits(**candidate["limits"]),
                                             memory_bytes=int(candidate["spec"].get("memory_bytes", 0)))
        try:
            candidate["spec"]["layout"] = layout.as_dict()
            with contextlib.ExitStack() as stack:
                logs = {trust.CANDIDATE: cwd / candidate["log"]}
                reference_job = None
                if reference is not None:
                    # The reference's code lives where the candidate's uid cannot write: the
                    # candidate owns its own job directory and could swap files in it.
                    folder = stack.enter_context(self.evaluator.job_dir(zygote, service_owned=True))
                    for name, text in reference.files.items():
                        place(folder / name, text)
                    reference_job = self.job({**reference.spec, "layout": layout.as_dict()}, folder, reference.limits,
                                             reference.log, drop_privileges=False, env=reference.env)
                    logs[trust.REFERENCE] = folder / reference.log
                if lock is not None:
                    stack.enter_context(lock)
                with zygote.session(candidate, reference_job, [r.fd for r in regions]) as link:
                    measurement = trust.Measurement(link, regions[0], regions[1] if reference is not None else None,
                                                    source, options, verdict, logs, display_limits, sampling)
                    measurement.measure()
                    return measurement
        finally:
            for region in regions:
                region.close()
