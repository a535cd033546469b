"""Every example of the built-in suite, through a real SandboxService over gRPC, stops at the
stage it was written to stop at: solutions and slow variants pass, syntax errors stop at
COMPILE, wrong outputs at CORRECT, out-of-bounds crashes at RUN. CUDA solutions compile
with nvcc here and stop at RUN with NO_DEVICE (never a made-up result); on a GPU machine
they pass (tests/test_sandbox_gpu.py)."""

from __future__ import annotations

import shutil

import pytest

from leap import tasks
from tests.sandbox_helpers import CPU, CUDA, Stage, candidate, describe, flags, running_sandbox

SUITE = tasks.load_suite()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with running_sandbox(tmp_path_factory.mktemp("suite")) as running:
        yield running


def test_every_cpu_example_stops_at_its_expected_stage(sandbox):
    examples = [(task, example) for task in SUITE for example in task.examples if example.toolchain == CPU]
    assert len(examples) == 5 * len(SUITE)
    batch = [candidate(task.id, example.source, CPU, f"{task.id}/{tasks.ExampleKind.Name(example.kind)}")
             for task, example in examples]
    verdicts = sandbox.batch(batch, timing_trials=3, warmup_runs=1)
    wrong = [describe(v) for (task, example), v in zip(examples, verdicts) if v.stage != example.expected_stage]
    assert not wrong, "\n".join(wrong)
    for (task, example), verdict in zip(examples, verdicts):
        assert verdict.task_id == task.id and verdict.candidate_id.startswith(task.id)
        if example.expected_stage == Stage.STAGE_PASSED:
            assert verdict.trials_passed == verdict.trials_run == 3
            assert verdict.candidate_timing.trials == verdict.reference_timing.trials >= 3 and verdict.speedup > 0
        if example.kind == tasks.ExampleKind.EXAMPLE_KIND_CRASH:
            assert "CRASHED" in flags(verdict) and "SIGSEGV" in verdict.runtime_error, describe(verdict)
        if example.kind == tasks.ExampleKind.EXAMPLE_KIND_SYNTAX_ERROR:
            assert "error" in verdict.compile.log and verdict.compile.compiler == "g++"
        if example.kind == tasks.ExampleKind.EXAMPLE_KIND_WRONG_OUTPUT:
            assert verdict.mismatch.reason in ("values", "nan") and verdict.mismatch.bad_elements > 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_solutions_compile_with_nvcc_and_report_no_device_without_a_gpu(sandbox):
    if sandbox.servicer.evaluator.devices.cuda_count:
        pytest.skip("a CUDA device is present: tests/test_sandbox_gpu.py runs the CUDA solutions")
    chosen = [t for t in SUITE if t.id in ("relu", "softmax", "gemm")]
    batch = [candidate(t.id, tasks.examples(t, CUDA, tasks.ExampleKind.EXAMPLE_KIND_SOLUTION)[0].source, CUDA, t.id)
             for t in chosen]
    for verdict in sandbox.batch(batch):
        assert verdict.stage == Stage.STAGE_RUN and flags(verdict) == {"NO_DEVICE"}, describe(verdict)
        assert verdict.compile.compiler == "nvcc" and "release" in verdict.compile.compiler_version
        assert any(flag.startswith("-arch=sm_") for flag in verdict.compile.flags)
        assert not verdict.HasField("candidate_timing") and verdict.speedup == 0 and not verdict.mismatch.output
