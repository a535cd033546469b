"""The DistillService servicer: a thin layer between the contract and the algorithms.

The run RPCs come from `leap.learning.RunApi` over a `RunRegistry`; this module adds the
distiller's config checks (config.py, preflight.py) and its job (job.py: TU-OPD steps).
"""

from __future__ import annotations

import dataclasses

from leap.distill.v1 import distill_pb2, distill_pb2_grpc
from leap.learning.registry import RunRecord
from leap.learning.run_api import RunApi, RunServiceConfig
from leap.runtime import Registration, Service, ServiceSpec, local_address, option
from svc_distill import config as run_config
from svc_distill.preflight import preflight

SERVICE_NAME = "leap.distill.v1.DistillService"


@dataclasses.dataclass
class DistillConfig(RunServiceConfig):
    """Settings of the distill service (run-service and server settings included)."""

    runs_dir: str = option("runs/distill", "Directory of the runs: one folder per run with its record, metrics, "
                           "TensorBoard events, plots and checkpoints (unless a run names its own output_dir).")
    student_address: str = option(local_address("policy"), "PolicyService target of runs that leave student_address "
                                  "empty: it serves the student (and the teachers the distiller loads).")
    sandbox_address: str = option(local_address("sandbox"), "SandboxService target of runs that leave sandbox_address "
                                  "empty: task statements and held-out evaluation.")
    call_timeout_seconds: float = option(600.0, "Deadline of one call to another service (a whole Generate, Score "
                                         "or held-out evaluation batch).")


class DistillServicer(RunApi, distill_pb2_grpc.DistillServiceServicer):
    """TU-OPD distillation with Consensus-Residual Decomposition, as runs."""

    messages = distill_pb2

    def __init__(self, settings: DistillConfig):
        self.settings = settings
        self.registry = self.make_registry(settings)

    async def prepare_config(self, config: distill_pb2.DistillConfig) -> tuple[distill_pb2.DistillConfig, int]:
        found = run_config.violations(config)  # reported with what the files and services say, in one error
        filled = run_config.with_defaults(config, student_address=self.settings.student_address,
                                          sandbox_address=self.settings.sandbox_address)
        prepared = await preflight(filled, timeout=self.settings.preflight_timeout_seconds, v=found)
        return prepared, prepared.steps

    def make_job(self, record: RunRecord):
        from svc_distill.job import DistillJob

        return DistillJob(self.config_of(record), self.settings)


def build(config: DistillConfig) -> Service:
    servicer = DistillServicer(config)
    return Service(
        name="distill",
        registrations=[Registration(SERVICE_NAME, distill_pb2_grpc.add_DistillServiceServicer_to_server, servicer)],
        on_start=servicer.start,
        on_stop=servicer.stop,
    )


SPEC = ServiceSpec(name="distill", config_class=DistillConfig, build=build, description="TU-OPD distillation with Consensus-Residual Decomposition, as runs.")
