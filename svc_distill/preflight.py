"""The checks of a distillation config that need files or other services, done before a run
is accepted: the teacher union reads; every teacher tokenizes exactly as the student (else a
teacher's per-token scores would be of other tokens); the training tasks are columns of the
quality matrix and some teacher is reliable on at least one of them; the services answer; the
tasks exist in the sandbox. Fills in the toolchain and the task lists the run will use.
"""

from __future__ import annotations

import asyncio

import grpc
import torch

from leap.clients import connect
from leap.distill.v1 import distill_pb2
from leap.learning import load_tokenizer
from leap.learning.services import (
    check_listed_tasks, check_new_tokens, check_samples, policy_limits, reachable, resolve_eval_tasks,
)
from leap.policy.v1 import policy_pb2
from leap.runtime import Violations
from leap.tokenization import tokenizer_fingerprint
from leap.union import TeacherUnion, toolchain_name
from svc_distill.config import HELDOUT_SPLIT, tu_opd_config
from svc_distill.losses import teacher_weights

UNION_FIELD = "config.teacher_union_path"


def fingerprint_of(model_dir) -> str:
    return tokenizer_fingerprint(load_tokenizer(model_dir))


def read_union(config: distill_pb2.DistillConfig, v: Violations) -> TeacherUnion | None:
    try:
        return TeacherUnion.read(config.teacher_union_path)
    except ValueError as err:
        v.add(UNION_FIELD, str(err))
        return None


def check_teachers(config: distill_pb2.DistillConfig, union: TeacherUnion, student_fingerprint: str,
                   v: Violations) -> None:
    """Listed endpoints name union teachers; the teachers the distiller loads itself (from the
    union's directories) tokenize as the student. Served ones are checked in `check_served`."""
    listed = {t.name for t in config.teachers}
    for i, endpoint in enumerate(config.teachers):
        if endpoint.name not in union.teacher_names:
            v.add(f"config.teachers[{i}].name", f"{endpoint.name!r} is not a teacher of the union "
                  f"(teachers: {', '.join(union.teacher_names)})")
    for teacher in union.teachers:
        if teacher.name in listed:
            continue
        found = fingerprint_of(union.model_dir(teacher))
        if found != student_fingerprint:
            v.add(UNION_FIELD, f"teacher {teacher.name!r} ({union.model_dir(teacher)}) tokenizes differently from the "
                  f"student (tokenizer fingerprint {found[:12]} vs {student_fingerprint[:12]}): its per-token scores "
                  "would be of other tokens")


def check_tasks_and_threshold(config: distill_pb2.DistillConfig, union: TeacherUnion, v: Violations) -> None:
    """Training tasks are columns of the quality matrix, and some teacher is reliable on one."""
    columns = set(union.task_ids)
    for i, task in enumerate(config.train_tasks):
        if task not in columns:
            v.add(f"config.train_tasks[{i}]", f"task {task!r} is not a column of the union's quality matrix "
                  f"({len(union.task_ids)} tasks)")
    tasks = [t for t in config.train_tasks if t in columns] or list(union.task_ids)
    if config.toolchain and toolchain_name(config.toolchain) != union.toolchain:
        v.add("config.toolchain", f"the union's pass rates were measured with the {union.toolchain!r} toolchain; "
              "gating on them for another toolchain would use the wrong numbers")
    quality = torch.tensor([union.quality_of(task) for task in tasks], dtype=torch.float64).T  # [K, X]
    loss_config = tu_opd_config(config)
    if bool((teacher_weights(quality, loss_config).sum(dim=0) > 0).any()):
        return
    best = float(quality.max())
    if loss_config.gating:
        v.add("config.reliability_threshold", f"no teacher reaches rho = {loss_config.rho:g} on any training task "
              f"(the highest pass rate there is {best:g}): every example would be skipped")
    else:
        v.add(UNION_FIELD, "every teacher's pass rate is 0 on every training task: every example would be skipped")


def local_checks(config: distill_pb2.DistillConfig) -> tuple[TeacherUnion | None, str, Violations]:
    """The checks that read files only (run in a thread: tokenizers load from disk)."""
    v = Violations()
    union = read_union(config, v)
    student_fingerprint = fingerprint_of(config.student_model_path)
    if union is not None:
        check_teachers(config, union, student_fingerprint, v)
        check_tasks_and_threshold(config, union, v)
    return union, student_fingerprint, v


async def check_served(config: distill_pb2.DistillConfig, student_fingerprint: str, v: Violations) -> None:
    """Listed teachers are loaded where they are said to be and tokenize as the student; a
    student already loaded under its name does too (else the run would train one model and
    sample another)."""
    served = [(f"config.teachers[{i}].model", t.address, t.model) for i, t in enumerate(config.teachers)]
    served.append(("config.student_model", config.student_address, config.student_model))
    for field, address, model in served:
        policy = connect("policy", address, unary_deadline=30.0)
        try:
            info = (await policy.GetModel(policy_pb2.GetModelRequest(name=model))).model
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            if field != "config.student_model":  # the job loads the student itself when absent
                v.add(field, f"model {model!r} is not loaded at {address}")
            continue
        finally:
            await policy.channel.close()
        if info.tokenizer_fingerprint != student_fingerprint:
            v.add(field, f"model {model!r} at {address} tokenizes differently from the student's directory "
                  f"(tokenizer fingerprint {info.tokenizer_fingerprint[:12]} vs {student_fingerprint[:12]})")


async def check_services(config: distill_pb2.DistillConfig, timeout: float, v: Violations) -> None:
    addresses = {"config.student_address": config.student_address, "config.sandbox_address": config.sandbox_address}
    addresses.update({f"config.teachers[{i}].address": t.address for i, t in enumerate(config.teachers)})
    down = await asyncio.gather(*(reachable(address, timeout) for address in addresses.values()))
    for (field, address), why in zip(addresses.items(), down):
        if why:
            v.add(field, f"{address!r} is unreachable: {why}")


async def resolve_tasks(out: distill_pb2.DistillConfig, union: TeacherUnion, v: Violations) -> None:
    """Fill the training tasks (the union's) and held-out tasks (the sandbox's held-out split,
    minus training tasks), and check that the sandbox has every task listed."""
    if not out.train_tasks:
        out.train_tasks.extend(union.task_ids)
    sandbox = connect("sandbox", out.sandbox_address, unary_deadline=30.0)
    try:
        await check_listed_tasks(sandbox, "config.train_tasks", out.train_tasks, out.toolchain, v)
        await resolve_eval_tasks(sandbox, out, v, HELDOUT_SPLIT)
    finally:
        await sandbox.channel.close()


async def check_limits(config: distill_pb2.DistillConfig, v: Violations) -> None:
    """Samples per example and per held-out task within what the student's policy service
    allows, and answers within the student's context."""
    try:
        limits = await policy_limits(config.student_address, config.student_model, config.student_model_path)
    except grpc.aio.AioRpcError as err:
        v.add("config.student_address", f"the policy service at {config.student_address} did not say what it allows "
                                        f"(ListModels: {err.code().name}: {err.details()})")
        return
    check_samples(limits, {"config.samples_per_example": config.samples_per_example,
                           "config.eval_samples": config.eval_samples}, v)
    check_new_tokens(limits, config.sampling.max_new_tokens, "config.sampling.max_new_tokens", v)


async def preflight(config: distill_pb2.DistillConfig, *, timeout: float = 5.0,
                    v: Violations | None = None) -> distill_pb2.DistillConfig:
    """`config` (defaults already filled) with toolchain and task lists resolved; raises
    INVALID_ARGUMENT naming every field that cannot work, with those already in `v` (the
    config's own problems)."""
    v = v if v is not None else Violations()
    bad = {field for field, _ in v.items}
    initial = len(v.items)
    if bad & {"config.student_model_path", "config.teacher_union_path"}:
        v.raise_if_any()  # nothing else can be read without them
    union, student_fingerprint, found = await asyncio.to_thread(local_checks, config)
    v.items.extend(item for item in found.items if item[0] not in bad)  # a field already named keeps its reason
    if union is None:
        v.raise_if_any()
    assert union is not None
    known = len(v.items)
    await check_services(config, timeout, v)
    if len(v.items) > known:  # a service that is down cannot be asked anything
        v.raise_if_any()
    await check_served(config, student_fingerprint, v)
    if "config.student_model" not in bad:
        await check_limits(config, v)
    v.items[:] = [item for i, item in enumerate(v.items) if i < initial or item[0] not in bad]
    out = distill_pb2.DistillConfig()
    out.CopyFrom(config)
    out.toolchain = out.toolchain or union.toolchain_value()
    await resolve_tasks(out, union, v)
    v.raise_if_any()
    return out
