"""A run's configuration: its documented defaults, and the checks that refuse a bad one
before the run starts. Pure functions over `leap.trainer.v1.RunConfig` (no I/O); the checks
that need the other services are in `preflight.py`.

Zero values mean the documented default (docs/ARCHITECTURE.md); `with_defaults` makes every
default explicit, so the stored config of a run says exactly what it ran with.
"""

from __future__ import annotations

from leap.common.v1 import common_pb2
from leap.learning import check_model_dir
from leap.learning.run_config import (
    fill_lora, fill_optimizer, fill_sampling, finite, lora_violations, model_name_problem, optimizer_violations,
    report_to_violations,
    sampling_violations,
)
from leap.reward.v1 import reward_pb2
from leap.runtime import Violations
from leap.trainer.v1 import trainer_pb2

TrainMode = trainer_pb2.TrainMode
GateMode = reward_pb2.GateMode
LossAggregation = trainer_pb2.LossAggregation

DEFAULT_POLICY_MODEL = "policy"
DEFAULT_TASKS_PER_STEP = 8  # B
DEFAULT_GROUP_SIZE = 8  # G
DEFAULT_MAX_TURNS = 3  # K
DEFAULT_CLIP_LOW = 0.2
DEFAULT_CLIP_HIGH = 0.28
DEFAULT_CHECKPOINT_EVERY = 10
DEFAULT_EVAL_SAMPLES = 4
DEFAULT_RGRPO_TAU = 0.5
DEFAULT_RGRPO_ALPHA = 0.1
DEFAULT_RGRPO_EVAL_SAMPLES = 8
DEFAULT_IMPORTANCE_CAP = 2.0  # C of the truncated importance ratio of stale rollouts
TRAIN_SPLIT = "train"
HELDOUT_SPLIT = "heldout"


def mode_of(config: trainer_pb2.RunConfig) -> int:
    return config.mode or TrainMode.TRAIN_MODE_LEAP


def turns_of(config: trainer_pb2.RunConfig) -> int:
    """Turns in all for an expanded group: K, or 1 in single-turn mode."""
    if mode_of(config) == TrainMode.TRAIN_MODE_SINGLE:
        return 1
    return config.max_turns or DEFAULT_MAX_TURNS


def with_defaults(config: trainer_pb2.RunConfig, services: trainer_pb2.ServiceAddresses) -> trainer_pb2.RunConfig:
    """A copy with every zero or unset field replaced by its default; `services` are the
    trainer's own defaults for addresses left empty. Toolchain and task lists, which depend
    on the sandbox, are left to preflight."""
    out = trainer_pb2.RunConfig()
    out.CopyFrom(config)
    out.policy_model = out.policy_model or DEFAULT_POLICY_MODEL
    for name in ("policy", "sandbox", "reward"):
        if not getattr(out.services, name):
            setattr(out.services, name, getattr(services, name))
    out.mode = mode_of(out)
    out.tasks_per_step = out.tasks_per_step or DEFAULT_TASKS_PER_STEP
    out.group_size = out.group_size or DEFAULT_GROUP_SIZE
    out.max_turns = turns_of(out)
    fill_sampling(out.sampling)
    fill_optimizer(out.optimizer)
    fill_lora(out.lora)
    if not out.loss.HasField("clip_low"):
        out.loss.clip_low = DEFAULT_CLIP_LOW
    if not out.loss.HasField("clip_high"):
        out.loss.clip_high = DEFAULT_CLIP_HIGH
    out.loss.aggregation = out.loss.aggregation or LossAggregation.LOSS_AGGREGATION_TOKEN_MEAN
    if not out.gate.mode:
        out.gate.mode = GateMode.GATE_MODE_EXPAND_ALL if out.mode == TrainMode.TRAIN_MODE_MULTITURN else GateMode.GATE_MODE_STATIC
    out.gate.max_turns = out.max_turns
    out.rank.method = out.rank.method or reward_pb2.RewardMethod.REWARD_METHOD_TOURNAMENT
    out.checkpoint_every = out.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
    out.flagged_verdicts = out.flagged_verdicts or trainer_pb2.FlaggedVerdicts.FLAGGED_VERDICTS_NO_SPEED_CREDIT
    out.eval_samples = out.eval_samples or DEFAULT_EVAL_SAMPLES
    out.eval_turns = out.eval_turns or (DEFAULT_MAX_TURNS if out.mode == TrainMode.TRAIN_MODE_SINGLE else out.max_turns)
    if out.max_staleness and not out.HasField("importance_cap"):
        out.importance_cap = DEFAULT_IMPORTANCE_CAP
    if out.rgrpo.rounds:
        out.rgrpo.steps_per_round = out.rgrpo.steps_per_round or out.steps
        if not out.rgrpo.HasField("tau"):
            out.rgrpo.tau = DEFAULT_RGRPO_TAU
        if not out.rgrpo.HasField("alpha"):
            out.rgrpo.alpha = DEFAULT_RGRPO_ALPHA
        out.rgrpo.eval_samples = out.rgrpo.eval_samples or DEFAULT_RGRPO_EVAL_SAMPLES
    return out


def timed(config: trainer_pb2.RunConfig) -> bool:
    """Whether the run's sandbox evaluations time correct answers (sandbox_timing, default true)."""
    return config.sandbox_timing if config.HasField("sandbox_timing") else True


def total_steps(config: trainer_pb2.RunConfig) -> int:
    """Optimizer steps of the whole run (every RGRPO round); `config` has its defaults."""
    return config.rgrpo.rounds * config.rgrpo.steps_per_round if config.rgrpo.rounds else config.steps


def violations(config: trainer_pb2.RunConfig, prefix: str = "config.") -> Violations:
    """Every problem of a requested config that needs no other service, with field paths
    like `config.group_size`."""
    v = Violations()

    def check(ok: bool, field: str, description: str) -> None:
        v.check(ok, prefix + field, description)

    problem = check_model_dir(config.model_path)
    check(problem is None, "model_path", problem or "")
    check(config.steps >= 1, "steps", "is required and must be at least 1")
    if config.policy_model:
        name_problem = model_name_problem(config.policy_model)
        check(name_problem is None, "policy_model", name_problem or "")
    check(config.mode in TrainMode.values(), "mode", f"unknown mode {config.mode}")
    check(config.tasks_per_step >= 0, "tasks_per_step", "must be at least 1 (0 means the default, 8)")
    check(config.group_size == 0 or config.group_size >= 2, "group_size",
          "must be at least 2: rank rewards compare rollouts within a group (0 means the default, 8)")
    check(config.max_turns >= 0, "max_turns", "K must be at least 1 (0 means the default, 3)")
    if config.mode == TrainMode.TRAIN_MODE_SINGLE:
        check(config.max_turns <= 1, "max_turns", "single-turn mode has one turn; leave max_turns unset or 1")
    sampling_violations(config.sampling, prefix + "sampling.", v)
    optimizer_violations(config.optimizer, prefix + "optimizer.", v)
    lora_violations(config.lora, prefix + "lora.", v)
    report_to_violations(config.report_to, prefix + "report_to", v)
    loss = config.loss
    if loss.HasField("clip_low"):
        check(0 <= loss.clip_low < 1, "loss.clip_low", f"must be in [0, 1), got {loss.clip_low!r}")
    if loss.HasField("clip_high"):
        check(finite(loss.clip_high) and loss.clip_high >= 0, "loss.clip_high",
              f"must be a finite number >= 0, got {loss.clip_high!r}")
    check(finite(loss.kl_beta) and loss.kl_beta >= 0, "loss.kl_beta", f"must be a finite number >= 0, got {loss.kl_beta!r}")
    gate_violations(config.gate, prefix + "gate.", v)
    rank_violations(config.rank, prefix + "rank.", v)
    if not timed(config):
        check(config.rank.method != reward_pb2.RewardMethod.REWARD_METHOD_LOG_SPEEDUP, "rank.method",
              "REWARD_METHOD_LOG_SPEEDUP rewards speed, which sandbox_timing false leaves unmeasured: "
              "time the candidates or choose another method")
        check(not config.gate.improve_below_speedup > 0, "gate.improve_below_speedup",
              "compares speedups, which sandbox_timing false leaves unmeasured: leave it 0 or time the candidates")
    check(loss.aggregation in LossAggregation.values(), "loss.aggregation", f"unknown aggregation {loss.aggregation}")
    if config.mode == TrainMode.TRAIN_MODE_MULTITURN:
        check(config.gate.mode in (0, GateMode.GATE_MODE_EXPAND_ALL), "gate.mode",
              "multiturn mode expands every group (GATE_MODE_EXPAND_ALL); use mode LEAP for other gates")
    check(config.gate.max_turns in (0, config.max_turns or DEFAULT_MAX_TURNS) or config.mode == TrainMode.TRAIN_MODE_SINGLE,
          "gate.max_turns", "is taken from max_turns; leave it unset")
    check(config.checkpoint_every >= 0, "checkpoint_every", "must not be negative (0 means the default, 10)")
    check(config.eval_every >= 0, "eval_every", "must not be negative (0 evaluates only before and after)")
    check(config.eval_samples >= 0, "eval_samples", "must be at least 1 (0 means the default, 4)")
    check(config.eval_turns >= 0, "eval_turns", "must be at least 1 (0 means max_turns, or 3 in single-turn mode)")
    check(config.eval_train_task_count >= 0, "eval_train_task_count", "must be at least 0 (0 means every training task)")
    check(len(set(config.train_tasks)) == len(config.train_tasks), "train_tasks", "lists a task twice")
    check(not set(config.train_tasks) & set(config.eval_tasks), "eval_tasks",
          "shares tasks with train_tasks: held-out tasks must not be trained on")
    check(config.toolchain in common_pb2.Toolchain.values(), "toolchain", f"unknown toolchain {config.toolchain}")
    check(config.flagged_verdicts in trainer_pb2.FlaggedVerdicts.values(), "flagged_verdicts",
          f"unknown value {config.flagged_verdicts}")
    rounds = config.rgrpo
    check(rounds.rounds >= 0, "rgrpo.rounds", "must not be negative (0 is a plain run)")
    check(rounds.steps_per_round >= 0, "rgrpo.steps_per_round", "must be at least 1 (0 means steps)")
    if rounds.HasField("tau"):
        check(0 <= rounds.tau <= 1, "rgrpo.tau", "is a pass rate: must be in [0, 1]")
    if rounds.HasField("alpha"):
        check(0 <= rounds.alpha <= 1, "rgrpo.alpha", "is a sampling weight relative to uncovered tasks: must be in [0, 1]")
    check(rounds.eval_samples >= 0, "rgrpo.eval_samples", "must be at least 1 (0 means the default, 8)")
    check(config.max_staleness >= 0, "max_staleness", "must not be negative (0 is the synchronous loop)")
    check(not (config.max_staleness and rounds.rounds), "max_staleness",
          "asynchronous rollouts are not supported with RGRPO rounds yet; leave it 0")
    if config.HasField("importance_cap"):
        check(config.importance_cap > 0, "importance_cap", "must be above 0 (the cap C of the importance ratio)")
    return v


def gate_violations(gate: reward_pb2.GateConfig, prefix: str, v: Violations) -> None:
    """The contract's ranges of the Gate overrides (the reward service is asked too, by a dry
    run at preflight: what it accepts decides)."""
    v.check(gate.mode in GateMode.values(), prefix + "mode", f"unknown gate mode {gate.mode}")
    for name in ("simple_threshold", "expand_budget"):
        if gate.HasField(name):
            value = getattr(gate, name)
            v.check(0 <= value <= 1, prefix + name, f"must be in [0, 1], got {value!r}")
    if gate.HasField("history_decay"):
        v.check(0 < gate.history_decay <= 1, prefix + "history_decay", f"must be in (0, 1], got {gate.history_decay!r}")
    v.check(finite(gate.improve_below_speedup) and gate.improve_below_speedup >= 0, prefix + "improve_below_speedup",
            f"must be a finite number >= 0 (0 is off), got {gate.improve_below_speedup!r}")


def rank_violations(rank: reward_pb2.RankConfig, prefix: str, v: Violations) -> None:
    """The contract's ranges of the Rank overrides (RankConfig's comments)."""
    for name in ("speedup_margin", "token_margin"):
        if rank.HasField(name):
            value = getattr(rank, name)
            v.check(finite(value) and value >= 0, prefix + name, f"must be a finite number >= 0, got {value!r}")
    if rank.HasField("turn_discount"):
        v.check(0 < rank.turn_discount <= 1, prefix + "turn_discount",
                f"gamma must be in (0, 1], got {rank.turn_discount!r} (1: every turn gets the trajectory's advantage)")
    if rank.HasField("failure_penalty"):
        v.check(finite(rank.failure_penalty) and rank.failure_penalty <= 0, prefix + "failure_penalty",
                f"must be a finite number <= 0, got {rank.failure_penalty!r}")
    v.check(rank.method in reward_pb2.RewardMethod.values(), prefix + "method", f"unknown reward method {rank.method}")
