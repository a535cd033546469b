"""A distillation run's configuration: its documented defaults, the checks that refuse a bad
one before the run starts, and how its switches map onto the loss. Pure functions over
`leap.distill.v1.DistillConfig` (no I/O); the checks that read the teacher union, the models
or the other services are in `preflight.py`.

Zero values mean the documented default (the proto comments); `with_defaults` makes every
default explicit, so the stored config of a run says exactly what it ran with.
"""

from __future__ import annotations

import math

from leap.common.v1 import common_pb2
from leap.distill.v1 import distill_pb2
from leap.learning import check_model_dir
from leap.learning.run_config import (
    fill_lora, fill_optimizer, fill_sampling, lora_violations, model_name_problem, optimizer_violations,
    report_to_violations,
    sampling_violations,
)
from leap.runtime import Violations
from svc_distill.losses import TuOpdConfig

Objective = distill_pb2.Objective

DEFAULT_STUDENT_MODEL = "student"
DEFAULT_EXAMPLES_PER_STEP = 8
DEFAULT_SAMPLES_PER_EXAMPLE = 4
DEFAULT_RELIABILITY_THRESHOLD = 0.5  # rho
DEFAULT_CRD_LAMBDA = 1.0
DEFAULT_CHECKPOINT_EVERY = 10
DEFAULT_EVAL_SAMPLES = 4
HELDOUT_SPLIT = "heldout"


def with_defaults(config: distill_pb2.DistillConfig, *, student_address: str,
                  sandbox_address: str) -> distill_pb2.DistillConfig:
    """A copy with every zero or unset field replaced by its default; the addresses are the
    service's own defaults. The toolchain and the task lists, which come from the union and the
    sandbox, are left to preflight."""
    out = distill_pb2.DistillConfig()
    out.CopyFrom(config)
    out.student_address = out.student_address or student_address
    out.student_model = out.student_model or DEFAULT_STUDENT_MODEL
    out.sandbox_address = out.sandbox_address or sandbox_address
    for teacher in out.teachers:
        teacher.address = teacher.address or out.student_address
        teacher.model = teacher.model or teacher.name
    out.examples_per_step = out.examples_per_step or DEFAULT_EXAMPLES_PER_STEP
    out.samples_per_example = out.samples_per_example or DEFAULT_SAMPLES_PER_EXAMPLE
    fill_sampling(out.sampling)
    fill_optimizer(out.optimizer)
    fill_lora(out.lora)
    out.objective = out.objective or Objective.OBJECTIVE_CRD
    if not out.HasField("reliability_threshold"):
        out.reliability_threshold = DEFAULT_RELIABILITY_THRESHOLD
    if not out.HasField("crd_lambda"):
        out.crd_lambda = DEFAULT_CRD_LAMBDA
    out.checkpoint_every = out.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
    out.eval_samples = out.eval_samples or DEFAULT_EVAL_SAMPLES
    return out


def violations(config: distill_pb2.DistillConfig, prefix: str = "config.") -> Violations:
    """Every problem of a requested config that needs no file but the student's directory
    and no other service, with field paths like `config.samples_per_example`."""
    v = Violations()

    def check(ok: bool, field: str, description: str) -> None:
        v.check(ok, prefix + field, description)

    problem = check_model_dir(config.student_model_path)
    check(problem is None, "student_model_path", problem or "")
    check(bool(config.teacher_union_path), "teacher_union_path", "is required (the directory an RGRPO run wrote)")
    if config.student_model:
        problem = model_name_problem(config.student_model)
        check(problem is None, "student_model", problem or "")
    names = [t.name for t in config.teachers]
    for i, name in enumerate(names):
        check(bool(name), f"teachers[{i}].name", "is required (a teacher name of the union)")
        check(not name or names.index(name) == i, f"teachers[{i}].name", f"teacher {name!r} is listed twice")
        served = config.teachers[i].model or name  # served under its own name by default
        if served:
            problem = model_name_problem(served)
            check(problem is None, f"teachers[{i}].{'model' if config.teachers[i].model else 'name'}", problem or "")
    check(config.steps >= 1, "steps", "is required and must be at least 1")
    check(config.examples_per_step >= 0, "examples_per_step",
          f"must be at least 1 (0 means the default, {DEFAULT_EXAMPLES_PER_STEP})")
    check(config.samples_per_example >= 0, "samples_per_example",
          f"must be at least 1 (0 means the default, {DEFAULT_SAMPLES_PER_EXAMPLE})")
    sampling_violations(config.sampling, prefix + "sampling.", v)
    optimizer_violations(config.optimizer, prefix + "optimizer.", v)
    lora_violations(config.lora, prefix + "lora.", v)
    report_to_violations(config.report_to, prefix + "report_to", v)
    check(config.objective in Objective.values(), "objective", f"unknown objective {config.objective}")
    if config.HasField("reliability_threshold"):
        check(0 <= config.reliability_threshold <= 1, "reliability_threshold",
              "rho is compared with pass rates: it must be in [0, 1]")
    if config.HasField("crd_lambda"):
        check(math.isfinite(config.crd_lambda) and config.crd_lambda >= 0, "crd_lambda", "must be 0 or more")
    check(config.checkpoint_every >= 0, "checkpoint_every",
          f"must not be negative (0 means the default, {DEFAULT_CHECKPOINT_EVERY})")
    check(config.eval_every >= 0, "eval_every", "must not be negative (0 evaluates only before and after)")
    check(config.eval_samples >= 0, "eval_samples", f"must be at least 1 (0 means the default, {DEFAULT_EVAL_SAMPLES})")
    check(len(set(config.train_tasks)) == len(config.train_tasks), "train_tasks", "lists a task twice")
    check(not set(config.train_tasks) & set(config.eval_tasks), "eval_tasks",
          "shares tasks with train_tasks: held-out tasks must not be trained on")
    check(config.toolchain in common_pb2.Toolchain.values(), "toolchain", f"unknown toolchain {config.toolchain}")
    return v


def tu_opd_config(config: distill_pb2.DistillConfig) -> TuOpdConfig:
    """The loss's settings for a config with its defaults filled. OBJECTIVE_WEIGHTED_OPD and
    OBJECTIVE_CONSENSUS are one loss: sum_k w_k (l_k,t - s_t) = c_t - s_t when the weights of
    an example sum to 1, which they do for every example that is trained on."""
    return TuOpdConfig(
        rho=config.reliability_threshold,
        crd_lambda=config.crd_lambda,
        gating=not config.disable_reliability_gating,
        weighting=not config.disable_quality_weighting,
        crd=config.objective == Objective.OBJECTIVE_CRD,
        single_best=config.single_best_teacher,
    )
