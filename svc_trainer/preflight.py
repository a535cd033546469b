"""The checks of a run config that need the other services, done before a run is accepted:
every service answers its health check, the tasks exist and are enough for a batch, and the
toolchain and task lists the run will use are filled in.
"""

from __future__ import annotations

import asyncio

from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.learning.services import check_listed_tasks, list_task_ids, reachable, resolve_eval_tasks
from leap.runtime import Violations
from leap.sandbox.v1 import sandbox_pb2
from leap.trainer.v1 import trainer_pb2
from svc_trainer.config import HELDOUT_SPLIT, TRAIN_SPLIT

Toolchain = common_pb2.Toolchain
SERVICES = ("policy", "sandbox", "reward")


async def preflight(config: trainer_pb2.RunConfig, *, timeout: float = 5.0) -> trainer_pb2.RunConfig:
    """`config` (defaults already filled) with toolchain and task lists resolved; raises
    INVALID_ARGUMENT naming every field that cannot work."""
    v = Violations()
    down = await asyncio.gather(*(reachable(getattr(config.services, name), timeout) for name in SERVICES))
    for name, why in zip(SERVICES, down):
        if why:
            v.add(f"config.services.{name}", f"{getattr(config.services, name)!r} is unreachable: {why}")
    v.raise_if_any()
    out = trainer_pb2.RunConfig()
    out.CopyFrom(config)
    sandbox = connect("sandbox", config.services.sandbox, unary_deadline=30.0)
    try:
        if not out.toolchain:
            devices = await sandbox.ListDevices(sandbox_pb2.ListDevicesRequest())
            out.toolchain = Toolchain.TOOLCHAIN_CUDA if devices.devices else Toolchain.TOOLCHAIN_CPU
        if out.train_tasks:
            await check_listed_tasks(sandbox, "config.train_tasks", out.train_tasks, out.toolchain, v)
        else:
            out.train_tasks.extend(await list_task_ids(sandbox, TRAIN_SPLIT, out.toolchain))
        await resolve_eval_tasks(sandbox, out, v, HELDOUT_SPLIT)
    finally:
        await sandbox.channel.close()
    available = len(out.train_tasks)
    if available == 0:
        v.add("config.train_tasks", f"the sandbox has no {TRAIN_SPLIT!r} tasks for toolchain {Toolchain.Name(out.toolchain)}")
    elif out.tasks_per_step > available:
        v.add("config.tasks_per_step", f"B = {out.tasks_per_step} is larger than the {available} training tasks")
    v.raise_if_any()
    return out
