"""The RewardService servicer: a thin layer between the contract and the algorithms.

Every RPC answers UNIMPLEMENTED until issue #5 lands; health, reflection and config
are real.
"""

from __future__ import annotations

import dataclasses

from leap.reward.v1 import reward_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, ServiceSpec

SERVICE_NAME = "leap.reward.v1.RewardService"


@dataclasses.dataclass
class RewardConfig(ServerConfig):
    """Settings of the reward service (server settings included)."""


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Difficulty-Conditioned Pruning and tournament rank rewards."""


def build(config: RewardConfig) -> Service:
    servicer = RewardServicer()
    return Service(
        name="reward",
        registrations=[Registration(SERVICE_NAME, reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer)],
    )


SPEC = ServiceSpec(name="reward", config_class=RewardConfig, build=build, description="Difficulty-Conditioned Pruning and tournament rank rewards.")
