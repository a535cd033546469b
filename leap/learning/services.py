"""How a learner job (trainer or distiller) talks to the services it depends on: health
checks and task lookups before a run is accepted, and calls that ride out a service that
stops answering for a while.

`retry_unavailable` retries a call that fails with UNAVAILABLE, with exponential backoff, for
up to a configured time, then raises `ServiceDown` (a `RunFailure`: its message is what the
run's error says). Other statuses are not retried: they are answers, and retrying would not
change them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from leap.commands.health import check as health_check
from leap.common.v1 import common_pb2
from leap.learning.registry import RunFailure
from leap.runtime import Violations
from leap.sandbox.v1 import sandbox_pb2

T = TypeVar("T")
Toolchain = common_pb2.Toolchain


class ServiceDown(RunFailure):
    """A service answered UNAVAILABLE for longer than the run's retry time."""


async def retry_unavailable(call: Callable[[], Awaitable[T]], *, what: str, seconds: float,
                            first_delay: float = 0.25, max_delay: float = 5.0) -> T:
    """`await call()`, retried while it fails with UNAVAILABLE, for up to `seconds`; then
    ServiceDown naming `what` ("policy at 127.0.0.1:50051 (Generate)") and the last cause.
    `call` must make a fresh call each time (a new request stream included)."""
    deadline = time.monotonic() + seconds
    delay = first_delay
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            if time.monotonic() + delay > deadline:
                raise ServiceDown(f"{what} stopped answering: UNAVAILABLE for more than {seconds:g} s "
                                  f"(last: {err.details()})") from err
        await asyncio.sleep(delay)
        delay = min(2 * delay, max_delay)


async def reachable(address: str, timeout: float) -> str | None:
    """None when `address` answers SERVING, else why not."""
    status = await asyncio.to_thread(health_check, address, "", timeout)
    return None if status == "SERVING" else status


async def list_task_ids(sandbox, split: str, toolchain: int) -> list[str]:
    """Ids of the sandbox's tasks of `split` that support `toolchain`, every page."""
    ids: list[str] = []
    token = ""
    while True:
        reply = await sandbox.ListTasks(sandbox_pb2.ListTasksRequest(split=split, toolchain=toolchain, page_token=token,
                                                                     page_size=1000))
        ids += [task.id for task in reply.tasks]
        token = reply.next_page_token
        if not token:
            return ids


async def check_listed_tasks(sandbox, field: str, task_ids: Sequence[str], toolchain: int, v: Violations) -> None:
    """Add a violation `field[i]` for each task the sandbox does not have or cannot run with `toolchain`."""
    for index, task_id in enumerate(task_ids):
        try:
            reply = await sandbox.GetTask(sandbox_pb2.GetTaskRequest(task_id=task_id))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                v.add(f"{field}[{index}]", f"task {task_id!r} is not in the sandbox's task suite")
                continue
            raise
        if toolchain not in reply.task.toolchains:
            v.add(f"{field}[{index}]", f"task {task_id!r} does not support toolchain {Toolchain.Name(toolchain)}")
