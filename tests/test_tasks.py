"""The built-in task suite and its loader (leap.tasks): coverage of the issue's categories,
consistent example solutions and small broken mutations, seeded inputs, the NumPy oracle
against the PyTorch baseline, KernelBench directories, packaging, and every CUDA solution
compiled by nvcc. That each example stops at its expected stage is tested through the
sandbox pipeline (tests/test_sandbox_suite.py)."""

from __future__ import annotations

import difflib
import fnmatch
import re
import shutil
import subprocess
import tomllib

import numpy as np
import pytest

from leap import tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from tests.conftest import ROOT

Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain
Kind = sandbox_pb2.ExampleKind

SUITE = tasks.load_suite()
IDS = [t.id for t in SUITE]
ISSUE_TASKS = {  # the categories the issue names, by the task that covers each
    "relu", "gelu", "silu", "add_broadcast", "sum_rows", "max_rows", "mean_cols", "softmax", "log_softmax", "layer_norm",
    "rms_norm", "prefix_sum", "transpose", "gather", "gemv", "gemm", "batched_gemm", "conv1d", "conv2d", "bias_gelu",
    "matmul_relu",
}


def example(task, toolchain, kind) -> sandbox_pb2.Example:
    (found,) = tasks.examples(task, toolchain, kind)
    return found


def test_suite_has_at_least_24_tasks_covering_the_issue_sorted_by_id():
    assert len(SUITE) >= 24
    assert IDS == sorted(IDS) and len(set(IDS)) == len(IDS)
    assert ISSUE_TASKS <= set(IDS)
    categories = {t.category for t in SUITE}
    assert {"elementwise", "reduction", "scan", "data_movement", "matmul", "convolution", "fused"} <= categories


def test_heldout_split_is_about_six_tasks_spread_over_categories():
    heldout = [t for t in SUITE if t.split == "heldout"]
    assert 5 <= len(heldout) <= 7
    assert len({t.category for t in heldout}) >= 5
    assert all(t.split in ("train", "heldout") for t in SUITE)


@pytest.mark.parametrize("task", SUITE, ids=IDS)
def test_every_task_ships_each_example_kind_defining_its_entry_point(task):
    assert task.statement and task.title and task.origin == "builtin"
    assert set(task.toolchains) == {Toolchain.TOOLCHAIN_CPU, Toolchain.TOOLCHAIN_CUDA}
    assert task.entry_point.c_declaration.startswith(f'extern "C" void {task.entry_point.name}(')
    wanted = [
        (Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_SOLUTION, Stage.STAGE_PASSED),
        (Toolchain.TOOLCHAIN_CUDA, Kind.EXAMPLE_KIND_SOLUTION, Stage.STAGE_PASSED),
        (Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_SYNTAX_ERROR, Stage.STAGE_COMPILE),
        (Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_WRONG_OUTPUT, Stage.STAGE_CORRECT),
        (Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_CRASH, Stage.STAGE_RUN),
        (Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_SLOW, Stage.STAGE_PASSED),
    ]
    for toolchain, kind, stage in wanted:
        found = example(task, toolchain, kind)
        assert found.expected_stage == stage
        assert f'extern "C" void {task.entry_point.name}(' in found.source


@pytest.mark.parametrize("task", SUITE, ids=IDS)
def test_solutions_are_short_and_in_one_style(task):
    cpu = example(task, Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_SOLUTION).source
    cuda = example(task, Toolchain.TOOLCHAIN_CUDA, Kind.EXAMPLE_KIND_SOLUTION).source
    for source in (cpu, cuda):
        assert source.startswith("#include <math.h>\n#include <stdint.h>\n\n")
        assert len(source.splitlines()) <= 30
        assert "    " in source and "\t" not in source
    assert f"__global__ void {task.entry_point.name}_kernel(" in cuda
    # the C declaration of the prompt is the solution's signature, word for word
    assert task.entry_point.c_declaration.rstrip(";") in cpu.replace(" {", ";").replace(";\n", ";")


@pytest.mark.parametrize("task", SUITE, ids=IDS)
def test_broken_variants_are_small_mutations_of_the_solution(task):
    solution = example(task, Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_SOLUTION).source.splitlines()
    for kind in (Kind.EXAMPLE_KIND_SYNTAX_ERROR, Kind.EXAMPLE_KIND_WRONG_OUTPUT, Kind.EXAMPLE_KIND_CRASH):
        broken = example(task, Toolchain.TOOLCHAIN_CPU, kind).source.splitlines()
        changed = [line for line in difflib.unified_diff(solution, broken, lineterm="", n=0)
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        assert 2 <= len(changed) <= 4, (kind, changed)
    slow = example(task, Toolchain.TOOLCHAIN_CPU, Kind.EXAMPLE_KIND_SLOW).source
    assert "#pragma omp" not in slow  # slow: one thread and a poor loop order


@pytest.mark.parametrize("task", SUITE, ids=IDS)
def test_seeded_inputs_are_reproducible_fresh_per_trial_and_fit_the_signature(task):
    spec = tasks.task_spec(task.id)
    sizes = spec.preset("small")
    first, again, other = spec.inputs(sizes, 7, 0), spec.inputs(sizes, 7, 0), spec.inputs(sizes, 7, 1)
    for arg in spec.arguments(sandbox_pb2.ARGUMENT_ROLE_INPUT):
        assert first[arg.name].shape == tasks.shape_of(arg, sizes)
        assert first[arg.name].dtype == tasks.NUMPY_DTYPE[arg.dtype]
        np.testing.assert_array_equal(first[arg.name], again[arg.name])
    assert any(not np.array_equal(first[k], other[k]) for k in first)
    expected = spec.expected(first, sizes)
    for arg in spec.arguments(sandbox_pb2.ARGUMENT_ROLE_OUTPUT):
        assert expected[arg.name].dtype == np.float64 and np.isfinite(expected[arg.name]).all()
    # the reference keeps the inputs' precision (it is also the float32 CPU baseline)
    assert all(v.dtype == np.float32 for v in spec.call_reference(first, sizes).values())


def test_torch_baselines_agree_with_the_numpy_oracle():
    torch = pytest.importorskip("torch")
    for task in SUITE:
        spec = tasks.task_spec(task.id)
        sizes = spec.preset("small")
        inputs = spec.inputs(sizes, 0, 0)
        expected = spec.expected(inputs, sizes)
        kwargs = {a.name: torch.from_numpy(inputs[a.name]) if a.role == sandbox_pb2.ARGUMENT_ROLE_INPUT else sizes[a.name]
                  for a in task.entry_point.arguments if a.role != sandbox_pb2.ARGUMENT_ROLE_OUTPUT}
        got = spec.torch_reference(**kwargs)
        got = got if isinstance(got, tuple) else (got,)
        for arg, value in zip(spec.arguments(sandbox_pb2.ARGUMENT_ROLE_OUTPUT), got):
            np.testing.assert_allclose(value.numpy(), expected[arg.name], atol=task.tolerance.atol, rtol=task.tolerance.rtol,
                                       err_msg=task.id)


def test_get_task_returns_a_copy_and_raises_key_error_when_missing():
    task = tasks.get_task("gemm")
    assert task.entry_point.c_declaration == (
        'extern "C" void gemm(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k);')
    task.title = "changed"
    assert tasks.get_task("gemm").title != "changed"
    with pytest.raises(KeyError):
        tasks.get_task("no_such_task")
    assert not tasks.basic_view(task).examples and task.examples


def test_shape_expressions_allow_arithmetic_over_sizes_only():
    assert tasks.eval_shape("n - kw + 1", {"n": 10, "kw": 3}) == 8
    assert tasks.eval_shape("(h - 2) * 2 // 3", {"h": 8}) == 4
    for bad in ("__import__('os')", "n ** 2", "x.y"):
        with pytest.raises(ValueError):
            tasks.eval_shape(bad, {"n": 2})
    with pytest.raises(KeyError):
        tasks.eval_shape("q", {"n": 2})


KERNELBENCH_PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """Scales its input by two."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(64, 32)]


def get_init_inputs():
    return []
'''


def test_kernelbench_directories_load_as_kernelbench_tasks(tmp_path):
    (tmp_path / "level1").mkdir()
    (tmp_path / "level1" / "3_Scale_by_two.py").write_text(KERNELBENCH_PROBLEM)
    (tmp_path / "level1" / "helpers.py").write_text("X = 1\n")  # not a problem: ignored
    suite = tasks.load_suite([tmp_path])
    assert len(suite) == len(SUITE) + 1
    task = tasks.get_task("level1/3_Scale_by_two", [tmp_path])
    assert list(task.toolchains) == [Toolchain.TOOLCHAIN_KERNELBENCH]
    assert task.category == "level1" and task.origin == str(tmp_path.resolve())
    assert "Scales its input by two." in task.statement and "class Model" in task.reference_source
    assert task.id == "level1/3_Scale_by_two"  # the file's own name, as KernelBench names its problems
    assert tasks.kernelbench_file(task.id, [tmp_path]).name == "3_Scale_by_two.py"
    with pytest.raises(KeyError):
        tasks.task_spec(task.id, [tmp_path])
    (tmp_path / "relu.py").write_text(KERNELBENCH_PROBLEM)
    with pytest.raises(tasks.TaskError, match="already taken"):
        tasks.load_suite([tmp_path])


def test_package_data_ships_every_suite_file():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["leap.tasks"]
    base = tasks.SUITE_DIR.parent
    files = [p.relative_to(base).as_posix() for p in tasks.SUITE_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) == 8 * len(SUITE)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not missing


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_every_cuda_solution_compiles_with_nvcc(tmp_path):
    # One translation unit for the whole suite (one nvcc start instead of one per task);
    # #line keeps every diagnostic pointing at its own task's file.
    names = [t.entry_point.name for t in SUITE]
    unit = "".join(f'#line 1 "{t.id}/solutions/cuda.cu"\n' + example(t, Toolchain.TOOLCHAIN_CUDA, Kind.EXAMPLE_KIND_SOLUTION).source
                   for t in SUITE)
    source = tmp_path / "suite.cu"
    source.write_text(unit)
    result = subprocess.run(["nvcc", "-O3", "-arch=sm_80", "-Xcompiler", "-fPIC", "-shared", "-o", str(tmp_path / "suite.so"),
                             str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "suite.so")], capture_output=True, text=True).stdout
    assert set(names) <= set(re.findall(r" T (\w+)", exported))


def test_a_kernelbench_checkout_at_its_root_means_its_problems_folder(tmp_path):
    problems = tmp_path / "KernelBench" / "level1"
    problems.mkdir(parents=True)
    (problems / "19_ReLU.py").write_text(KERNELBENCH_PROBLEM)
    prompts = tmp_path / "src" / "kernelbench" / "prompts"  # example Models for prompts, and a file 3.11 cannot parse
    prompts.mkdir(parents=True)
    (prompts / "model_ex_add.py").write_text(KERNELBENCH_PROBLEM)
    (prompts / "template.py").write_text("def f[T](x: T) -> T: ...\nclass {name}:\n")
    loaded = [t.id for t in tasks.load_suite([tmp_path]) if t.origin != "builtin"]
    assert loaded == ["level1/19_ReLU"]


def test_a_kernelbench_file_named_like_a_generated_task_is_refused(tmp_path):
    (tmp_path / "fam.rows.s0.i1.py").write_text(KERNELBENCH_PROBLEM)
    with pytest.raises(tasks.TaskError, match="would read as a generated task"):
        tasks.load_suite([tmp_path])
