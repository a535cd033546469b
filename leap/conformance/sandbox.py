"""Conformance of a SandboxService: the task suite pages and describes itself, a task's own
examples evaluate to the stages they are labelled with (a failing kernel is a verdict in a
successful response, never an RPC error), EvaluateBatch streams every index once, and bad
requests are INVALID_ARGUMENT or NOT_FOUND. Only cpu examples are evaluated, untimed."""

from __future__ import annotations

import dataclasses

import grpc

from leap.common.v1 import common_pb2
from leap.conformance.core import CheckFailed, CheckSkipped, Context, Suite
from leap.sandbox.v1 import sandbox_pb2

SUITE = Suite("sandbox", sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"])

CPU = common_pb2.TOOLCHAIN_CPU
PASSED = common_pb2.STAGE_PASSED
BROKEN_KINDS = (sandbox_pb2.EXAMPLE_KIND_SYNTAX_ERROR, sandbox_pb2.EXAMPLE_KIND_WRONG_OUTPUT,
                sandbox_pb2.EXAMPLE_KIND_CRASH)
MAX_PAGES = 10_000  # a service that always hands out a next page token would loop forever
Stage = common_pb2.Stage.Name


@dataclasses.dataclass(frozen=True)
class ExampleTask:
    """A task with a cpu solution and a broken cpu example, both shipped by the service."""

    task: sandbox_pb2.Task
    solution: sandbox_pb2.Example
    broken: sandbox_pb2.Example


def list_all(ctx: Context, **request: object) -> tuple[list[sandbox_pb2.Task], list[int]]:
    """Every task through ListTasks, and the size of each page."""
    tasks: list[sandbox_pb2.Task] = []
    sizes: list[int] = []
    token, seen = "", set()
    for _ in range(MAX_PAGES):
        reply = ctx.call("ListTasks", sandbox_pb2.ListTasksRequest(page_token=token, **request))
        tasks += reply.tasks
        sizes.append(len(reply.tasks))
        token = reply.next_page_token
        if not token:
            return tasks, sizes
        if token in seen:
            raise CheckFailed(f"next_page_token {token!r} came back twice")
        seen.add(token)
    raise CheckFailed(f"still handing out page tokens after {MAX_PAGES} pages")


def first_example(task: sandbox_pb2.Task, kinds) -> sandbox_pb2.Example | None:
    return next((e for e in task.examples if e.toolchain == CPU and e.kind in kinds), None)


def discover_example_task(ctx: Context) -> ExampleTask:
    tasks, _ = list_all(ctx, toolchain=CPU, view=sandbox_pb2.TASK_VIEW_FULL)
    for task in tasks:
        solution = first_example(task, (sandbox_pb2.EXAMPLE_KIND_SOLUTION,))
        broken = first_example(task, BROKEN_KINDS)
        if solution is not None and broken is not None:
            return ExampleTask(task, solution, broken)
    raise CheckSkipped(f"none of the {len(tasks)} cpu tasks ships both a cpu solution and a broken cpu example")


def example_task(ctx: Context) -> ExampleTask:
    return ctx.found("example task", discover_example_task)


def candidate(task_id: str, source: str, label: str) -> sandbox_pb2.Candidate:
    return sandbox_pb2.Candidate(task_id=task_id, toolchain=CPU, source=source, candidate_id=label)


# Untimed, examples as they are: the checks are about verdicts, not speed.
OPTIONS = sandbox_pb2.EvaluateOptions(timing=False, raw_source=True)


def evaluate(ctx: Context, task_id: str, example: sandbox_pb2.Example, label: str) -> sandbox_pb2.Verdict:
    request = sandbox_pb2.EvaluateRequest(candidate=candidate(task_id, example.source, label), options=OPTIONS)
    return ctx.call("Evaluate", request).verdict


def expect_expected_stage(verdict: sandbox_pb2.Verdict, example: sandbox_pb2.Example, what: str) -> None:
    """The verdict stops where the example says it does (below PASSED for a broken one)."""
    wanted = example.expected_stage or None
    broken = example.kind in BROKEN_KINDS
    if broken and verdict.stage >= PASSED:
        raise CheckFailed(f"{what}: {Stage(verdict.stage)} (a stage below STAGE_PASSED expected)")
    if wanted is not None and verdict.stage != wanted:
        raise CheckFailed(f"{what}: {Stage(verdict.stage)} ({Stage(wanted)} expected: {verdict.message})")


@SUITE.check("ListTasks pages through every task once, ordered by id", "ListTasks")
def list_tasks_pages(ctx: Context) -> str:
    tasks, sizes = list_all(ctx, page_size=2)
    ids = [t.id for t in tasks]
    if not ids:
        raise CheckFailed("no tasks listed")
    if len(set(ids)) != len(ids):
        raise CheckFailed("a task came back on two pages")
    if ids != sorted(ids):
        raise CheckFailed("tasks are not ordered by id")
    if max(sizes) > 2:
        raise CheckFailed(f"a page held {max(sizes)} tasks with page_size 2")
    return f"{len(ids)} tasks in {len(sizes)} pages of 2"


SUITE.add_paging_rules("ListTasks", sandbox_pb2.ListTasksRequest)


@SUITE.check("GetTask returns the entry point, and the examples with their kinds in the full view", "GetTask")
def get_task_describes(ctx: Context) -> str:
    task_id = example_task(ctx).task.id
    full = ctx.call("GetTask", sandbox_pb2.GetTaskRequest(task_id=task_id, view=sandbox_pb2.TASK_VIEW_FULL)).task
    basic = ctx.call("GetTask", sandbox_pb2.GetTaskRequest(task_id=task_id)).task
    if full.id != task_id:
        raise CheckFailed(f"asked for {task_id!r}, got {full.id!r}")
    if not full.entry_point.name or not full.entry_point.arguments:
        raise CheckFailed(f"{task_id}: the entry point has no name or no arguments")
    if not full.examples or any(e.kind == sandbox_pb2.EXAMPLE_KIND_UNSPECIFIED for e in full.examples):
        raise CheckFailed(f"{task_id}: the full view has no examples, or one without a kind")
    if basic.examples:
        raise CheckFailed(f"{task_id}: the basic view carries examples")
    return f"{task_id}: {full.entry_point.name}, {len(full.examples)} examples"


SUITE.add_lookup("GetTask", sandbox_pb2.GetTaskRequest, "task_id", "task")


@SUITE.check("a task's own solution evaluates to STAGE_PASSED", "Evaluate")
def evaluate_solution(ctx: Context) -> str:
    found = example_task(ctx)
    verdict = evaluate(ctx, found.task.id, found.solution, ctx.tag)
    if verdict.stage != PASSED:
        raise CheckFailed(f"{found.task.id}: {Stage(verdict.stage)}: {verdict.message}")
    if verdict.task_id != found.task.id or verdict.candidate_id != ctx.tag:
        raise CheckFailed("the verdict does not echo the task id and candidate id")
    return f"{found.task.id}: STAGE_PASSED"


@SUITE.check("a response without a fenced code block stops at STAGE_FORMAT unless options.raw_source", "Evaluate")
def evaluate_needs_a_fence(ctx: Context) -> str:
    """Candidate.source is the model's response: its code is the last fenced block, and a
    response with none stops at STAGE_FORMAT; `raw_source` takes the text as the code (the
    solution check sends the same code that way)."""
    found = example_task(ctx)
    code = found.solution.source
    if "```" in code:
        raise CheckSkipped(f"{found.task.id}: the solution itself contains a fence")
    untimed = sandbox_pb2.EvaluateOptions(timing=False)

    def stage_of(source: str, label: str) -> sandbox_pb2.Verdict:
        request = sandbox_pb2.EvaluateRequest(candidate=candidate(found.task.id, source, label), options=untimed)
        return ctx.call("Evaluate", request).verdict

    bare = stage_of(code, f"{ctx.tag}-bare")
    if bare.stage != common_pb2.STAGE_FORMAT:
        raise CheckFailed(f"{found.task.id}: the solution without a fence and without raw_source: "
                          f"{Stage(bare.stage)} (STAGE_FORMAT expected: no fenced code block)")
    fenced = stage_of(f"Here is the kernel.\n\n```cpp\n{code.rstrip()}\n```\n", f"{ctx.tag}-fenced")
    if fenced.stage != PASSED:
        raise CheckFailed(f"{found.task.id}: the solution in a fenced block of a response: {Stage(fenced.stage)} "
                          f"(STAGE_PASSED expected: {fenced.message})")
    return f"{found.task.id}: unfenced STAGE_FORMAT ({bare.message!r}), fenced in a response STAGE_PASSED"


@SUITE.check("a broken example is a verdict below STAGE_PASSED in a successful response", "Evaluate")
def evaluate_broken(ctx: Context) -> str:
    found = example_task(ctx)
    verdict = evaluate(ctx, found.task.id, found.broken, ctx.tag)  # an RPC error here fails the check
    kind = sandbox_pb2.ExampleKind.Name(found.broken.kind)
    expect_expected_stage(verdict, found.broken, f"{found.task.id} {kind}")
    return f"{found.task.id} {kind}: {Stage(verdict.stage)}"


@SUITE.check("Evaluate without toolchain and source is INVALID_ARGUMENT naming both", "Evaluate")
def evaluate_bad_fields(ctx: Context) -> str:
    request = sandbox_pb2.EvaluateRequest(candidate=sandbox_pb2.Candidate(task_id=example_task(ctx).task.id))
    return ctx.refused("Evaluate", request, grpc.StatusCode.INVALID_ARGUMENT, "candidate.toolchain",
                       "candidate.source")


@SUITE.check("Evaluate of an unknown task is NOT_FOUND", "Evaluate")
def evaluate_unknown_task(ctx: Context) -> str:
    source = 'extern "C" void f() {}'
    request = sandbox_pb2.EvaluateRequest(candidate=candidate(ctx.tag, source, ctx.tag), options=OPTIONS)
    return ctx.refused("Evaluate", request, grpc.StatusCode.NOT_FOUND)


@SUITE.check("EvaluateBatch streams every index exactly once, each with its own verdict", "EvaluateBatch")
def evaluate_batch_every_index(ctx: Context) -> str:
    found = example_task(ctx)
    examples = [found.solution, found.broken, found.solution]
    candidates = [candidate(found.task.id, e.source, f"{ctx.tag}-{i}") for i, e in enumerate(examples)]
    replies = ctx.call("EvaluateBatch", sandbox_pb2.EvaluateBatchRequest(candidates=candidates, options=OPTIONS))
    indices = sorted(r.index for r in replies)
    if indices != list(range(len(candidates))):
        raise CheckFailed(f"indices streamed: {indices} (each of 0..{len(candidates) - 1} once expected)")
    for reply in replies:
        if reply.verdict.candidate_id != candidates[reply.index].candidate_id:
            raise CheckFailed(f"index {reply.index} carries the verdict of {reply.verdict.candidate_id!r}")
        expect_expected_stage(reply.verdict, examples[reply.index], f"index {reply.index}")
    return f"indices 0..{len(candidates) - 1} once each, stages as labelled"


@SUITE.check("EvaluateBatch without candidates is INVALID_ARGUMENT", "EvaluateBatch")
def evaluate_batch_empty(ctx: Context) -> str:
    return ctx.refused("EvaluateBatch", sandbox_pb2.EvaluateBatchRequest(), grpc.StatusCode.INVALID_ARGUMENT,
                       "candidates")
