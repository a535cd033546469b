"""The TrainerService servicer: a thin layer between the contract and the algorithms.

Every RPC answers UNIMPLEMENTED until issue #6 lands; health, reflection and config
are real.
"""

from __future__ import annotations

import dataclasses

from leap.trainer.v1 import trainer_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, ServiceSpec

SERVICE_NAME = "leap.trainer.v1.TrainerService"


@dataclasses.dataclass
class TrainerConfig(ServerConfig):
    """Settings of the trainer service (server settings included)."""


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """The GRPO learner, the LEAP loop and RGRPO teacher rounds, as runs."""


def build(config: TrainerConfig) -> Service:
    servicer = TrainerServicer()
    return Service(
        name="trainer",
        registrations=[Registration(SERVICE_NAME, trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer)],
    )


SPEC = ServiceSpec(name="trainer", config_class=TrainerConfig, build=build, description="The GRPO learner, the LEAP loop and RGRPO teacher rounds, as runs.")
