"""The DistillService servicer: a thin layer between the contract and the algorithms.

Every RPC answers UNIMPLEMENTED until issue #7 lands; health, reflection and config
are real.
"""

from __future__ import annotations

import dataclasses

from leap.distill.v1 import distill_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, ServiceSpec

SERVICE_NAME = "leap.distill.v1.DistillService"


@dataclasses.dataclass
class DistillConfig(ServerConfig):
    """Settings of the distill service (server settings included)."""


class DistillServicer(distill_pb2_grpc.DistillServiceServicer):
    """TU-OPD distillation with Consensus-Residual Decomposition, as runs."""


def build(config: DistillConfig) -> Service:
    servicer = DistillServicer()
    return Service(
        name="distill",
        registrations=[Registration(SERVICE_NAME, distill_pb2_grpc.add_DistillServiceServicer_to_server, servicer)],
    )


SPEC = ServiceSpec(name="distill", config_class=DistillConfig, build=build, description="TU-OPD distillation with Consensus-Residual Decomposition, as runs.")
