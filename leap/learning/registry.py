"""Runs as persisted resources, for every learner service (trainer, distiller).

A `RunRegistry` owns a directory of runs (`<root>/<run_id>/run.json`) and the worker threads
that execute them. A service gives it a *job factory*; a job is a callable that does the
work of one run, in a worker thread, given a `RunContext`:

    def job(ctx: RunContext) -> None:
        start = resume from ctx.latest_checkpoint() when there is one (else step 0)
        for step in range(start + 1, ctx.total_steps + 1):
            ... one step ...
            ctx.emit("train", step, {"loss": ...})          # metrics, persisted + streamed
            if step % every == 0 or ctx.stop_requested():
                save a checkpoint under ctx.checkpoint_dir; ctx.checkpoint_saved(info)
            if ctx.stop_requested():
                return                                      # -> STOPPED
        # returning after the last step -> SUCCEEDED; raising -> FAILED with the cause

The registry does the rest: idempotent starts by request id, a FIFO of PENDING runs under a
concurrency limit, state transitions with their events, stop after the current step,
resume from the last checkpoint (the metric log is rewound to it, so no step is reported
twice), pages of runs newest first, a replayable event log with live followers, and
recovery after a restart (runs that were RUNNING become FAILED with the cause and, with
`auto_resume`, continue from their last checkpoint).

One run owns its output directory. `start` claims it with an owner file (`.leap-run`,
created exclusively, naming the run) and refuses a directory that another run owns, that
holds an older run's checkpoints or events, or that another process is training in
(`OutputDirTaken`). While its job runs, the worker holds an exclusive `flock` on
`.leap-run.lock` in the directory; the kernel drops it when the process dies, however it
dies, so a killed trainer never leaves the directory locked, and two processes (two
services on one runs directory, or one started twice) never train the same run at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from leap.common.v1 import common_pb2
from leap.learning import checkpoint as ckpt
from leap.learning.metrics import MetricsLog
from leap.learning.reporters import TrackedRun, open_reporters
from leap.runtime.logging import get_logger

RunState = common_pb2.RunState
PENDING, RUNNING, STOPPING = RunState.RUN_STATE_PENDING, RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_STOPPING
STOPPED, SUCCEEDED, FAILED = RunState.RUN_STATE_STOPPED, RunState.RUN_STATE_SUCCEEDED, RunState.RUN_STATE_FAILED
ACTIVE = (PENDING, RUNNING, STOPPING)
TERMINAL = (STOPPED, SUCCEEDED, FAILED)
RESUMABLE = (STOPPED, FAILED)
RUN_FILE = "run.json"
OWNER_FILE = ".leap-run"  # in a run's output directory: the id of the run that owns it
LOCK_FILE = ".leap-run.lock"  # flock-ed by the process training the run, for as long as it does
RUN_DATA = ("checkpoints", "events.jsonl")  # what a directory that held a run has

log = get_logger("leap.runs")


def state_name(state: int) -> str:
    return RunState.Name(state).removeprefix("RUN_STATE_")


class RunNotFound(KeyError):
    """No run has this id."""


class RunStateError(Exception):
    """The run is in a state that does not allow the operation."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class RequestConflict(Exception):
    """A request id was used before with a different configuration."""


class RunFailure(Exception):
    """A job's failure whose message is already what a person should read (no type prefix)."""


class OutputDirTaken(RunStateError):
    """Another run owns the output directory, or another process is training in it."""

    def __init__(self, message: str):
        super().__init__(message, "OUTPUT_DIR_IN_USE")


class DirLock:
    """An exclusive `flock` on `<directory>/.leap-run.lock`, held by this process until
    `release` (or its death: the kernel drops it). The lock file holds the holder's pid, for
    messages only."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> DirLock:
        """Take the lock, or `OutputDirTaken` naming the process that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise OutputDirTaken(f"output_dir {str(self.path.parent)!r} is in use: process {holder_of(self.path)} is "
                                 "training a run in it; choose another directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def holder_of(lock_file: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        return str(int(lock_file.read_text().strip()))
    return "(unknown)"


def claim_output_dir(directory: str | os.PathLike, run_id: str) -> None:
    """Make `directory` the output directory of `run_id` (creating it), or `OutputDirTaken`
    when another run owns it, an older run left its data there, or a process trains in it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    owner = path / OWNER_FILE
    try:
        fd = os.open(owner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        other = owner.read_text().strip() or "(being claimed)"
        if other != run_id:
            raise OutputDirTaken(f"output_dir {str(path)!r} belongs to run {other} (its checkpoints and events are "
                                 f"there; {OWNER_FILE} names it): choose another directory, or resume run {other}") from None
        return
    try:
        leftovers = [name for name in RUN_DATA if (path / name).exists()]
        if leftovers:
            raise OutputDirTaken(f"output_dir {str(path)!r} holds {' and '.join(leftovers)} of an earlier run: a new "
                                 "run there would resume from them or mix its events with theirs; choose an empty "
                                 "directory")
        probe = DirLock(path).acquire()  # a process of an older version training there without an owner file
        probe.release()
        os.write(fd, f"{run_id}\n".encode())
    except BaseException:
        os.close(fd)
        fd = -1
        with contextlib.suppress(OSError):
            owner.unlink()
        raise
    finally:
        if fd >= 0:
            os.close(fd)


@dataclasses.dataclass
class RunRecord:
    """Everything persisted about one run (run.json)."""

    run_id: str
    request_id: str
    config: dict[str, Any]  # the service's config message as JSON (defaults filled in)
    fingerprint: str  # of the request's config as sent, for idempotency checks
    total_steps: int
    output_dir: str
    display_name: str = ""
    state: int = PENDING
    step: int = 0
    round: int = 0
    error: str = ""
    latest_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    create_time: float = dataclasses.field(default_factory=time.time)
    update_time: float = dataclasses.field(default_factory=time.time)
    attempts: int = 0  # times a worker started it (1 + resumes)
    resume_on_start: bool = False  # stopped by a service shutdown: continue at the next start
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the job's own JSON state
    report_to: list[str] = dataclasses.field(default_factory=list)  # experiment trackers (leap.learning.reporters)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class RunContext:
    """What a job sees of its run (see the module docstring). Safe to use from the job's thread."""

    def __init__(self, registry: RunRegistry, run_id: str):
        self.registry = registry
        self.run_id = run_id
        record = registry.get(run_id)
        self.config = record.config
        self.output_dir = Path(record.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.log = log.bind(run_id=run_id)

    @property
    def record(self) -> RunRecord:
        return self.registry.get(self.run_id)

    @property
    def total_steps(self) -> int:
        return self.record.total_steps

    def stop_requested(self) -> bool:
        return self.registry._stop_flag(self.run_id).is_set()

    def emit(self, kind: str, step: int, values: dict[str, float] | None = None, message: str = "") -> None:
        """Record a metric event ("train", "eval", "log", ...); "train" moves the run's step."""
        self.registry._emit(self.run_id, kind, step, values or {}, message)

    def progress(self, *, step: int | None = None, total_steps: int | None = None, round: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.registry._progress(self.run_id, step=step, total_steps=total_steps, round=round, extra=extra)

    def events(self, from_step: int = 0) -> list[dict[str, Any]]:
        """The run's recorded metric events (for plots and reports)."""
        return self.registry.metrics_log(self.run_id).read(from_step)

    def latest_checkpoint(self) -> ckpt.CheckpointInfo | None:
        return ckpt.latest_checkpoint(self.checkpoint_dir)

    def checkpoint_saved(self, info: ckpt.CheckpointInfo | None) -> None:
        if info is not None:
            self.emit("checkpoint", info.step, {"size_bytes": float(info.size_bytes)}, str(info.path))


Job = Callable[[RunContext], None]
JobFactory = Callable[[RunRecord], Job]


class RunRegistry:
    """See the module docstring. Methods are thread-safe; `events` is async."""

    def __init__(self, root: str | os.PathLike, job_factory: JobFactory, *, max_concurrent: int = 1,
                 auto_resume: bool = True, tensorboard: bool = True, service: str = ""):
        self.root = Path(root)
        self.service = service  # the service's name, a tag of tracker runs
        self.job_factory = job_factory
        self.max_concurrent = max(1, max_concurrent)
        self.auto_resume = auto_resume
        self.tensorboard = tensorboard
        self._lock = threading.RLock()
        self._records: dict[str, RunRecord] = {}
        self._by_request: dict[str, str] = {}
        self._queue: list[str] = []  # PENDING run ids, first come first served
        self._workers: dict[str, threading.Thread] = {}
        self._stop_flags: dict[str, threading.Event] = {}
        self._logs: dict[str, MetricsLog] = {}
        self._subscribers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Queue]]] = {}
        self._closing = False

    # --- lifecycle of the registry ----------------------------------------------------------

    def open(self) -> RunRegistry:
        """Load the persisted runs and recover those a previous process left active."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            for path in sorted(self.root.glob(f"*/{RUN_FILE}")):
                try:
                    record = RunRecord.from_json(json.loads(path.read_text()))
                except (OSError, ValueError, TypeError) as err:
                    log.warning("unreadable run record skipped", path=str(path), error=str(err))
                    continue
                self._records[record.run_id] = record
                self._by_request[record.request_id] = record.run_id
            for record in sorted(self._records.values(), key=lambda r: r.create_time):
                self._recover(record)
            self._schedule()
        return self

    def _recover(self, record: RunRecord) -> None:
        if record.state == PENDING:
            self._queue.append(record.run_id)
        elif record.state == STOPPING:
            self._transition(record, STOPPED, "stopped: the service ended while the run was stopping")
        elif record.state == RUNNING:
            at = ckpt.latest_checkpoint(Path(record.output_dir) / "checkpoints")
            where = f"step {at.step}" if at else "the beginning (no checkpoint yet)"
            record.error = (f"interrupted: the service stopped while the run was RUNNING at step {record.step}; "
                            f"resumable from {where}")
            self._transition(record, FAILED, record.error)
            if self.auto_resume:
                self._resume_locked(record, "resumed automatically after a service restart")
        elif record.state == STOPPED and record.resume_on_start and self.auto_resume:
            self._resume_locked(record, "resumed automatically after a service restart")

    def close(self, timeout: float = 60.0) -> None:
        """Ask running jobs to stop after their current step (they resume at the next start)
        and wait up to `timeout` seconds for them."""
        with self._lock:
            self._closing = True
            workers = dict(self._workers)
            for run_id in workers:
                record = self._records[run_id]
                record.resume_on_start = True
                if record.state == RUNNING:
                    self._transition(record, STOPPING, "stopping: the service is shutting down")
                self._stop_flags[run_id].set()
        deadline = time.monotonic() + timeout
        for thread in workers.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            for metrics in self._logs.values():
                metrics.close()

    # --- the run API ------------------------------------------------------------------------

    def find_request(self, request_id: str) -> RunRecord | None:
        with self._lock:
            run_id = self._by_request.get(request_id)
            return self._copy(self._records[run_id]) if run_id else None

    def start(self, request_id: str, config: dict[str, Any], fingerprint: str, total_steps: int, *,
              output_dir: str = "", display_name: str = "", report_to: list[str] | tuple[str, ...] = ()
              ) -> tuple[RunRecord, bool]:
        """Create and queue a run; (record, created). The same request id returns the same run;
        with a different fingerprint it is a `RequestConflict`."""
        with self._lock:
            existing = self._by_request.get(request_id)
            if existing:
                record = self._records[existing]
                if record.fingerprint != fingerprint:
                    raise RequestConflict(f"request_id {request_id!r} was used for run {existing} with a different config")
                return self._copy(record), False
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            record = RunRecord(run_id=run_id, request_id=request_id, config=config, fingerprint=fingerprint,
                               total_steps=total_steps, output_dir=output_dir or str(self.root / run_id),
                               display_name=display_name, report_to=list(report_to))
            mine = Path(record.output_dir).resolve()
            for other in self._records.values():
                if Path(other.output_dir).resolve() == mine:
                    raise OutputDirTaken(f"output_dir {record.output_dir!r} belongs to run {other.run_id} "
                                         f"({state_name(other.state)}): choose another directory, or resume run "
                                         f"{other.run_id}")
            claim_output_dir(record.output_dir, run_id)
            (self.root / run_id).mkdir(parents=True, exist_ok=True)
            self._records[run_id] = record
            self._by_request[request_id] = run_id
            self._transition(record, PENDING, "accepted")
            self._queue.append(run_id)
            self._schedule()
            return self._copy(record), True

    def get(self, run_id: str) -> RunRecord:
        with self._lock:
            if run_id not in self._records:
                raise RunNotFound(run_id)
            return self._copy(self._records[run_id])

    def list(self, page_size: int = 50, page_token: str = "", state: int = 0) -> tuple[list[RunRecord], str]:
        """A page of runs, newest first, optionally in one state; (runs, next_page_token)."""
        after = decode_page_token(page_token) if page_token else None
        with self._lock:
            runs = sorted(self._records.values(), key=lambda r: (r.create_time, r.run_id), reverse=True)
            if state:
                runs = [r for r in runs if r.state == state]
            if after is not None:
                runs = [r for r in runs if (r.create_time, r.run_id) < after]
            page = [self._copy(r) for r in runs[:page_size]]
        more = len(runs) > page_size
        token = encode_page_token((page[-1].create_time, page[-1].run_id)) if more and page else ""
        return page, token

    def stop(self, run_id: str) -> RunRecord:
        """PENDING: stopped at once. RUNNING: STOPPING until its current step and checkpoint
        are done. STOPPING: unchanged. Ended runs: `RunStateError`."""
        with self._lock:
            record = self._record(run_id)
            if record.state == PENDING:
                if run_id in self._queue:
                    self._queue.remove(run_id)
                self._transition(record, STOPPED, "stopped before it started")
            elif record.state == RUNNING:
                self._stop_flags[run_id].set()
                self._transition(record, STOPPING, "stopping after the current step")
            elif record.state != STOPPING:
                raise RunStateError(f"run {run_id} is {state_name(record.state)}; only PENDING or RUNNING runs can be "
                                    "stopped", "RUN_NOT_ACTIVE")
            return self._copy(record)

    def resume(self, run_id: str) -> RunRecord:
        """Queue a STOPPED or FAILED run again; it continues from its last checkpoint."""
        with self._lock:
            record = self._record(run_id)
            if record.state not in RESUMABLE:
                raise RunStateError(f"run {run_id} is {state_name(record.state)}; only STOPPED or FAILED runs can be "
                                    "resumed", "RUN_NOT_RESUMABLE")
            self._resume_locked(record, "resume requested")
            self._schedule()
            return self._copy(record)

    def checkpoints(self, run_id: str) -> list[ckpt.CheckpointInfo]:
        record = self.get(run_id)
        return ckpt.list_checkpoints(Path(record.output_dir) / "checkpoints")

    def metrics_log(self, run_id: str) -> MetricsLog:
        with self._lock:
            record = self._record(run_id)
            if run_id not in self._logs:
                self._logs[run_id] = MetricsLog(record.output_dir, tensorboard=self.tensorboard)
            return self._logs[run_id]

    async def events(self, run_id: str, from_step: int = 0, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Recorded events from `from_step`, then (with `follow`) live ones until the run ends."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        subscriber = (loop, queue)
        with self._lock:
            record = self._record(run_id)
            replay = self.metrics_log(run_id).read(from_step)
            ended = record.state in TERMINAL and run_id not in self._workers
            if follow and not ended:
                self._subscribers.setdefault(run_id, set()).add(subscriber)
        try:
            last = 0
            for event in replay:
                last = event["seq"]
                yield event
            if not follow or ended:
                return
            while True:
                event = await queue.get()
                if event["seq"] <= last or (event["kind"] != "state" and event["step"] < from_step):
                    continue
                last = event["seq"]
                yield event
                if event["kind"] == "state" and event["state"] in TERMINAL:
                    return
        finally:
            with self._lock:
                self._subscribers.get(run_id, set()).discard(subscriber)

    # --- internals (lock held unless said otherwise) ----------------------------------------

    def _record(self, run_id: str) -> RunRecord:
        if run_id not in self._records:
            raise RunNotFound(run_id)
        return self._records[run_id]

    @staticmethod
    def _copy(record: RunRecord) -> RunRecord:
        return RunRecord.from_json(json.loads(json.dumps(record.to_json())))

    def _stop_flag(self, run_id: str) -> threading.Event:
        with self._lock:
            return self._stop_flags.setdefault(run_id, threading.Event())

    def _persist(self, record: RunRecord) -> None:
        record.update_time = time.time()
        directory = self.root / record.run_id
        directory.mkdir(parents=True, exist_ok=True)
        ckpt.write_json_atomic(directory / RUN_FILE, record.to_json())

    def _transition(self, record: RunRecord, state: int, message: str) -> None:
        record.state = state
        self._persist(record)
        log.info("run state", run_id=record.run_id, state=state_name(state), step=record.step, message=message)
        self._publish(record, {"kind": "state", "step": record.step, "values": {}, "message": message})

    def _publish(self, record: RunRecord, event: dict[str, Any]) -> None:
        event = {"run_id": record.run_id, "time": time.time(), "state": record.state, **event}
        event = self.metrics_log(record.run_id).append(event)
        for loop, queue in list(self._subscribers.get(record.run_id, ())):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # that follower's loop is closed
                self._subscribers[record.run_id].discard((loop, queue))

    def _emit(self, run_id: str, kind: str, step: int, values: dict[str, float], message: str) -> None:
        with self._lock:
            record = self._record(run_id)
            values = {k: float(v) for k, v in values.items()}
            if kind == "train":
                record.step = max(record.step, int(step))
                record.latest_metrics.update(values)
            elif kind == "eval":
                record.latest_metrics.update({f"eval/{k}": v for k, v in values.items()})
            if kind in ("train", "eval"):
                self._persist(record)
            self._publish(record, {"kind": kind, "step": int(step), "values": values, "message": message})

    def _progress(self, run_id: str, *, step: int | None, total_steps: int | None, round: int | None,
                  extra: dict[str, Any] | None) -> None:
        with self._lock:
            record = self._record(run_id)
            if step is not None:
                record.step = int(step)
            if total_steps is not None:
                record.total_steps = int(total_steps)
            if round is not None:
                record.round = int(round)
            if extra:
                record.extra.update(extra)
            self._persist(record)

    def _resume_locked(self, record: RunRecord, message: str) -> None:
        record.error = ""
        record.resume_on_start = False
        self._stop_flags[record.run_id] = threading.Event()
        self._transition(record, PENDING, message)
        if record.run_id not in self._queue:
            self._queue.append(record.run_id)

    def _schedule(self) -> None:
        while self._queue and len(self._workers) < self.max_concurrent and not self._closing:
            run_id = self._queue.pop(0)
            record = self._records[run_id]
            if record.state != PENDING:
                continue
            record.attempts += 1
            self._stop_flags[run_id] = threading.Event()
            at = ckpt.latest_checkpoint(Path(record.output_dir) / "checkpoints")
            start_step = at.step if at else 0
            if record.attempts > 1 or record.step > start_step:
                self.metrics_log(run_id).rewind(start_step)
            record.step = start_step
            thread = threading.Thread(target=self._work, args=(run_id,), name=f"run-{run_id}", daemon=True)
            self._workers[run_id] = thread
            self._transition(record, RUNNING, f"running from step {start_step}" + (f" (attempt {record.attempts})"
                                                                                   if record.attempts > 1 else ""))
            thread.start()

    def _work(self, run_id: str) -> None:
        """A worker thread: open the run's trackers, run the job, then record how it ended."""
        error = ""
        metrics = self.metrics_log(run_id)
        lock = DirLock(self.get(run_id).output_dir)
        try:
            lock.acquire()  # held while the job runs: no other process trains in this directory meanwhile
            context = RunContext(self, run_id)
            record = self.get(run_id)
            if record.report_to:
                metrics.attach(open_reporters(record.report_to, TrackedRun(
                    run_id=run_id, display_name=record.display_name, config=record.config,
                    output_dir=Path(record.output_dir), runs_dir=self.root, service=self.service)))
            job = self.job_factory(record)
            job(context)
        except BaseException as err:  # noqa: BLE001 - every failure of a job is the run's failure
            error = str(err) if isinstance(err, (RunFailure, OutputDirTaken)) else f"{type(err).__name__}: {err}"
            log.exception("run failed", run_id=run_id)
        with self._lock:
            record = self._records[run_id]
            if error:
                record.error, state, message = error, FAILED, f"failed: {error}"
            elif self._stop_flags[run_id].is_set() and record.step < record.total_steps:
                state, message = STOPPED, (f"stopped at step {record.step}"
                                           + ("; resumes at the next service start" if record.resume_on_start else ""))
            elif record.step >= record.total_steps:
                state, message = SUCCEEDED, f"finished {record.step} steps"
            else:
                record.error = f"the job returned at step {record.step} of {record.total_steps} without a stop request"
                state, message = FAILED, record.error
        # The trackers get the plots and the end state before the run is seen to end, so a
        # client that waits for the end finds the tracker run complete; outside the registry's
        # lock, as they may upload files, and while the run's directory is still this process's.
        try:
            metrics.detach(state_name(state))
        finally:
            lock.release()
        with self._lock:
            self._workers.pop(run_id, None)
            self._transition(record, state, message)
            self._schedule()


def encode_page_token(key: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[float, str]:
    """The position a page token stands for; ValueError when it is not one of ours."""
    try:
        padded = token + "=" * (-len(token) % 4)
        created, run_id = json.loads(base64.urlsafe_b64decode(padded.encode()))
        return float(created), str(run_id)
    except (ValueError, TypeError) as err:
        raise ValueError("not a page token issued by this service") from err
