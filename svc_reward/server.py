"""The RewardService servicer: a thin layer between the contract and the algorithms.

Each handler validates the whole request (every bad field named, `Violations`), converts
protos to the plain values of `gate`, `rank` and `history`, calls them, and converts back.
Unset request config fields take the service's config (`RewardConfig`); both are checked by
the same `problems()` of the pure parameter classes.

The task history lives in an SQLite database (`history.HistoryStore`, `history_path`). A
recording Gate call is one transaction: it reads the records of its tasks, decides, and
writes the new records with its idempotency key and its answer before it answers, so an
answered call is on disk, a failed write changes nothing (the call fails UNAVAILABLE and can
be retried), and a replayed key answers the stored response without recording again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import time

import grpc
from google.protobuf import timestamp_pb2

from leap.common.v1 import common_pb2
from leap.reward.v1 import reward_pb2, reward_pb2_grpc
from leap.runtime import KiB, MiB, Registration, ServerConfig, Service, ServiceSpec, Violations, option
from leap.runtime.errors import error_info
from leap.runtime.logging import get_logger
from svc_reward import gate as dcp
from svc_reward import rank as ranking
from svc_reward.history import HistoryFileError, HistoryFull, HistoryStore, KeyReused, TaskRecord
from svc_reward.stages import Stage, parse_stage
from svc_reward.stats import RewardStats, histogram_edges

SERVICE_NAME = "leap.reward.v1.RewardService"

# Rank requests with more pairwise comparisons than this run on a worker thread, so that a
# huge batch never stalls health checks and other calls on the event loop.
OFFLOAD_ABOVE_PAIRS = 50_000
MAX_IDEMPOTENCY_KEY_BYTES = 256

GATE_MODES = {reward_pb2.GATE_MODE_STATIC: dcp.Mode.STATIC, reward_pb2.GATE_MODE_ADAPTIVE: dcp.Mode.ADAPTIVE,
              reward_pb2.GATE_MODE_EXPAND_ALL: dcp.Mode.EXPAND_ALL}
DECISIONS = {dcp.Decision.SIMPLE: reward_pb2.DECISION_SIMPLE,
             dcp.Decision.CATASTROPHIC: reward_pb2.DECISION_CATASTROPHIC,
             dcp.Decision.EXPAND: reward_pb2.DECISION_EXPAND,
             dcp.Decision.OVER_BUDGET: reward_pb2.DECISION_OVER_BUDGET}
METHODS = {reward_pb2.REWARD_METHOD_TOURNAMENT: ranking.Method.TOURNAMENT,
           reward_pb2.REWARD_METHOD_BINARY: ranking.Method.BINARY,
           reward_pb2.REWARD_METHOD_LOG_SPEEDUP: ranking.Method.LOG_SPEEDUP}
STAGES = {int(stage): stage for stage in Stage}
# The largest request message of each RPC, in bytes (see leap.runtime.Registration): a Gate or
# Rank batch is tens of bytes per rollout or turn, so 16 MiB holds hundreds of thousands; a
# history read is a list of task ids.
REQUEST_LIMITS: dict[str, int | None] = {"Gate": 16 * MiB, "Rank": 16 * MiB, "GetTaskHistory": 1 * MiB,
                                         "GetStats": 16 * KiB}


@dataclasses.dataclass
class RewardConfig(ServerConfig):
    """Settings of the reward service (server settings included). The gate and rank settings
    are the defaults of every request field left unset."""

    history_path: str = option("runs/reward/task_history.sqlite3",
                               "SQLite database of the per-task difficulty history and of the stored answers of "
                               "idempotent Gate calls (one transaction per recording call); empty keeps it in memory "
                               "only. A task_history.json of an older service beside it is imported once and renamed "
                               "task_history.json.migrated; a path ending in .json names that file (the database "
                               "is then the same name with .sqlite3).")
    history_fsync: bool = option(True, "Sync the history database on every commit (SQLite synchronous=FULL), so a "
                                       "recorded call survives a machine crash too, not only a killed process "
                                       "(off: synchronous=NORMAL).")
    history_lock_timeout_seconds: float = option(10.0, "How long a recording Gate call waits for the history "
                                                       "database held by another writer before it fails UNAVAILABLE.")
    max_history_tasks: int = option(50_000, "Most distinct tasks the history holds; a Gate call that would record a "
                                            "new task beyond it is RESOURCE_EXHAUSTED (HISTORY_FULL).")
    max_task_id_bytes: int = option(256, "Longest task id (UTF-8 bytes) a request may carry.")
    max_gate_keys: int = option(100_000, "Most Gate idempotency keys kept with their answers; the oldest go first.")
    gate_key_ttl_seconds: float = option(7 * 24 * 3600.0, "How long a Gate idempotency key and its answer are kept "
                                                          "(a replay after that records again).")
    gate_mode: str = option("static", "Gate mode: static (DESIGN.md's thresholds), adaptive (expand the best groups "
                                      "by expected value within expand_budget) or expand_all (unpruned multi-turn).")
    simple_threshold: float = option(0.5, "Static mode: a group whose failing share f/G is at or below this is "
                                          "simple (no debugging turns), in [0, 1].")
    catastrophic_stage: str = option("compile", "A group whose rollouts all failed, none getting past this stage "
                                                "(format, compile, run or correct), is catastrophic (pruned).")
    never_solved_after: int = option(32, "A task with at least this many first-turn attempts and no solve is "
                                         "catastrophic (pruned); 0 or less turns the rule off.")
    max_turns: int = option(3, "Turns in all, the first included, for the rollouts of an expanded group (K), >= 1.")
    expand_budget: float = option(0.5, "Adaptive mode: share of the groups of a Gate call that may be expanded, "
                                       "in [0, 1].")
    history_decay: float = option(0.3, "Weight of the newest group's pass rate in the per-task moving average, "
                                       "in (0, 1].")
    improve_below_speedup: float = option(0.0, "In an expanded group, passing rollouts timed below this speedup "
                                               "also get debugging turns; 0 turns this off.")
    reward_method: str = option("tournament", "Rank method: tournament (DESIGN.md's rank reward), binary or "
                                              "log_speedup (baselines with group-normalized advantages).")
    speedup_margin: float = option(0.05, "Tournament: relative speedup difference below which two solved "
                                         "trajectories tie on speed, >= 0.")
    token_margin: float = option(0.10, "Tournament: relative token-count difference below which two solved "
                                       "trajectories tie on length, >= 0.")
    turn_discount: float = option(1.0, "Per-turn discount gamma in (0, 1]: turn t of T gets gamma^(T-t) times "
                                       "the trajectory's advantage (Kevin used 0.4); 1 gives every turn the same.")
    failure_penalty: float = option(math.log(0.1), "Log-speedup: reward of an unsolved trajectory and floor of a "
                                                   "solved one's log(speedup), finite and <= 0 (default log 0.1).")
    max_group_size: int = option(1024, "Largest group (rollouts or trajectories) a request may hold; the "
                                       "tournament costs G^2 comparisons.")

    def __post_init__(self) -> None:
        # Checked when the settings are loaded, so a bad value stops `leap serve` with one line.
        problems = [*self.gate_defaults().problems(), *self.rank_defaults().problems()]
        if self.max_group_size < 2:
            problems.append(("max_group_size", f"must be at least 2, got {self.max_group_size}"))
        for name in ("max_history_tasks", "max_task_id_bytes", "max_gate_keys"):
            if getattr(self, name) < 1:
                problems.append((name, f"must be at least 1, got {getattr(self, name)}"))
        for name in ("history_lock_timeout_seconds", "gate_key_ttl_seconds"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                problems.append((name, f"must be a finite number above 0, got {getattr(self, name)!r}"))
        if problems:
            raise ValueError("; ".join(f"{name}: {problem}" for name, problem in problems))

    def gate_defaults(self) -> dcp.GateParams:
        try:
            mode = dcp.Mode(self.gate_mode.strip().lower())
        except ValueError:
            raise ValueError(f"gate_mode: unknown mode {self.gate_mode!r}; choose one of: "
                             f"{', '.join(m.value for m in dcp.Mode)}") from None
        try:
            stage = parse_stage(self.catastrophic_stage)
        except ValueError as err:
            raise ValueError(f"catastrophic_stage: {err}") from None
        return dcp.GateParams(mode=mode, simple_threshold=self.simple_threshold, catastrophic_stage=stage,
                              never_solved_after=max(self.never_solved_after, 0), max_turns=self.max_turns,
                              expand_budget=self.expand_budget, history_decay=self.history_decay,
                              improve_below_speedup=self.improve_below_speedup)

    def rank_defaults(self) -> ranking.RankParams:
        try:
            method = ranking.Method(self.reward_method.strip().lower())
        except ValueError:
            raise ValueError(f"reward_method: unknown method {self.reward_method!r}; choose one of: "
                             f"{', '.join(m.value for m in ranking.Method)}") from None
        return ranking.RankParams(method=method, speedup_margin=self.speedup_margin, token_margin=self.token_margin,
                                  turn_discount=self.turn_discount, failure_penalty=self.failure_penalty)


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Difficulty-Conditioned Pruning and tournament rank rewards."""

    def __init__(self, config: RewardConfig, history: HistoryStore):
        self.config = config
        self.gate_defaults = config.gate_defaults()
        self.rank_defaults = config.rank_defaults()
        self.history = history
        self.stats = RewardStats()
        self.record_lock = asyncio.Lock()
        self.log = get_logger("leap.reward")

    # Gate -------------------------------------------------------------------------------

    async def Gate(self, request: reward_pb2.GateRequest, context) -> reward_pb2.GateResponse:
        violations = Violations()
        params = gate_params(request.config, self.gate_defaults, violations)
        groups = gate_groups(request, self.config.max_group_size, self.config.max_task_id_bytes, violations)
        key = request.idempotency_key
        if len(key.encode()) > MAX_IDEMPOTENCY_KEY_BYTES:
            violations.add("idempotency_key", f"must be at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes, got "
                                              f"{len(key.encode())}")
        violations.raise_if_any()
        task_ids = [task_id for task_id, _ in groups]
        if request.dry_run:
            known = await asyncio.to_thread(self.history.records, task_ids)
            return gate_response(dcp.gate(groups, params, known, time.time()))
        now = time.time()

        def decide(known: dict[str, TaskRecord]):
            result = dcp.gate(groups, params, known, now)
            return result.history, gate_response(result).SerializeToString(deterministic=True), result

        async with self.record_lock:  # one recording call at a time on this process's connection
            try:
                recorded = await asyncio.to_thread(self.history.record_call, task_ids, decide, key,
                                                   request_fingerprint(request) if key else b"", now)
            except HistoryFileError as err:
                self.log.error("history not written", error=str(err))
                raise error_info(grpc.StatusCode.UNAVAILABLE, f"{err}; nothing was recorded, retry the call",
                                 "HISTORY_NOT_WRITTEN") from None
            except HistoryFull as err:
                raise error_info(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{err}; nothing was recorded. Gate known tasks, send a dry run, or raise "
                                 "max_history_tasks", "HISTORY_FULL") from None
            except KeyReused:
                raise error_info(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"idempotency_key {key!r} was recorded for another request (other groups or "
                                 "config); nothing was recorded: send this one as a dry run or under a new key",
                                 "IDEMPOTENCY_KEY_REUSED", idempotency_key=key) from None
            if not recorded.replayed:
                self.stats.add_gate(recorded.result)
        response = reward_pb2.GateResponse.FromString(recorded.reply)
        response.replayed = recorded.replayed
        return response

    # Rank -------------------------------------------------------------------------------

    async def Rank(self, request: reward_pb2.RankRequest, context) -> reward_pb2.RankResponse:
        pairs = sum(len(group.trajectories) ** 2 for group in request.groups) // 2
        if pairs > OFFLOAD_ABOVE_PAIRS:
            response, method, rewards = await asyncio.to_thread(self.rank_now, request)
        else:
            response, method, rewards = self.rank_now(request)
        # Counted here, on the event loop, so a ranking on a worker thread never races another.
        self.stats.add_rank(method.value, rewards, histogram=method is ranking.Method.TOURNAMENT)
        return response

    def rank_now(self, request: reward_pb2.RankRequest):
        """(response, method, rewards per group); touches no shared state, so safe on any thread."""
        """Validate, score and answer (no shared state touched: safe on any thread)."""
        violations = Violations()
        params = rank_params(request.config, self.rank_defaults, violations)
        groups = rank_groups(request, self.config.max_group_size, self.config.max_task_id_bytes, violations)
        violations.raise_if_any()
        scored = [ranking.rank_group(group, params, request.config.include_matrix) for group in groups]
        response = reward_pb2.RankResponse(results=[
            reward_pb2.RankResult(task_id=group.task_id, trajectories=[trajectory_reward(t) for t in s.trajectories],
                                  outcome_matrix=s.matrix or ())
            for group, s in zip(request.groups, scored)
        ])
        return response, params.method, [[t.reward for t in s.trajectories] for s in scored]

    # History and stats --------------------------------------------------------------------

    async def GetTaskHistory(self, request: reward_pb2.GetTaskHistoryRequest, context):
        violations = Violations()
        for i, task_id in enumerate(request.task_ids):
            violations.check(bool(task_id), f"task_ids[{i}]", "must not be empty")
            check_task_id(task_id, f"task_ids[{i}]", self.config.max_task_id_bytes, violations)
        violations.raise_if_any()
        if request.task_ids:
            found = await asyncio.to_thread(self.history.records, request.task_ids)
            records = [found[task_id] for task_id in sorted(found)]
        else:
            records = await asyncio.to_thread(self.history.all_records)
        return reward_pb2.GetTaskHistoryResponse(histories=[task_history(item) for item in records])

    async def GetStats(self, request: reward_pb2.GetStatsRequest, context) -> reward_pb2.GetStatsResponse:
        s, gated = self.stats, self.stats.gated
        return reward_pb2.GetStatsResponse(
            groups_gated=gated.groups, simple=gated.simple, catastrophic=gated.catastrophic, expanded=gated.expanded,
            over_budget=gated.over_budget, expanded_share=gated.expanded_share,
            evaluations_saved=gated.evaluations_saved,
            decisions_by_reason=dict(s.decisions_by_reason), trajectories_ranked=s.trajectories_ranked,
            reward_histogram=reward_pb2.Histogram(edges=histogram_edges(), counts=s.reward_counts),
            groups_ranked=s.groups_ranked, trajectories_by_method=dict(s.trajectories_by_method),
        )


# Requests to plain values ---------------------------------------------------------------


def gate_params(config: reward_pb2.GateConfig, defaults: dcp.GateParams, violations: Violations) -> dcp.GateParams:
    changes: dict = {}
    if config.mode:
        if config.mode in GATE_MODES:
            changes["mode"] = GATE_MODES[config.mode]
        else:
            violations.add("config.mode", f"unknown gate mode {config.mode}")
    for name in ("simple_threshold", "expand_budget", "history_decay"):
        if config.HasField(name):
            changes[name] = getattr(config, name)
    if config.catastrophic_stage:
        if config.catastrophic_stage in STAGES:
            changes["catastrophic_stage"] = STAGES[config.catastrophic_stage]
        else:
            violations.add("config.catastrophic_stage", f"unknown stage {config.catastrophic_stage}")
    if config.never_solved_after:
        changes["never_solved_after"] = max(config.never_solved_after, 0)
    if config.max_turns:
        changes["max_turns"] = config.max_turns
    if config.improve_below_speedup:
        changes["improve_below_speedup"] = config.improve_below_speedup
    params = dataclasses.replace(defaults, **changes)
    for name, problem in params.problems():
        if name in changes:  # the service's own defaults were checked at start
            violations.add(f"config.{name}", problem)
    return params


def rank_params(config: reward_pb2.RankConfig, defaults: ranking.RankParams,
                violations: Violations) -> ranking.RankParams:
    changes: dict = {}
    if config.method:
        if config.method in METHODS:
            changes["method"] = METHODS[config.method]
        else:
            violations.add("config.method", f"unknown reward method {config.method}")
    for name in ("speedup_margin", "token_margin", "turn_discount", "failure_penalty"):
        if config.HasField(name):
            changes[name] = getattr(config, name)
    params = dataclasses.replace(defaults, **changes)
    for name, problem in params.problems():
        if name in changes:
            violations.add(f"config.{name}", problem)
    return params


def check_size(count: int, noun: str, path: str, max_size: int, violations: Violations) -> None:
    if count < 2:
        violations.add(path, f"a group needs at least two {noun}, got {count}")
    elif count > max_size:
        violations.add(path, f"a group may hold at most {max_size} {noun} (max_group_size), got {count}")


def check_task_id(task_id: str, path: str, max_bytes: int, violations: Violations) -> None:
    if len(task_id) * 4 > max_bytes and len(task_id.encode()) > max_bytes:  # encode only the long ones
        violations.add(path, f"must be at most {max_bytes} bytes (max_task_id_bytes), got {len(task_id.encode())}")


def request_fingerprint(request: reward_pb2.GateRequest) -> bytes:
    """What makes two recording Gate requests the same: their groups and config."""
    same = reward_pb2.GateRequest(groups=request.groups, config=request.config)
    return hashlib.sha256(same.SerializeToString(deterministic=True)).digest()


def valid_speedup(speedup: float) -> bool:
    """Unset reads as 0, which means not timed; NaN fails both comparisons."""
    return 0.0 <= speedup < math.inf


def speedup_interval(turn: reward_pb2.TurnResult) -> tuple[float, float] | None | bool:
    """The turn's speedup interval; None when it has none (either end unset, or no speedup);
    False when it is malformed."""
    if not (turn.HasField("speedup_low") or turn.HasField("speedup_high")):
        return None
    low, high = turn.speedup_low, turn.speedup_high
    if not (turn.HasField("speedup_low") and turn.HasField("speedup_high")) or not turn.speedup:
        return None
    if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= turn.speedup <= high):
        return False
    return low, high


def report_stage(stage: int, path: str, violations: Violations) -> None:
    name = common_pb2.Stage.Name(stage) if stage in common_pb2.Stage.values() else str(stage)
    violations.add(path, f"must be a stage from STAGE_FORMAT to STAGE_PASSED, got {name}")


def report_speedup(speedup: float, path: str, violations: Violations) -> None:
    violations.add(path, f"must be a finite number >= 0 (leave it unset when not timed), got {speedup!r}")


# The two loops below run for every rollout and turn of a batch, so they build field paths
# only for what is wrong.


def gate_groups(request: reward_pb2.GateRequest, max_size: int, max_id_bytes: int,
                violations: Violations) -> list[tuple[str, list[dcp.Rollout]]]:
    violations.check(len(request.groups) > 0, "groups", "at least one group is required")
    groups = []
    for g, group in enumerate(request.groups):
        violations.check(bool(group.task_id), f"groups[{g}].task_id", "is required")
        check_task_id(group.task_id, f"groups[{g}].task_id", max_id_bytes, violations)
        if not 2 <= len(group.rollouts) <= max_size:
            check_size(len(group.rollouts), "rollouts", f"groups[{g}].rollouts", max_size, violations)
        rollouts = []
        for r, rollout in enumerate(group.rollouts):
            stage, speedup = STAGES.get(rollout.stage), rollout.speedup
            if stage is None:
                report_stage(rollout.stage, f"groups[{g}].rollouts[{r}].stage", violations)
            if not valid_speedup(speedup):
                report_speedup(speedup, f"groups[{g}].rollouts[{r}].speedup", violations)
            rollouts.append(dcp.Rollout(stage or Stage.FORMAT, speedup or None))
        groups.append((group.task_id, rollouts))
    return groups


def rank_groups(request: reward_pb2.RankRequest, max_size: int, max_id_bytes: int,
                violations: Violations) -> list[list[list[ranking.Turn]]]:
    violations.check(len(request.groups) > 0, "groups", "at least one group is required")
    groups = []
    for g, group in enumerate(request.groups):
        check_task_id(group.task_id, f"groups[{g}].task_id", max_id_bytes, violations)
        if not 2 <= len(group.trajectories) <= max_size:
            check_size(len(group.trajectories), "trajectories", f"groups[{g}].trajectories", max_size, violations)
        trajectories = []
        for t, trajectory in enumerate(group.trajectories):
            turns = []
            for k, turn in enumerate(trajectory.turns):
                stage, speedup, tokens = STAGES.get(turn.stage), turn.speedup, turn.generated_tokens
                interval = speedup_interval(turn)
                if stage is None or tokens < 0 or not valid_speedup(speedup) or interval is False:
                    where = f"groups[{g}].trajectories[{t}].turns[{k}]"
                    if stage is None:
                        report_stage(turn.stage, f"{where}.stage", violations)
                    if not valid_speedup(speedup):
                        report_speedup(speedup, f"{where}.speedup", violations)
                    if tokens < 0:
                        violations.add(f"{where}.generated_tokens", f"must be >= 0, got {tokens}")
                    if interval is False:
                        violations.add(f"{where}.speedup_low", "with speedup_high: finite, 0 <= speedup_low <= speedup "
                                                               f"<= speedup_high, got {turn.speedup_low!r}, "
                                                               f"{turn.speedup!r}, {turn.speedup_high!r}")
                low, high = interval if interval else (None, None)
                turns.append(ranking.Turn(stage or Stage.FORMAT, speedup or None, tokens, low, high,
                                          turn.speedup_flagged))
            if not turns:
                violations.add(f"groups[{g}].trajectories[{t}].turns", "at least one turn is required")
            trajectories.append(turns)
        groups.append(trajectories)
    return groups


# Plain values to responses --------------------------------------------------------------


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def task_history(item: TaskRecord) -> reward_pb2.TaskHistory:
    return reward_pb2.TaskHistory(task_id=item.task_id, ema_pass_rate=item.ema_pass_rate, attempts=item.attempts,
                                  solves=item.solves, groups=item.groups, update_time=timestamp(item.update_time))


def gate_response(result: dcp.GateResult) -> reward_pb2.GateResponse:
    totals = result.totals
    return reward_pb2.GateResponse(
        decisions=[
            reward_pb2.GateDecision(
                task_id=d.task_id, decision=DECISIONS[d.decision], reason=d.reason, rule=d.rule,
                failures=d.failures, group_size=d.group_size,
                stage_histogram=[reward_pb2.StageCount(stage=int(stage), count=count)
                                 for stage, count in d.stage_histogram.items()],
                expand_rollouts=d.expand_rollouts, max_turns=d.max_turns, expected_value=d.expected_value,
                history=task_history(d.history),
            )
            for d in result.decisions
        ],
        summary=reward_pb2.GateSummary(
            groups=totals.groups, simple=totals.simple, catastrophic=totals.catastrophic, expanded=totals.expanded,
            over_budget=totals.over_budget, expanded_share=totals.expanded_share,
            evaluations_saved=totals.evaluations_saved,
        ),
    )


def trajectory_reward(score: ranking.TrajectoryScore) -> reward_pb2.TrajectoryReward:
    return reward_pb2.TrajectoryReward(reward=score.reward, advantage=score.advantage, wins=score.wins,
                                       losses=score.losses, ties=score.ties, turn_advantages=score.turn_advantages)


def build(config: RewardConfig) -> Service:
    history = HistoryStore(config.history_path or None, fsync=config.history_fsync,
                           max_tasks=config.max_history_tasks, max_keys=config.max_gate_keys,
                           key_ttl_seconds=config.gate_key_ttl_seconds,
                           lock_timeout_seconds=config.history_lock_timeout_seconds)
    servicer = RewardServicer(config, history)
    log = get_logger("leap.reward")

    async def on_start() -> None:
        log.info("task history opened", path=history.where, tasks=history.task_count(), keys=history.key_count())

    async def on_stop() -> None:
        history.close()

    return Service(
        name="reward",
        registrations=[Registration(SERVICE_NAME, reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer,
                                    request_limits=REQUEST_LIMITS)],
        on_start=on_start,
        on_stop=on_stop,
    )


SPEC = ServiceSpec(name="reward", config_class=RewardConfig, build=build,
                   description="Difficulty-Conditioned Pruning and tournament rank rewards.")
