"""The PolicyService servicer: a thin layer between the contract and the algorithms.

Every RPC answers UNIMPLEMENTED until issue #4 lands; health, reflection and config
are real.
"""

from __future__ import annotations

import dataclasses

from leap.policy.v1 import policy_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, ServiceSpec

SERVICE_NAME = "leap.policy.v1.PolicyService"


@dataclasses.dataclass
class PolicyConfig(ServerConfig):
    """Settings of the policy service (server settings included)."""


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """Policy inference: sampling with logprobs, scoring, versioned weight updates."""


def build(config: PolicyConfig) -> Service:
    servicer = PolicyServicer()
    return Service(
        name="policy",
        registrations=[Registration(SERVICE_NAME, policy_pb2_grpc.add_PolicyServiceServicer_to_server, servicer)],
    )


SPEC = ServiceSpec(name="policy", config_class=PolicyConfig, build=build, description="Policy inference: sampling with logprobs, scoring, versioned weight updates.")
