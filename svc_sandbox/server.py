"""The SandboxService servicer: a thin layer between the contract and the algorithms.

Every RPC answers UNIMPLEMENTED until issue #3 lands; health, reflection and config
are real.
"""

from __future__ import annotations

import dataclasses

from leap.sandbox.v1 import sandbox_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, ServiceSpec

SERVICE_NAME = "leap.sandbox.v1.SandboxService"


@dataclasses.dataclass
class SandboxConfig(ServerConfig):
    """Settings of the sandbox service (server settings included)."""


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    """Compile, run, check and time candidate kernels, safely."""


def build(config: SandboxConfig) -> Service:
    servicer = SandboxServicer()
    return Service(
        name="sandbox",
        registrations=[Registration(SERVICE_NAME, sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, servicer)],
    )


SPEC = ServiceSpec(name="sandbox", config_class=SandboxConfig, build=build, description="Compile, run, check and time candidate kernels, safely.")
