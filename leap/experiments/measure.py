"""Measuring a model served by a policy service on a task set, from outside any run: what
the experiment commands use to compare models (before and after training, teachers and
students) with one evaluator, one seed and one set of samples."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.evaluation import EvalReport, evaluate
from leap.learning import load_tokenizer
from leap.policy.v1 import policy_pb2
from leap.sandbox.v1 import sandbox_pb2


def list_tasks(sandbox_address: str, split: str, toolchain: int, *, family: str = "",
               tier: int = 0) -> list[sandbox_pb2.Task]:
    """Every task the sandbox lists under the filters (ListTasks, every page)."""
    sandbox = connect("sandbox", sandbox_address, aio=False)
    try:
        tasks, token = [], ""
        while True:
            reply = sandbox.ListTasks(sandbox_pb2.ListTasksRequest(split=split, toolchain=toolchain, family=family,
                                                                   tier=tier, page_token=token, page_size=1000),
                                      timeout=60)
            tasks += list(reply.tasks)
            token = reply.next_page_token
            if not token:
                return tasks
    finally:
        sandbox.channel.close()


def get_tasks(sandbox_address: str, task_ids: Sequence[str]) -> list[sandbox_pb2.Task]:
    """The named tasks (GetTask each; NOT_FOUND raises)."""
    sandbox = connect("sandbox", sandbox_address, aio=False)
    try:
        return [sandbox.GetTask(sandbox_pb2.GetTaskRequest(task_id=task_id), timeout=60).task for task_id in task_ids]
    finally:
        sandbox.channel.close()


def measure(addresses: dict[str, str], model: str, tokenizer_dir, tasks: Sequence[sandbox_pb2.Task], *, toolchain: int,
            samples: int, turns: int, seed: int, max_new_tokens: int = 384, temperature: float = 1.0,
            timing: bool = True, on_task_done: Callable[[sandbox_pb2.Task], None] | None = None) -> EvalReport:
    """pass@1 / pass@k by turn of `model` (a name the policy serves) on `tasks`; with `timing`
    off the sandbox judges correctness only (no speedup, fast_p beyond 0 or geometric mean)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    sampling = common_pb2.RolloutSampling(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)

    async def run() -> EvalReport:
        policy = connect("policy", addresses["policy"], unary_deadline=3600.0)
        sandbox = connect("sandbox", addresses["sandbox"])
        try:
            info = (await policy.GetModel(policy_pb2.GetModelRequest(name=model))).model
            return await evaluate(policy, sandbox, tokenizer, model=model, tasks=tasks, toolchain=toolchain,
                                  samples=samples, turns=turns, sampling=sampling, seed=seed,
                                  options=sandbox_pb2.EvaluateOptions(timing=timing),
                                  max_context_tokens=info.max_context_tokens, on_task_done=on_task_done)
        finally:
            await policy.channel.close()
            await sandbox.channel.close()

    return asyncio.run(run())
