"""The kernelbench toolchain on a CPU machine: a directory of KernelBench-style problems is
served as tasks, and a ModelNew candidate is checked against the problem's Model (fresh
seeded inputs per trial, outputs compared by the service, inputs checked for mutation) and
timed against it. One test builds a real C++ extension with load_inline (slow)."""

from __future__ import annotations

import pytest

from leap.sandbox.v1 import sandbox_pb2
from tests.sandbox_helpers import KERNELBENCH, Stage, describe, flags, running_sandbox

pytest.importorskip("torch")

PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """Scales x by a learned vector, then applies ReLU."""

    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return torch.relu(x * self.scale)


batch, features = 32, 64


def get_inputs():
    return [torch.randn(batch, features)]


def get_init_inputs():
    return [features]
'''

MODEL_NEW = '''
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return torch.clamp_min(x * self.scale, 0.0)
'''

LOAD_INLINE = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
torch::Tensor scale_relu(torch::Tensor x, torch::Tensor s) {
    auto y = torch::empty_like(x);
    auto xa = x.accessor<float, 2>();
    auto sa = s.accessor<float, 1>();
    auto ya = y.accessor<float, 2>();
    for (int64_t i = 0; i < x.size(0); i++)
        for (int64_t j = 0; j < x.size(1); j++) {
            float v = xa[i][j] * sa[j];
            ya[i][j] = v > 0 ? v : 0;
        }
    return y;
}
"""
ext = load_inline(name="scale_relu_ext", cpp_sources=source, functions=["scale_relu"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return ext.scale_relu(x.contiguous(), self.scale.detach().contiguous())
'''

TASK = "level1/7_Scale_relu"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    problems = tmp_path_factory.mktemp("kernelbench")
    (problems / "level1").mkdir()
    (problems / "level1" / "7_Scale_relu.py").write_text(PROBLEM)
    with running_sandbox(tmp_path_factory.mktemp("kb"), workers=1, task_dirs=[str(problems)]) as running:
        yield running


def test_kernelbench_problems_are_listed_as_tasks(sandbox):
    reply = sandbox.stub.GetTask(sandbox_pb2.GetTaskRequest(task_id=TASK), timeout=10)
    assert list(reply.task.toolchains) == [KERNELBENCH] and "class Model" in reply.task.reference_source
    listed = sandbox.stub.ListTasks(sandbox_pb2.ListTasksRequest(toolchain=KERNELBENCH), timeout=10)
    assert [t.id for t in listed.tasks] == [TASK]


def test_pytorch_only_model_new_passes_and_is_timed(sandbox):
    verdict = sandbox.evaluate(TASK, MODEL_NEW, KERNELBENCH, timing_trials=5)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    assert verdict.device == "cpu" and verdict.trials_passed == 3
    # at least the 5 pairs of timed runs asked for, more while the speedup's interval is wide
    assert verdict.candidate_timing.trials == verdict.reference_timing.trials >= 5
    assert 0 < verdict.speedup_low <= verdict.speedup <= verdict.speedup_high and verdict.calls_per_run >= 1
    assert "torch" in verdict.compile.compiler_version


@pytest.mark.parametrize("change, stage, text", [
    (("torch.clamp_min(x * self.scale, 0.0)", "torch.clamp_min(x * self.scale, 0.1)"), Stage.STAGE_CORRECT, "wrong"),
    (("torch.clamp_min(x * self.scale, 0.0)", "torch.clamp_min(x * self.scale[:3], 0.0)"), Stage.STAGE_RUN, "size"),
    (("def forward(self, x):", "def forward(self, x)"), Stage.STAGE_COMPILE, "SyntaxError"),
    (("self.scale = nn.Parameter(torch.randn(features))", "raise ValueError('no')"), Stage.STAGE_COMPILE, "ValueError"),
    (("class ModelNew", "class Other"), Stage.STAGE_FORMAT, "ModelNew"),
    (("import torch\n", "import torch\nimport subprocess\n"), Stage.STAGE_FORMAT, "spawns processes"),
    (("return torch.clamp_min(x * self.scale, 0.0)",
      "x.add_(1.0)\n        return torch.clamp_min((x - 1.0) * self.scale, 0.0)"), Stage.STAGE_CORRECT, "modified its input"),
])
def test_broken_model_new_stops_at_the_right_stage(sandbox, change, stage, text):
    verdict = sandbox.evaluate(TASK, MODEL_NEW.replace(*change), KERNELBENCH, timing=False)
    assert verdict.stage == stage and text in (verdict.message + verdict.runtime_error + verdict.compile.log), describe(verdict)
    if "modified" in text:
        assert "INPUT_MUTATED" in flags(verdict)


@pytest.mark.slow
def test_load_inline_cpu_extension_builds_and_passes(sandbox):
    verdict = sandbox.evaluate(TASK, LOAD_INLINE, KERNELBENCH, timing_trials=3, timeout=900)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    assert verdict.compile.seconds > 1  # a real build with the torch headers
