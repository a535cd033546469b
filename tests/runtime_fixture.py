"""A service built on the runtime for its own tests: RewardService.Rank misbehaves on
purpose (task_id "boom" raises, "slow" sleeps 2 s, no groups is INVALID_ARGUMENT); every
other RPC is left UNIMPLEMENTED. `python -m tests.runtime_fixture PORT` serves it."""

from __future__ import annotations

import asyncio
import sys

from leap.reward.v1 import reward_pb2, reward_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, Violations, serve
from leap.runtime.logging import configure_logging


class MisbehavingReward(reward_pb2_grpc.RewardServiceServicer):
    async def Rank(self, request, context):
        Violations().check(len(request.groups) > 0, "groups", "at least one group is required").raise_if_any()
        task_id = request.groups[0].task_id
        if task_id == "boom":
            raise RuntimeError("kaboom: a bug in the handler")
        if task_id == "slow":
            await asyncio.sleep(2.0)
        return reward_pb2.RankResponse(results=[reward_pb2.RankResult(task_id=task_id)])


def build_service() -> Service:
    return Service(
        name="reward",
        registrations=[
            Registration("leap.reward.v1.RewardService", reward_pb2_grpc.add_RewardServiceServicer_to_server,
                         MisbehavingReward())
        ],
    )


if __name__ == "__main__":
    configure_logging("info", service="fixture")
    asyncio.run(serve(build_service(), ServerConfig(port=int(sys.argv[1]), drain_seconds=1.0, grace_seconds=10)))
