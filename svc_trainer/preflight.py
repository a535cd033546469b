"""The checks of a run config that need the other services, done before a run is accepted:
every service answers its health check, the tasks exist and are enough for a batch, and the
toolchain and task lists the run will use are filled in. The config is then checked against
what the named services say they allow: the policy (samples per prompt, the model's context),
the reward service (a dry-run Gate with the run's group size and gate overrides), the sandbox
(the size preset of every task) and the model directory (a chat template for feedback
turns). Every problem, these and the config's own, comes back in one INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2

from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.learning.services import (
    check_listed_tasks, check_new_tokens, check_samples, check_size_preset, has_chat_template, list_task_ids,
    policy_limits, reachable, resolve_eval_tasks,
)
from leap.reward.v1 import reward_pb2
from leap.runtime import Violations
from leap.runtime.errors import details_of
from leap.sandbox.v1 import sandbox_pb2
from leap.trainer.v1 import trainer_pb2
from svc_trainer.config import HELDOUT_SPLIT, TRAIN_SPLIT

Toolchain = common_pb2.Toolchain
SERVICES = ("policy", "sandbox", "reward")


async def preflight(config: trainer_pb2.RunConfig, *, timeout: float = 5.0,
                    v: Violations | None = None) -> trainer_pb2.RunConfig:
    """`config` (defaults already filled) with toolchain and task lists resolved; raises
    INVALID_ARGUMENT naming every field that cannot work, with those already in `v` (the
    config's own problems)."""
    v = v if v is not None else Violations()
    bad = {field for field, _ in v.items}
    initial = len(v.items)
    down = await asyncio.gather(*(reachable(getattr(config.services, name), timeout) for name in SERVICES))
    for name, why in zip(SERVICES, down):
        if why:
            v.add(f"config.services.{name}", f"{getattr(config.services, name)!r} is unreachable: {why}")
    if any(down) or bad & {"config.toolchain", "config.train_tasks", "config.eval_tasks"}:
        v.raise_if_any()  # a service that is down, or a toolchain the sandbox cannot be asked about
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
        if out.sandbox_size:
            await check_size_preset(sandbox, out.sandbox_size, [*out.train_tasks, *out.eval_tasks], "config.sandbox_size", v)
    finally:
        await sandbox.channel.close()
    available = len(out.train_tasks)
    if available == 0:
        v.add("config.train_tasks", f"the sandbox has no {TRAIN_SPLIT!r} tasks for toolchain {Toolchain.Name(out.toolchain)}")
    elif out.tasks_per_step > available:
        v.add("config.tasks_per_step", f"B = {out.tasks_per_step} is larger than the {available} training tasks")
    if "config.model_path" not in bad:
        await check_policy(out, v, named="config.policy_model" not in bad)
    await check_reward(out, bad, v)
    v.items[:] = [item for i, item in enumerate(v.items) if i < initial or item[0] not in bad]  # one reason a field
    v.raise_if_any()
    return out


async def check_policy(config: trainer_pb2.RunConfig, v: Violations, named: bool = True) -> None:
    """Group and evaluation sizes within the policy's samples per prompt, answers within the
    model's context, and a chat template where the run has feedback turns (`named`: the
    run's model name is a valid one to look up)."""
    try:
        limits = await policy_limits(config.services.policy, config.policy_model if named else "", config.model_path)
    except grpc.aio.AioRpcError as err:
        v.add("config.services.policy", f"the policy service at {config.services.policy} did not say what it allows "
                                        f"(ListModels: {err.code().name}: {err.details()})")
        return
    counts = {"config.group_size": config.group_size, "config.eval_samples": config.eval_samples}
    if config.rgrpo.rounds:
        counts["config.rgrpo.eval_samples"] = config.rgrpo.eval_samples
    check_samples(limits, counts, v)
    check_new_tokens(limits, config.sampling.max_new_tokens, "config.sampling.max_new_tokens", v)
    if not has_chat_template(config.model_path):
        why = (f"the model at {config.model_path!r} has no chat template, and feedback turns need one to extend the "
               "dialogue token by token; give it one (a chat_template.jinja), or train single-turn (mode "
               "TRAIN_MODE_SINGLE, eval_turns 1)")
        if config.max_turns > 1:
            v.add("config.max_turns", f"{config.max_turns} turns: {why}")
        if config.eval_turns > 1:
            v.add("config.eval_turns", f"{config.eval_turns} turns: {why}")


async def check_reward(config: trainer_pb2.RunConfig, bad: set[str], v: Violations) -> None:
    """Ask the reward service whether it takes the run's groups and gate overrides: a dry-run
    Gate of one group of G rollouts (it records nothing). Its violations are named on the
    run's fields (`config.gate.simple_threshold`, `config.group_size`)."""
    if config.group_size > 65536:  # the policy's limit names it; no need to send a group that large
        return
    gate = config.gate if config.max_turns > 1 else reward_pb2.GateConfig()  # a run that never gates still ranks G
    group = reward_pb2.GateGroup(task_id="leap-preflight",
                                 rollouts=[reward_pb2.RolloutResult(stage=common_pb2.STAGE_FORMAT)] * config.group_size)
    reward = connect("reward", config.services.reward, unary_deadline=30.0)
    try:
        await reward.Gate(reward_pb2.GateRequest(groups=[group], config=gate, dry_run=True))
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
            v.add("config.services.reward", f"the reward service at {config.services.reward} could not be asked "
                                            f"about the run's groups (a dry-run Gate: {err.code().name}: {err.details()})")
            return
        for detail in details_of(err):
            if not isinstance(detail, error_details_pb2.BadRequest):
                continue
            for violation in detail.field_violations:
                if violation.field.startswith("config."):
                    field = "config.gate." + violation.field.removeprefix("config.")
                elif violation.field.startswith("groups[0].rollouts"):
                    field = "config.group_size"
                else:
                    field = "config.gate"
                if field not in bad:  # the same problem the config's own checks already named
                    v.add(field, f"the reward service at {config.services.reward} refuses it: {violation.description}")
    finally:
        await reward.channel.close()
