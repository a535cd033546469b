"""Defaults and checks of the config messages every learner's run shares
(`leap.common.v1.RolloutSampling`, `OptimizerConfig` and `LoraConfig`, and the `report_to`
trackers), so the trainer and the distiller fill and refuse them alike. Pure functions over the messages; field paths are given a prefix
such as "config.sampling.".
"""

from __future__ import annotations

import math
import re

from leap.common.v1 import common_pb2
from leap.learning.optim import SCHEDULES, OptimizerSettings
from leap.learning.reporters import report_to_violations  # noqa: F401 - one place for a run config's checks
from leap.runtime import Violations

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 384
MAX_TEMPERATURE = 100.0  # the policy's bound too: beyond it sampling is uniform noise
MAX_LEARNING_RATE = 1.0  # AdamW moves each weight by about the learning rate per update
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the policy service's rule for served names


def finite(value: float) -> bool:
    return math.isfinite(value)


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be a served model's name (the policy service's rule), or None."""
    if MODEL_NAME.match(name):
        return None
    return (f"{name[:64]!r} is not a model name: 1 to 128 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit (no path separators)")


def fill_sampling(sampling: common_pb2.RolloutSampling) -> None:
    """Make every default of `sampling` explicit, in place."""
    if not sampling.HasField("temperature"):
        sampling.temperature = DEFAULT_TEMPERATURE
    if not sampling.HasField("top_p"):
        sampling.top_p = DEFAULT_TOP_P
    sampling.max_new_tokens = sampling.max_new_tokens or DEFAULT_MAX_NEW_TOKENS


def fill_optimizer(optimizer: common_pb2.OptimizerConfig) -> None:
    """Make every default of `optimizer` explicit, in place; an unknown schedule is left as
    sent, for `optimizer_violations` to report."""
    if optimizer.schedule in ("", *SCHEDULES):
        OptimizerSettings.from_proto(optimizer).to_proto(optimizer)


def sampling_violations(sampling: common_pb2.RolloutSampling, prefix: str, v: Violations) -> None:
    """Ranges of the contract; `max_new_tokens` against the model's context is preflight's."""
    if sampling.HasField("temperature"):
        v.check(0 < sampling.temperature <= MAX_TEMPERATURE, prefix + "temperature",
                f"must be in (0, {MAX_TEMPERATURE:g}], got {sampling.temperature!r}: on-policy learning needs sampled "
                "rollouts with logprobs (0 is greedy)")
    if sampling.HasField("top_p"):
        v.check(0 < sampling.top_p <= 1, prefix + "top_p", f"must be in (0, 1], got {sampling.top_p!r}")
    v.check(sampling.max_new_tokens >= 0, prefix + "max_new_tokens",
            f"must be at least 1 (0 means the default, {DEFAULT_MAX_NEW_TOKENS})")


def optimizer_violations(optimizer: common_pb2.OptimizerConfig, prefix: str, v: Violations) -> None:
    """Ranges of the contract (NaN fails every comparison, so it is refused with them)."""
    if optimizer.HasField("learning_rate"):
        v.check(0 < optimizer.learning_rate <= MAX_LEARNING_RATE, prefix + "learning_rate",
                f"must be in (0, {MAX_LEARNING_RATE:g}], got {optimizer.learning_rate!r} (AdamW moves every weight "
                "by about this much per update; 1e-6 to 1e-4 is usual)")
    v.check(optimizer.warmup_steps >= 0, prefix + "warmup_steps", "must not be negative")
    v.check(optimizer.schedule in ("", *SCHEDULES), prefix + "schedule", f"must be one of {', '.join(SCHEDULES)}")
    v.check(0 <= optimizer.weight_decay <= 1, prefix + "weight_decay",
            f"must be in [0, 1], got {optimizer.weight_decay!r}")
    if optimizer.HasField("max_grad_norm"):
        v.check(finite(optimizer.max_grad_norm) and optimizer.max_grad_norm >= 0, prefix + "max_grad_norm",
                f"must be a finite number >= 0 (0 turns clipping off), got {optimizer.max_grad_norm!r}")
    v.check(optimizer.epochs_per_batch >= 0, prefix + "epochs_per_batch", "must be at least 1 (0 means the default, 1)")
    v.check(optimizer.micro_batch_tokens >= 0, prefix + "micro_batch_tokens",
            "must be at least 1 (0 means the default, 4096)")


def fill_lora(lora: common_pb2.LoraConfig) -> None:
    """Make the defaults of an adapter explicit (alpha 2 * rank, the decoder's linear layers);
    rank 0 (no adapter) is left empty."""
    from leap.learning.lora import DEFAULT_TARGETS

    if not lora.rank:
        return
    if not lora.HasField("alpha"):
        lora.alpha = 2.0 * lora.rank
    if not lora.target_modules:
        lora.target_modules.extend(DEFAULT_TARGETS)


def lora_violations(lora: common_pb2.LoraConfig, prefix: str, v: Violations) -> None:
    v.check(lora.rank >= 0, prefix + "rank", "must not be negative (0 trains every weight)")
    if lora.HasField("alpha"):
        v.check(lora.alpha > 0, prefix + "alpha", "must be above 0")
    for index, name in enumerate(lora.target_modules):
        v.check(bool(name.strip()), f"{prefix}target_modules[{index}]", "must not be empty")
    if not lora.rank:
        v.check(not lora.target_modules and not lora.save_merged and not lora.HasField("alpha"), prefix + "rank",
                "is required (at least 1) for the other LoRA settings to mean anything")
