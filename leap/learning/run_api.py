"""The run RPCs of a learner service (StartRun, GetRun, ListRuns, StopRun, ResumeRun,
StreamMetrics, ListCheckpoints) over a `RunRegistry`, for any contract that follows the run
conventions of docs/ARCHITECTURE.md (the trainer's and the distiller's do).

A servicer mixes it in before its generated base class and says what is its own:

    class DistillServicer(RunApi, distill_pb2_grpc.DistillServiceServicer):
        messages = distill_pb2                      # the contract's module

        def __init__(self, registry):
            self.registry = registry

        async def prepare_config(self, config):     # validate (raise ServiceError) and fill defaults
            return config_with_defaults, total_steps

The registry's job factory receives the stored record; `self.config_of(record)` (or
`config_from_record`) turns its config back into the contract's message.

`RunServiceConfig` holds the server settings every learner service has (runs directory,
concurrency, resume, device, patience with other services, checkpoints kept, shutdown);
with them, `make_registry`, `start` and `stop` give a servicer its registry's lifecycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2

from leap.common.v1 import common_pb2
from leap.learning.registry import (
    OutputDirTaken, RequestConflict, RunNotFound, RunRecord, RunRegistry, RunStateError,
)
from leap.runtime import ServerConfig, Violations, failed_precondition, invalid_argument, not_found, option
from leap.runtime.errors import ServiceError

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 50
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
SYSTEM_TREES = ("/proc", "/sys", "/dev")  # kernel interfaces, not storage


def output_dir_problem(path: str) -> str | None:
    """Why `path` cannot be a run's output directory (None when it can): too long, inside
    /proc, /sys or /dev, an existing file, or under a folder that cannot be written."""
    if len(path) > MAX_PATH_CHARS:
        return f"must be at most {MAX_PATH_CHARS} characters, got {len(path)}"
    if "\0" in path:
        return "must not contain a NUL character"
    resolved = os.path.realpath(os.path.expanduser(path))
    for tree in SYSTEM_TREES:
        if resolved == tree or resolved.startswith(tree + "/"):
            return f"{path!r} is inside {tree}, a kernel interface, not storage: choose a directory on a disk"
    if os.path.exists(resolved) and not os.path.isdir(resolved):
        return f"{path!r} exists and is not a directory"
    existing = resolved
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing!r} is a file, so {path!r} cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing!r} is not writable by the service (uid {os.getuid()}), so {path!r} cannot be used"
    return None


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def config_fingerprint(config: Message) -> str:
    return hashlib.sha256(config.SerializeToString(deterministic=True)).hexdigest()


def config_to_json(config: Message) -> dict[str, Any]:
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def config_from_record(record: RunRecord, config_class: type[Message]) -> Message:
    return json_format.ParseDict(record.config, config_class(), ignore_unknown_fields=True)


def metric_event(event: dict[str, Any]) -> common_pb2.MetricEvent:
    return common_pb2.MetricEvent(
        run_id=event["run_id"], step=int(event["step"]), time=timestamp(event["time"]), kind=event["kind"],
        values={k: float(v) for k, v in event.get("values", {}).items()}, message=event.get("message", ""),
        state=int(event.get("state", 0)),
    )


@dataclasses.dataclass
class RunServiceConfig(ServerConfig):
    """Settings every learner service shares (server settings included); a service sets its
    own `runs_dir` default."""

    runs_dir: str = option("runs", "Directory of the runs: one folder per run with its record, metrics, TensorBoard "
                           "events, plots and checkpoints (unless a run names its own output_dir).")
    max_concurrent_runs: int = option(1, "Runs trained at once; later ones wait as PENDING.")
    auto_resume: bool = option(True, "At start, continue runs a previous process left RUNNING (or stopped by its "
                               "shutdown) from their last checkpoint.")
    device: str = option("auto", "Device of the learner: auto (the GPU of this rank when present, else cpu), cpu, cuda:0 ...")
    preflight_timeout_seconds: float = option(5.0, "How long StartRun waits for each service's health check.")
    service_retry_seconds: float = option(60.0, "How long a run retries a service that stopped answering (with "
                                          "backoff) before it fails with the cause and a resumable checkpoint.")
    keep_checkpoints: int = option(3, "Checkpoints kept per run, newest first (0 keeps all); the last one is always kept.")
    shutdown_wait_seconds: float = option(120.0, "On shutdown, how long running jobs get to finish their step and "
                                          "checkpoint (they resume at the next start).")
    tensorboard: bool = option(True, "Also write metrics as TensorBoard events (besides events.jsonl).")
    weight_transport: str = option("auto", "How the learner's weights reach the policy service: auto (shared memory when "
                                           "the policy is on this host, else a torch.distributed group when it offers "
                                           "one, else the UpdateWeights stream), shm, distributed or stream.")

    def __post_init__(self) -> None:
        from leap.clients.transports import CHOICES

        if self.weight_transport not in CHOICES:
            raise ValueError(f"weight_transport: must be one of {', '.join(CHOICES)}, not {self.weight_transport!r}")
        # Several processes (torchrun) train one learner in lockstep: one run at a time.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.max_concurrent_runs != 1:
            raise ValueError("max_concurrent_runs: must be 1 when the learner spans several processes (WORLD_SIZE > 1)")


class RunApi:
    """Mixin implementing the run RPCs; see the module docstring."""

    messages: ModuleType
    registry: RunRegistry
    settings: RunServiceConfig

    def make_job(self, record: RunRecord):
        """The job of a run (see `leap.learning.registry`)."""
        raise NotImplementedError

    def make_registry(self, settings: RunServiceConfig) -> RunRegistry:
        return RunRegistry(settings.runs_dir, self.make_job, max_concurrent=settings.max_concurrent_runs,
                           auto_resume=settings.auto_resume, tensorboard=settings.tensorboard,
                           service=self.messages.DESCRIPTOR.package.split(".")[1])

    async def start(self) -> None:
        """Load the persisted runs (the service's on_start)."""
        await asyncio.to_thread(self.registry.open)

    async def stop(self) -> None:
        """Let running jobs finish their step and checkpoint (the service's on_stop)."""
        await asyncio.to_thread(self.registry.close, self.settings.shutdown_wait_seconds)

    async def prepare_config(self, config: Message) -> tuple[Message, int]:
        """Validate a requested config (raise `ServiceError`, naming fields as `config.<path>`)
        and return it with the defaults filled in, and the run's total steps."""
        raise NotImplementedError

    @property
    def config_class(self) -> type[Message]:
        return type(self.messages.StartRunRequest().config)

    def config_of(self, record: RunRecord) -> Message:
        return config_from_record(record, self.config_class)

    def run_message(self, record: RunRecord) -> Message:
        run = self.messages.Run(
            run_id=record.run_id, request_id=record.request_id, state=record.state, step=record.step,
            total_steps=record.total_steps, error=record.error, output_dir=record.output_dir,
            create_time=timestamp(record.create_time), update_time=timestamp(record.update_time),
        )
        run.latest_metrics.update(record.latest_metrics)
        run.config.CopyFrom(self.config_of(record))
        if "round" in run.DESCRIPTOR.fields_by_name:
            run.round = record.round
        return run

    def _get(self, run_id: str) -> RunRecord:
        if not run_id:
            raise invalid_argument("run_id", "is required")
        try:
            return self.registry.get(run_id)
        except RunNotFound:
            raise not_found("run", run_id) from None

    async def StartRun(self, request, context):
        violations = Violations()
        violations.check(bool(request.request_id), "request_id", "is required (a client-chosen idempotency key)")
        violations.check(request.HasField("config"), "config", "is required")
        violations.raise_if_any()
        output_dir = getattr(request.config, "output_dir", "")
        if output_dir:  # reported with the config's other problems, in one error
            problem = output_dir_problem(output_dir)
            violations.check(problem is None, "config.output_dir", problem or "")
        fingerprint = config_fingerprint(request.config)
        existing = self.registry.find_request(request.request_id)
        if existing is not None:
            if existing.fingerprint != fingerprint:
                raise failed_precondition(f"request_id {request.request_id!r} was already used for run "
                                          f"{existing.run_id} with a different config", "REQUEST_ID_REUSED")
            return self.messages.StartRunResponse(run=self.run_message(existing))
        try:
            config, total_steps = await self.prepare_config(request.config)
        except ServiceError as err:
            if not violations.items or err.code != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            for detail in err.details:
                if isinstance(detail, error_details_pb2.BadRequest):
                    for item in detail.field_violations:
                        violations.add(item.field, item.description)
            violations.raise_if_any()
            raise
        violations.raise_if_any()
        try:
            record, _ = self.registry.start(
                request.request_id, config_to_json(config), fingerprint, total_steps,
                output_dir=getattr(config, "output_dir", ""), display_name=getattr(config, "display_name", ""),
                report_to=list(getattr(config, "report_to", ())))
        except RequestConflict as err:
            raise failed_precondition(str(err), "REQUEST_ID_REUSED") from None
        except OutputDirTaken as err:
            raise failed_precondition(str(err), err.reason) from None
        except OSError as err:  # the directory could not be created after all (a full disk, a race)
            raise invalid_argument("config.output_dir", f"cannot be created: {err}") from None
        return self.messages.StartRunResponse(run=self.run_message(record))

    async def GetRun(self, request, context):
        return self.messages.GetRunResponse(run=self.run_message(self._get(request.run_id)))

    async def ListRuns(self, request, context):
        violations = Violations()
        violations.check(0 <= request.page_size, "page_size", "must not be negative")
        violations.raise_if_any()
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        try:
            records, token = self.registry.list(size, request.page_token, request.state)
        except ValueError:
            raise invalid_argument("page_token", "is not a token this service issued") from None
        return self.messages.ListRunsResponse(runs=[self.run_message(r) for r in records], next_page_token=token)

    async def StopRun(self, request, context):
        self._get(request.run_id)
        try:
            record = self.registry.stop(request.run_id)
        except RunStateError as err:
            raise failed_precondition(str(err), err.reason) from None
        return self.messages.StopRunResponse(run=self.run_message(record))

    async def ResumeRun(self, request, context):
        self._get(request.run_id)
        try:
            record = self.registry.resume(request.run_id)
        except RunStateError as err:
            raise failed_precondition(str(err), err.reason) from None
        return self.messages.ResumeRunResponse(run=self.run_message(record))

    async def StreamMetrics(self, request, context):
        violations = Violations()
        violations.check(request.from_step >= 0, "from_step", "must not be negative")
        violations.raise_if_any()
        self._get(request.run_id)
        async for event in self.registry.events(request.run_id, request.from_step, follow=not request.no_follow):
            yield self.messages.StreamMetricsResponse(event=metric_event(event))

    async def ListCheckpoints(self, request, context):
        self._get(request.run_id)
        checkpoints = [
            common_pb2.Checkpoint(step=c.step, path=str(c.path), create_time=timestamp(c.create_time),
                                  size_bytes=c.size_bytes)
            for c in self.registry.checkpoints(request.run_id)
        ]
        return self.messages.ListCheckpointsResponse(checkpoints=checkpoints)
