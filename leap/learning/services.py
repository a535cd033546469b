"""The checks a learner service (trainer or distiller) makes of the services a run depends
on before it accepts the run: each answers its health check, and the tasks it names exist
and support the toolchain. (Calls during a run ride out outages with `leap.clients.retry`.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from leap.commands.health import check as health_check
from leap.common.v1 import common_pb2
from leap.runtime import Violations
from leap.sandbox.v1 import sandbox_pb2

Toolchain = common_pb2.Toolchain


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


async def resolve_eval_tasks(sandbox, config, v: Violations, split: str = "heldout") -> None:
    """A run config's held-out tasks (`config.eval_tasks`): each listed one checked, or, when
    none is listed, the sandbox's `split` for the config's toolchain minus its training tasks."""
    if config.eval_tasks:
        await check_listed_tasks(sandbox, "config.eval_tasks", config.eval_tasks, config.toolchain, v)
    else:
        held_out = await list_task_ids(sandbox, split, config.toolchain)
        train = set(config.train_tasks)
        config.eval_tasks.extend(t for t in held_out if t not in train)
