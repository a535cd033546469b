"""The checks a learner service (trainer or distiller) makes of the services a run depends
on before it accepts the run: each answers its health check, and the tasks it names exist
and support the toolchain. (Calls during a run ride out outages with `leap.clients.retry`.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import grpc

from leap.clients import connect
from leap.commands.health import check as health_check
from leap.common.v1 import common_pb2
from leap.policy.v1 import policy_pb2
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


# --- what the policy and the sandbox allow (StartRun checks a whole config against them) ---------


@dataclasses.dataclass(frozen=True)
class PolicyLimits:
    """What the policy service at `address` says it accepts for a run's model."""

    address: str
    info: policy_pb2.ModelInfo | None  # the model served under the run's name; None when not loaded yet
    max_samples_per_prompt: int  # 0: the service does not say (none loaded, or an older service)
    context_tokens: int  # the served model's context, else what its directory's config.json says (0: unknown)


async def policy_limits(address: str, model: str, model_path: str = "") -> PolicyLimits:
    """Ask the policy service what it allows (ListModels says the service's limits, loaded
    models or not); the context of a model not loaded yet comes from `model_path`'s config.json,
    read by the rule the hf backend uses."""
    policy = connect("policy", address, unary_deadline=30.0)
    try:
        listed = await policy.ListModels(policy_pb2.ListModelsRequest())
    finally:
        await policy.channel.close()
    info = next((m for m in listed.models if m.name == model), None)
    most = listed.max_samples_per_prompt or max((m.max_samples_per_prompt for m in listed.models), default=0)
    context = info.max_context_tokens if info is not None else model_dir_context(model_path)
    return PolicyLimits(address, info, most, context)


def model_dir_context(path: str) -> int:
    """`max_position_embeddings` of a model directory's config.json (0 when unreadable)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else 0


def has_chat_template(path: str) -> bool:
    """Whether a model directory's tokenizer has a chat template (a chat_template.jinja, or
    the key in tokenizer_config.json), without loading the tokenizer."""
    directory = Path(path)
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def check_samples(limits: PolicyLimits, counts: dict[str, int], v: Violations) -> None:
    """Each `field: n` (samples of one prompt in one Generate) within the policy's limit."""
    if not limits.max_samples_per_prompt:
        return
    for field, n in counts.items():
        v.check(n <= limits.max_samples_per_prompt, field,
                f"{n} samples of one prompt, but the policy service at {limits.address} allows at most "
                f"{limits.max_samples_per_prompt} (its max_samples_per_prompt)")


def check_new_tokens(limits: PolicyLimits, max_new_tokens: int, field: str, v: Violations) -> None:
    if limits.context_tokens:
        v.check(max_new_tokens < limits.context_tokens, field,
                f"{max_new_tokens} tokens per answer leave no room for the prompt in the model's context of "
                f"{limits.context_tokens} tokens")


async def check_size_preset(sandbox, size: str, task_ids: Sequence[str], field: str, v: Violations) -> None:
    """`size` is a size preset of every task named (the sandbox's GetTask says which it has)."""
    missing: list[str] = []
    presets: set[str] = set()
    for task_id in dict.fromkeys(task_ids):
        try:
            task = (await sandbox.GetTask(sandbox_pb2.GetTaskRequest(task_id=task_id))).task
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                continue  # reported on the task list itself
            raise
        names = [s.name for s in task.sizes]
        presets.update(names)
        if size not in names:
            missing.append(task_id)
    if missing:
        shown = ", ".join(repr(t) for t in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        v.add(field, f"{size!r} is not a size preset of task {shown} (presets there: "
                     f"{', '.join(sorted(presets)) or 'none'})")
