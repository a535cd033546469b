"""Clients of the LEAP services: channels with LEAP's defaults and typed stubs.

    from leap.clients import connect
    policy = connect("policy", "127.0.0.1:50051")              # asyncio stub
    policy = connect("policy", "127.0.0.1:50051", aio=False)   # blocking stub
"""

from __future__ import annotations

from typing import Any

from leap.clients.channel import aio_channel, channel_options, service_config, sync_channel
from leap.distill.v1 import distill_pb2_grpc
from leap.policy.v1 import policy_pb2_grpc
from leap.reward.v1 import reward_pb2_grpc
from leap.sandbox.v1 import sandbox_pb2_grpc
from leap.trainer.v1 import trainer_pb2_grpc

STUBS = {
    "policy": policy_pb2_grpc.PolicyServiceStub,
    "sandbox": sandbox_pb2_grpc.SandboxServiceStub,
    "reward": reward_pb2_grpc.RewardServiceStub,
    "trainer": trainer_pb2_grpc.TrainerServiceStub,
    "distill": distill_pb2_grpc.DistillServiceStub,
}


def connect(service: str, target: str, *, aio: bool = True, **channel_kwargs: Any) -> Any:
    """A stub of `service` ("policy", "sandbox", ...) on a new channel to `target`.

    The stub's channel is at `stub.channel`; close it when done (`await stub.channel.close()`
    for aio, `stub.channel.close()` otherwise).
    """
    if service not in STUBS:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(STUBS)}")
    channel = aio_channel(target, **channel_kwargs) if aio else sync_channel(target, **channel_kwargs)
    stub = STUBS[service](channel)
    stub.channel = channel
    return stub


__all__ = ["STUBS", "aio_channel", "channel_options", "connect", "service_config", "sync_channel"]
