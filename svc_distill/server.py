"""The DistillService servicer: a thin layer between the contract and the algorithms.

The run RPCs come from `leap.learning.RunApi` over a `RunRegistry`; this module adds the
distiller's config checks (config.py, preflight.py) and its job (job.py: TU-OPD steps).
"""

from __future__ import annotations

import asyncio
import dataclasses

from leap.distill.v1 import distill_pb2, distill_pb2_grpc
from leap.learning.registry import RunRecord, RunRegistry
from leap.learning.run_api import RunApi
from leap.runtime import Registration, ServerConfig, Service, ServiceSpec, local_address, option
from svc_distill import config as run_config
from svc_distill.preflight import preflight

SERVICE_NAME = "leap.distill.v1.DistillService"


@dataclasses.dataclass
class DistillConfig(ServerConfig):
    """Settings of the distill service (server settings included)."""

    runs_dir: str = option("runs/distill", "Directory of the runs: one folder per run with its record, metrics, "
                           "TensorBoard events, plots and checkpoints (unless a run names its own output_dir).")
    student_address: str = option(local_address("policy"), "PolicyService target of runs that leave student_address "
                                  "empty: it serves the student (and the teachers the distiller loads).")
    sandbox_address: str = option(local_address("sandbox"), "SandboxService target of runs that leave sandbox_address "
                                  "empty: task statements and held-out evaluation.")
    max_concurrent_runs: int = option(1, "Runs trained at once; later ones wait as PENDING.")
    auto_resume: bool = option(True, "At start, continue runs a previous process left RUNNING (or stopped by its "
                               "shutdown) from their last checkpoint.")
    device: str = option("auto", "Device of the learner: auto (the GPU when present, else cpu), cpu, cuda:0 ...")
    preflight_timeout_seconds: float = option(5.0, "How long StartRun waits for each service's health check.")
    service_retry_seconds: float = option(60.0, "How long a run retries a service that stopped answering (with "
                                          "backoff) before it fails with the cause and a resumable checkpoint.")
    call_timeout_seconds: float = option(600.0, "Deadline of one call to another service (a whole Generate, Score "
                                         "or held-out evaluation batch).")
    keep_checkpoints: int = option(3, "Checkpoints kept per run, newest first (0 keeps all); the last one is always kept.")
    shutdown_wait_seconds: float = option(120.0, "On shutdown, how long running jobs get to finish their step and "
                                          "checkpoint (they resume at the next start).")
    tensorboard: bool = option(True, "Also write metrics as TensorBoard events (besides events.jsonl).")


class DistillServicer(RunApi, distill_pb2_grpc.DistillServiceServicer):
    """TU-OPD distillation with Consensus-Residual Decomposition, as runs."""

    messages = distill_pb2

    def __init__(self, settings: DistillConfig, registry: RunRegistry | None = None):
        self.settings = settings
        self.registry = registry or RunRegistry(settings.runs_dir, self.make_job, max_concurrent=settings.max_concurrent_runs,
                                                auto_resume=settings.auto_resume, tensorboard=settings.tensorboard)

    async def prepare_config(self, config: distill_pb2.DistillConfig) -> tuple[distill_pb2.DistillConfig, int]:
        run_config.violations(config).raise_if_any()
        filled = run_config.with_defaults(config, student_address=self.settings.student_address,
                                          sandbox_address=self.settings.sandbox_address)
        prepared = await preflight(filled, timeout=self.settings.preflight_timeout_seconds)
        return prepared.config, prepared.config.steps

    def make_job(self, record: RunRecord):
        from svc_distill.job import DistillJob

        return DistillJob(self.config_of(record), self.settings)

    async def start(self) -> None:
        await asyncio.to_thread(self.registry.open)

    async def stop(self) -> None:
        await asyncio.to_thread(self.registry.close, self.settings.shutdown_wait_seconds)


def build(config: DistillConfig) -> Service:
    servicer = DistillServicer(config)
    return Service(
        name="distill",
        registrations=[Registration(SERVICE_NAME, distill_pb2_grpc.add_DistillServiceServicer_to_server, servicer)],
        on_start=servicer.start,
        on_stop=servicer.stop,
    )


SPEC = ServiceSpec(name="distill", config_class=DistillConfig, build=build, description="TU-OPD distillation with Consensus-Residual Decomposition, as runs.")
