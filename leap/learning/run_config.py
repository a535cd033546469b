"""Defaults and checks of the config messages every learner's run shares
(`leap.common.v1.RolloutSampling`, `OptimizerConfig` and `LoraConfig`), so the trainer and the distiller
fill and refuse them alike. Pure functions over the messages; field paths are given a prefix
such as "config.sampling.".
"""

from __future__ import annotations

from leap.common.v1 import common_pb2
from leap.learning.optim import SCHEDULES, OptimizerSettings
from leap.runtime import Violations

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 384


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
    if sampling.HasField("temperature"):
        v.check(sampling.temperature > 0, prefix + "temperature",
                "must be above 0: on-policy learning needs sampled rollouts with logprobs (0 is greedy)")
    if sampling.HasField("top_p"):
        v.check(0 < sampling.top_p <= 1, prefix + "top_p", "must be in (0, 1]")
    v.check(sampling.max_new_tokens >= 0, prefix + "max_new_tokens",
            f"must be at least 1 (0 means the default, {DEFAULT_MAX_NEW_TOKENS})")


def optimizer_violations(optimizer: common_pb2.OptimizerConfig, prefix: str, v: Violations) -> None:
    if optimizer.HasField("learning_rate"):
        v.check(optimizer.learning_rate > 0, prefix + "learning_rate", "must be above 0")
    v.check(optimizer.warmup_steps >= 0, prefix + "warmup_steps", "must not be negative")
    v.check(optimizer.schedule in ("", *SCHEDULES), prefix + "schedule", f"must be one of {', '.join(SCHEDULES)}")
    v.check(optimizer.weight_decay >= 0, prefix + "weight_decay", "must not be negative")
    if optimizer.HasField("max_grad_norm"):
        v.check(optimizer.max_grad_norm >= 0, prefix + "max_grad_norm", "must not be negative (0 turns clipping off)")
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
