"""A service built on the runtime for its own tests. RewardService.Rank misbehaves on
purpose (task_id "boom" raises, "slow" sleeps 2 s, "huge-error" raises an error far larger
than any client accepts, no groups is INVALID_ARGUMENT); GetTaskHistory refuses empty ids
and answers NOT_FOUND for the rest (echoing them). A PolicyService beside it has a client
stream (UpdateWeights counts the messages and their bytes) and a server stream
(GenerateStream yields one completion per prompt). Request limits: GetTaskHistory 64 KiB,
GenerateStream 16 KiB, UpdateWeights the server's max_message_bytes. Every other RPC is
left UNIMPLEMENTED. `python -m tests.runtime_fixture PORT [AUTH_TOKEN]` serves it."""

from __future__ import annotations

import asyncio
import sys

import grpc
from google.rpc import error_details_pb2

from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.reward.v1 import reward_pb2, reward_pb2_grpc
from leap.runtime import Registration, ServerConfig, Service, ServiceError, Violations, not_found, serve
from leap.runtime.logging import configure_logging

KiB = 1024


class MisbehavingReward(reward_pb2_grpc.RewardServiceServicer):
    async def Rank(self, request, context):
        Violations().check(len(request.groups) > 0, "groups", "at least one group is required").raise_if_any()
        task_id = request.groups[0].task_id
        if task_id == "boom":
            raise RuntimeError("kaboom: a bug in the handler")
        if task_id == "slow":
            await asyncio.sleep(2.0)
        if task_id == "huge-error":  # what a careless handler might raise: a status of megabytes
            violations = [error_details_pb2.BadRequest.FieldViolation(field=f"groups[{i}]." + "f" * 500,
                                                                      description="d" * 2000) for i in range(5000)]
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "m" * 1_000_000,
                               [error_details_pb2.BadRequest(field_violations=violations)])
        return reward_pb2.RankResponse(results=[reward_pb2.RankResult(task_id=task_id)])

    async def GetTaskHistory(self, request, context):
        violations = Violations()
        for index, task_id in enumerate(request.task_ids):
            violations.check(bool(task_id), f"task_ids[{index}]", "must not be empty")
        violations.raise_if_any()
        raise not_found("task", request.task_ids[0] if request.task_ids else "", "never recorded")


class CountingPolicy(policy_pb2_grpc.PolicyServiceServicer):
    async def UpdateWeights(self, request_iterator, context):
        count = size = 0
        async for message in request_iterator:
            count += 1
            size += len(message.chunk.data)
        return policy_pb2.UpdateWeightsResponse(model="counted", tensors_updated=count, bytes_received=size)

    async def GenerateStream(self, request, context):
        for index, _ in enumerate(request.prompts):
            yield policy_pb2.GenerateStreamResponse(completion=policy_pb2.Completion(prompt_index=index))


def build_service() -> Service:
    return Service(
        name="reward",
        registrations=[
            Registration("leap.reward.v1.RewardService", reward_pb2_grpc.add_RewardServiceServicer_to_server,
                         MisbehavingReward(), request_limits={"GetTaskHistory": 64 * KiB}),
            Registration("leap.policy.v1.PolicyService", policy_pb2_grpc.add_PolicyServiceServicer_to_server,
                         CountingPolicy(), request_limits={"UpdateWeights": None, "GenerateStream": 16 * KiB}),
        ],
    )


if __name__ == "__main__":
    configure_logging("info", service="fixture")
    token = sys.argv[2] if len(sys.argv) > 2 else ""
    asyncio.run(serve(build_service(), ServerConfig(port=int(sys.argv[1]), drain_seconds=1.0, grace_seconds=10,
                                                    auth_token=token)))
