"""Generated task families served by a real sandbox over gRPC (`task_families`): listed beside
the built-in suite with their family and tier, filtered by `ListTasks`, and judged as the
suite's tasks are (every example at the stage it names, the solution timed against the
generated reference); a family the service does not serve, a bad tier or a bad setting is
refused up front, naming the field or the setting."""

from __future__ import annotations

import grpc
import pytest

from leap.commands import service_spec
from leap.common.v1 import common_pb2
from leap.runtime import StartupError
from leap.sandbox.v1 import sandbox_pb2
from leap.tasks import families
from svc_sandbox.server import SandboxConfig
from tests.sandbox_helpers import Stage, candidate, describe, running_sandbox
from tests.test_sandbox_service import violations

SERVED = {"elementwise": 40, "gemm": 30, "rows": 30, "stencil": 30}  # tasks of each family this sandbox serves
BUILTIN = 25  # tasks of the built-in suite


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with running_sandbox(tmp_path_factory.mktemp("families"), workers=2,
                         task_families=[f"{name}:{count}" for name, count in SERVED.items()],
                         task_family_seed=3) as running:
        yield running


def list_all(stub, **filters) -> list[sandbox_pb2.Task]:
    found, token = [], ""
    while True:
        page = stub.ListTasks(sandbox_pb2.ListTasksRequest(page_size=16, page_token=token, **filters), timeout=10)
        found += page.tasks
        token = page.next_page_token
        if not token:
            return found


def test_the_served_tasks_are_the_generators_first_tasks_of_the_seed_listed_beside_the_suite(sandbox):
    everything = list_all(sandbox.stub)
    generated = [t for t in everything if t.family]
    assert len(everything) == BUILTIN + sum(SERVED.values())
    expected = [t for name, count in SERVED.items() for t in families.generate_many(name, seed=3, count=count)]
    assert sorted(t.id for t in generated) == sorted(t.id for t in expected)
    by_id = {t.id: t for t in expected}
    for task in generated:  # the BASIC view of what the generator made: family, tier, split and all
        want = sandbox_pb2.Task()
        want.CopyFrom(by_id[task.id])
        del want.examples[:]
        assert task == want


@pytest.mark.parametrize("name", sorted(SERVED))
def test_list_tasks_filters_by_family_tier_and_split_and_pages_within_the_filter(sandbox, name):
    stub = sandbox.stub
    family = list_all(stub, family=name)
    assert len(family) == SERVED[name] and all(t.family == name for t in family)
    tiers = {t.tier for t in family}
    assert tiers <= {1, 2, 3} and len(tiers) > 1
    for tier in tiers:
        chosen = list_all(stub, family=name, tier=tier)
        assert {t.id for t in chosen} == {t.id for t in family if t.tier == tier}
    heldout = list_all(stub, family=name, split="heldout")
    assert {t.id for t in heldout} == {t.id for t in family if t.split == "heldout"}
    # a page token carries its filters: reused with other filters it is refused
    first = stub.ListTasks(sandbox_pb2.ListTasksRequest(page_size=5, family="elementwise"), timeout=10)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ListTasks(sandbox_pb2.ListTasksRequest(page_size=5, page_token=first.next_page_token, tier=1), timeout=10)
    assert "page_token" in violations(caught.value)


def test_an_unknown_family_and_a_bad_tier_are_invalid_argument_naming_the_field(sandbox):
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.stub.ListTasks(sandbox_pb2.ListTasksRequest(family="stencils", tier=4, split="test"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = violations(caught.value)
    assert set(found) == {"family", "tier", "split"}
    assert "elementwise, gemm, rows, stencil" in found["family"]  # says what it serves


@pytest.mark.parametrize("name", sorted(SERVED))
def test_every_example_of_a_served_task_stops_at_the_stage_it_names(sandbox, name):
    stub = sandbox.stub
    task = next(t for t in list_all(stub, family=name, split="heldout"))
    full = stub.GetTask(sandbox_pb2.GetTaskRequest(task_id=task.id, view=sandbox_pb2.TASK_VIEW_FULL), timeout=10).task
    cpu = [e for e in full.examples if e.toolchain == common_pb2.TOOLCHAIN_CPU]
    assert len(cpu) == 5
    verdicts = sandbox.batch([candidate(task.id, e.source, label=sandbox_pb2.ExampleKind.Name(e.kind)) for e in cpu],
                             timing=False)
    by_label = {v.candidate_id: v for v in verdicts}
    for example in cpu:
        verdict = by_label[sandbox_pb2.ExampleKind.Name(example.kind)]
        assert verdict.stage == example.expected_stage, describe(verdict)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_served_solution_is_timed_against_the_generated_reference(sandbox, name):
    task = list_all(sandbox.stub, family=name, split="train")[0]
    full = sandbox.stub.GetTask(sandbox_pb2.GetTaskRequest(task_id=task.id, view=sandbox_pb2.TASK_VIEW_FULL),
                                timeout=10).task
    (solution,) = [e for e in full.examples if e.toolchain == common_pb2.TOOLCHAIN_CPU
                   and e.kind == sandbox_pb2.EXAMPLE_KIND_SOLUTION]
    verdict = sandbox.evaluate(task.id, solution.source, timing=True)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    assert verdict.candidate_timing.median_ms > 0 and verdict.reference_timing.median_ms > 0 and verdict.speedup > 0


def test_a_family_task_the_service_does_not_serve_is_not_found(sandbox):
    unserved = families.generate("rows", seed=3, index=SERVED["rows"]).id  # the next one, past the count
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.stub.GetTask(sandbox_pb2.GetTaskRequest(task_id=unserved), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("entries, says", [
    (["stencils"], "unknown task family 'stencils'"),
    (["elementwise:0"], "whole number from 1"),
    (["elementwise:ten"], "whole number from 1"),
    (["elementwise", "elementwise:5"], "named twice"),
    (["elementwise@4"], "tier after @ must be 1, 2 or 3"),
    (["elementwise@:5"], "tier after @ must be 1, 2 or 3"),
])
def test_a_bad_task_families_setting_stops_the_service_at_start_naming_it(entries, says):
    config = SandboxConfig(task_families=entries)
    with pytest.raises(StartupError, match=says) as caught:
        service_spec("sandbox").build(config)
    assert str(caught.value).startswith("task_families: ")


def test_with_no_families_set_the_service_serves_the_suite_alone():
    servicer = service_spec("sandbox").build(SandboxConfig()).registrations[0].servicer
    assert len(servicer.suite) == BUILTIN and not servicer.families


def test_a_tier_entry_serves_the_first_tasks_of_that_tier_alone():
    config = SandboxConfig(task_families=["elementwise@1:20", "rows:5"], task_family_seed=3)
    suite = service_spec("sandbox").build(config).registrations[0].servicer.suite
    elementwise = sorted((t for t in suite.values() if t.family == "elementwise"), key=lambda t: int(t.id.rsplit(".i", 1)[1]))
    assert len(elementwise) == 20 and {t.tier for t in elementwise} == {1}
    assert [t.id for t in elementwise] == [families.generate("elementwise", 3, i).id
                                           for i in families.tier_indices("elementwise", 3, 1, 20)]
    assert sorted(t.id for t in suite.values() if t.family == "rows") == sorted(
        t.id for t in families.generate_many("rows", 3, 5))
