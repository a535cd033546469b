"""The LEAP loop: one training run of the trainer service, driven over gRPC.

Per step (DESIGN.md "The LEAP step"):

    tasks    <- the next B training tasks (seeded cursor, saved in checkpoints)
    for every task at once (asyncio; the policy batches concurrent generations and the
    sandbox judges finished groups while others still generate):
        G first turns -> judged -> Gate (per group; one call for all in adaptive mode)
        expanded: failing (or improvable) rollouts get feedback turns, up to K in all
    Rank every group's whole trajectories -> per-turn advantages
    learner: old logprobs recomputed, GRPO passes, optimizer step
    UpdateWeights to the policy (a new version), so the next step samples on-policy

Held-out evaluation runs before the first step, every `eval_every` steps and after the
last. Checkpoints hold the learner (weights, optimizer, schedule, RNG), the task cursor and
the running totals. A stopped or failed run checkpoints its last completed step and resumes
after it; a killed one resumes from its last checkpoint and plays the steps after it again,
with the same seeds and so the same samples. A service that stops answering is retried (`service_retry_seconds`), then the run
fails with the cause after checkpointing its last completed step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import json
import pickle
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from leap.clients import connect
from leap.clients.retry import Patience, ServiceUnavailable, refusal, with_retries
from leap.clients.transports import WeightPusher
from leap.evaluation import evaluate
from leap.learning import checkpoint as ckpt
from leap.learning import Learner, LearnerSettings, NonFiniteError, OptimizerSettings, with_values
from leap.learning.data import draw_tasks
from leap.learning.lora import LoraSettings
from leap.learning.metrics import DEFAULT_PANELS, plot_metrics
from leap.learning.registry import RunContext, RunFailure
from leap.policy.v1 import policy_pb2
from leap.reward.v1 import reward_pb2
from leap.rollouts import Endpoints, Episode, Rollouts, derive_seed
from leap.runtime.errors import error_reasons
from leap.sandbox.v1 import sandbox_pb2
from leap.tokenization import tokenizer_fingerprint
from leap.trainer.v1 import trainer_pb2
from leap.union import UNION_FILE, Teacher, TeacherUnion, toolchain_name
from svc_trainer import batch as batching
from svc_trainer import rgrpo
from svc_trainer.config import timed
from svc_trainer.losses import SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN, GrpoLossConfig, GrpoObjective
from svc_trainer.metrics import rollout_metrics, zero_spread_share

TrainMode = trainer_pb2.TrainMode
GateMode = reward_pb2.GateMode
Decision = reward_pb2.Decision
UNION_DIR = "union"
MERGED_DIR = "merged"  # a LoRA run's base + adapter, with lora.save_merged  # the teacher union of an RGRPO run, inside its output directory
DEFAULT_IMPORTANCE_CAP = 2.0  # C of the truncated importance ratio (the TIS paper's)
GENERATE_DEADLINE_SECONDS = 1800.0  # a big batch on a CPU is slow; a dead service is caught by health, not by this


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What a job takes from the trainer service's settings."""

    device: str = "auto"
    service_retry_seconds: float = 60.0
    keep_checkpoints: int = 3
    rollout_log: str = "text"  # "off", "text" (answers, verdicts, rewards) or "tokens" (and token ids)
    weight_transport: str = "auto"  # leap.clients.transports: auto, shm, distributed or stream
    no_signal_warning_steps: int = 3  # warn after this many steps in a row where every group tied; 0: never


@dataclasses.dataclass
class Group:
    """One task's rollouts in a step."""

    task: sandbox_pb2.Task
    episodes: list[Episode]
    decision: reward_pb2.GateDecision | None = None  # None in single-turn mode

    @property
    def expanded(self) -> bool:
        return self.decision is not None and self.decision.decision == Decision.DECISION_EXPAND


@dataclasses.dataclass
class StepBatch:
    """One step's judged and ranked rollouts, waiting for the learner (asynchronous runs keep
    up to max_staleness of them ahead, and checkpoints hold them)."""

    step: int
    groups: list[Group]
    ranked: reward_pb2.RankResponse
    values: dict[str, float]  # the rollout metrics of the step
    cursor: int  # the task cursor after this step's draw
    sampled_after: int  # learner updates done when the weights that sampled it were pushed

    def staleness(self, updates: int) -> int:
        """Learner updates between the weights that sampled it and a learner at `updates`."""
        return updates - self.sampled_after


PENDING_FILE = "pending.pkl"  # a checkpoint's batches generated ahead of the learner (asynchronous runs)


class StaleRollouts(Exception):
    """Some answers of a step came from other weights than the ones being trained."""


class Services:
    """Stubs of the three services a run talks to."""

    def __init__(self, addresses: trainer_pb2.ServiceAddresses, patience: Patience):
        self.addresses = addresses
        self.patience = patience
        self.policy = connect("policy", addresses.policy, unary_deadline=GENERATE_DEADLINE_SECONDS)
        self.sandbox = connect("sandbox", addresses.sandbox)
        self.reward = connect("reward", addresses.reward)

    async def call(self, service: str, method: str, request):
        stub = getattr(self, service)
        return await with_retries(lambda: getattr(stub, method)(request), service, getattr(self.addresses, service),
                                  self.patience, method)

    async def close(self) -> None:
        for stub in (self.policy, self.sandbox, self.reward):
            await stub.channel.close()


def decisions_of(reply: reward_pb2.GateResponse, groups: int) -> Sequence[reward_pb2.GateDecision]:
    """The reply's decisions, one per group asked about, or RunFailure."""
    if len(reply.decisions) != groups:
        raise RunFailure(f"the reward service answered {len(reply.decisions)} Gate decisions for {groups} groups")
    return reply.decisions


def gate_key(run_id: str, step: int, group: int | None = None) -> str:
    """The idempotency key of a step's Gate call (one per group, or one for the step in
    adaptive mode): the same on every attempt of the step, so a step played again after a
    kill or a resume is not counted twice in the reward service's task history."""
    return f"trainer/{run_id}/step-{step}" + ("" if group is None else f"/group-{group}")


class GroupGate:
    """Gates each group as soon as its first turns are judged: one Gate call per group, or,
    in adaptive mode, one call for the whole step (the expansion budget is per call). Each
    call carries an idempotency key of (run, step, group): a replayed step gets the stored
    decisions of its first attempt (the same decisions, when its rollouts are the same, which
    seeded sampling makes them), and one whose rollouts differ (a policy that restarted with
    other weights) is decided as a dry run, since its first attempt already counted."""

    def __init__(self, services: Services, config: reward_pb2.GateConfig, groups: int, run_id: str = "", step: int = 0):
        self.services = services
        self.config = config
        self.batched = config.mode == GateMode.GATE_MODE_ADAPTIVE
        self.expected = groups
        self.run_id = run_id
        self.step = step
        self.arrived: dict[int, reward_pb2.GateGroup] = {}
        self.futures: dict[int, asyncio.Future] = {}
        self.summaries: list[reward_pb2.GateSummary] = []

    async def call(self, groups: Sequence[reward_pb2.GateGroup], index: int | None) -> reward_pb2.GateResponse:
        key = gate_key(self.run_id, self.step, index) if self.run_id else ""
        request = reward_pb2.GateRequest(groups=groups, config=self.config, idempotency_key=key)
        try:
            reply = await self.services.call("reward", "Gate", request)
        except grpc.aio.AioRpcError as err:
            if not (key and err.code() == grpc.StatusCode.FAILED_PRECONDITION and "IDEMPOTENCY_KEY_REUSED" in error_reasons(err)):
                raise
            request.ClearField("idempotency_key")
            request.dry_run = True
            reply = await self.services.call("reward", "Gate", request)
        self.summaries.append(reply.summary)  # a replay's too: the killed attempt never reported its step
        return reply

    async def decide(self, index: int, group: reward_pb2.GateGroup) -> reward_pb2.GateDecision:
        if not self.batched:
            return decisions_of(await self.call([group], index), 1)[0]
        self.arrived[index] = group
        self.futures[index] = asyncio.get_running_loop().create_future()
        if len(self.arrived) == self.expected:
            order = sorted(self.arrived)
            try:
                reply = await self.call([self.arrived[i] for i in order], None)
                decisions = decisions_of(reply, len(order))
            except BaseException as err:
                for i in order:  # the other groups' waits fail too; this one raises it itself
                    if i != index and not self.futures[i].done():
                        self.futures[i].set_exception(err)
                raise
            for i, decision in zip(order, decisions):
                self.futures[i].set_result(decision)
        return await self.futures[index]

    def evaluations_saved(self) -> int:
        return sum(s.evaluations_saved for s in self.summaries)


@dataclasses.dataclass
class Session:
    """A learner with the policy serving its weights, and the run's tasks."""

    services: Services
    learner: Learner
    info: policy_pb2.ModelInfo  # the policy's description of the model it serves for the run
    rollouts: Rollouts
    tasks: list[sandbox_pb2.Task]  # training tasks
    held_out: list[sandbox_pb2.Task]
    learning: bool = False  # inside an update: the learner's state is no step's (no checkpoint then)


@dataclasses.dataclass
class Progress:
    """What a checkpoint carries besides the learner."""

    step: int = 0
    cursor: int = 0  # training tasks drawn so far
    evaluations: int = 0  # sandbox evaluations of training rollouts so far
    train_seconds: float = 0.0  # wall seconds of training steps so far (evaluation excluded)
    flat_steps: int = 0  # steps in a row, up to this one, where every group tied (no learning signal)

    def to_json(self) -> dict:
        return {"cursor": self.cursor, "evaluations": self.evaluations, "train_seconds": self.train_seconds,
                "flat_steps": self.flat_steps}

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        extra = state.get("extra", {})
        return cls(step=int(state["step"]), cursor=int(state["cursor"].get("tasks", 0)),
                   evaluations=int(extra.get("evaluations", 0)), train_seconds=float(extra.get("train_seconds", 0.0)),
                   flat_steps=int(extra.get("flat_steps", 0)))


class TrainingJob:
    """One run (see the module docstring); the registry calls it in a worker thread.

    Learner steps (and the copies of the weights pushed after them) run on one thread of
    their own, the job's `learner_thread`, in the synchronous loop as in the asynchronous
    one: torch's CPU build runs each op's parallel region on an OpenMP team that belongs to
    the thread calling it, so a learner entered from one thread keeps one team, which the
    rollouts of the next step (on the event loop) never share. Measured by benchmarks/bench_learner_threads.py."""

    def __init__(self, config: trainer_pb2.RunConfig, settings: JobSettings):
        self.config = config
        self.settings = settings
        self.patience = Patience(seconds=settings.service_retry_seconds)
        self.version = 0  # weight version the policy serves for this run
        self.pusher: WeightPusher | None = None
        self.pushed: dict | None = None  # asynchronous runs: the weights the policy serves (to send again)
        self.pushed_bytes = 0.0
        self.served_lora = None  # the policy's adapter (ModelInfo.lora) when it serves one: push it alone
        self.notes: list[str] = []  # said once in the run's log
        self.learner_thread: concurrent.futures.ThreadPoolExecutor | None = None  # while the run runs

    def __call__(self, ctx: RunContext) -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner") as pool:
            self.learner_thread = pool
            try:
                asyncio.run(self.main(ctx))
            except ServiceUnavailable as err:
                raise RunFailure(str(err)) from err
            except grpc.RpcError as err:  # a service refused a call: say which, what and why, not the error's repr
                raise RunFailure(refusal(err)) from err
            finally:
                self.learner_thread = None

    def on_learner(self, fn, *args, **kwargs) -> asyncio.Future:
        """`fn(*args, **kwargs)` on the learner's thread (see the class docstring), awaitable."""
        if self.learner_thread is None:
            raise RuntimeError("the job's learner thread runs only while the job does (TrainingJob.__call__)")
        return asyncio.get_running_loop().run_in_executor(self.learner_thread, functools.partial(fn, *args, **kwargs))

    # --- the run ----------------------------------------------------------------------------

    def learner_settings(self) -> LearnerSettings:
        c = self.config
        optimizer = OptimizerSettings.from_proto(c.optimizer)
        steps = c.rgrpo.steps_per_round if c.rgrpo.rounds else c.steps  # one learner per RGRPO round
        return LearnerSettings(model_path=c.model_path, optimizer=optimizer,
                               total_updates=steps * optimizer.epochs_per_batch, temperature=c.sampling.temperature,
                               reference=c.loss.kl_beta > 0, device=self.settings.device, seed=c.seed,
                               lora=LoraSettings.from_proto(c.lora))

    async def main(self, ctx: RunContext) -> None:
        services = Services(self.config.services, self.patience)
        self.pusher = WeightPusher(services.policy, self.config.policy_model, self.settings.weight_transport,
                                   timeout=GENERATE_DEADLINE_SECONDS)
        try:
            tasks = await self.fetch_tasks(services, self.config.train_tasks)
            held_out = await self.fetch_tasks(services, self.config.eval_tasks)
            if self.config.rgrpo.rounds:
                finished = await self.train_rounds(ctx, services, tasks, held_out)
            else:
                finished = await self.train_plain(ctx, services, tasks, held_out)
        finally:
            await self.pusher.close()
            await services.close()
        if finished:
            self.plot(ctx)

    async def train_plain(self, ctx: RunContext, services: Services, tasks: list[sandbox_pb2.Task],
                          held_out: list[sandbox_pb2.Task]) -> bool:
        """A plain run: one learner, tasks drawn epoch by epoch. False when stopped early."""
        c = self.config
        ids = [t.id for t in tasks]

        def draw(step: int, progress: Progress) -> tuple[list[str], int]:
            return draw_tasks(ids, c.tasks_per_step, progress.cursor, c.seed)

        with Learner(self.learner_settings()) as learner:
            at = ctx.latest_checkpoint()
            progress = Progress.from_state(learner.load_checkpoint(at.path)) if at else Progress()
            session = await self.open_session(services, learner, tasks, held_out, ctx)
            if progress.step == 0:
                await self.evaluate(ctx, session, progress)
            if c.max_staleness:
                finished = await self.train_steps_ahead(ctx, session, progress, c.steps, draw, at.path if at else None)
            else:
                finished = await self.train_steps(ctx, session, progress, c.steps, draw)
            if finished and c.lora.save_merged:  # base + adapter, loadable with from_pretrained
                learner.save_model(str(ctx.output_dir / MERGED_DIR))
                ctx.emit("log", progress.step, {}, f"merged model written to {ctx.output_dir / MERGED_DIR}")
            return finished

    async def train_rounds(self, ctx: RunContext, services: Services, tasks: list[sandbox_pb2.Task],
                           held_out: list[sandbox_pb2.Task]) -> bool:
        """RGRPO: R rounds, each a fresh learner from the initial weights whose batches favour
        the tasks the union does not cover yet; each round ends with a teacher in the union.
        False when stopped early."""
        c = self.config
        per_round = c.rgrpo.steps_per_round
        union = self.union_so_far(ctx)
        at = ctx.latest_checkpoint()
        first = rgrpo.round_of(at.step, per_round) if at else 1
        if at and at.step == first * per_round and union and len(union.teachers) >= first:
            first += 1  # that round's teacher is in the union already
        totals = Progress.from_state(ckpt.read_state(at.path)) if at else Progress()
        for round_ in range(first, c.rgrpo.rounds + 1):
            ctx.progress(round=round_)
            with Learner(self.learner_settings()) as learner:  # the same initial weights every round
                progress = dataclasses.replace(totals, step=(round_ - 1) * per_round)
                if at and rgrpo.round_of(at.step, per_round) == round_:  # resume inside the round (or at its end)
                    progress = Progress.from_state(learner.load_checkpoint(at.path))
                session = await self.open_session(services, learner, tasks, held_out, ctx)
                if progress.step == 0:
                    await self.evaluate(ctx, session, progress)
                rows = union.quality[:round_ - 1] if union else ()
                weights = rgrpo.round_weights(len(tasks), rows, c.rgrpo.tau, c.rgrpo.alpha)
                ids = [t.id for t in tasks]

                def draw(step: int, progress: Progress) -> tuple[list[str], int]:
                    seed = derive_seed(c.seed, "rgrpo", step)
                    return rgrpo.weighted_draw(ids, weights, c.tasks_per_step, seed), progress.cursor

                if not await self.train_steps(ctx, session, progress, round_ * per_round, draw):
                    return False
                union = await self.add_teacher(ctx, session, round_, union)
                totals = progress
            if ctx.stop_requested() and round_ < c.rgrpo.rounds:
                return False  # stopped at a round's end: its teacher is in the union, the next round starts fresh
        return True

    async def open_session(self, services: Services, learner: Learner, tasks: list[sandbox_pb2.Task],
                           held_out: list[sandbox_pb2.Task], ctx: RunContext | None = None) -> Session:
        info = await self.serve_learner(services, learner)
        if ctx is not None:
            for note in self.notes:
                ctx.emit("log", 0, {}, note)
        self.notes.clear()
        return Session(services, learner, info, self.rollouts(services, learner, info), tasks, held_out)

    async def train_steps(self, ctx: RunContext, session: Session, progress: Progress, last: int, draw) -> bool:
        """Steps progress.step + 1 .. last, each on the tasks `draw(step, progress)` names
        (with the task cursor after them); evaluation every eval_every steps and at `last`;
        checkpoints every checkpoint_every steps, at `last` and on a stop request. False when
        a stop request ended it before `last`."""
        c = self.config
        by_id = {t.id: t for t in session.tasks}
        saved = progress.step
        try:
            if progress.step and self.evaluation_due(progress.step, last) and not self.evaluated(ctx, progress.step):
                await self.evaluate(ctx, session, progress)  # the run failed or was killed during this evaluation
            for step in range(progress.step + 1, last + 1):
                started = time.perf_counter()
                names, cursor = draw(step, progress)
                values = await self.step_on_policy(ctx, step, [by_id[n] for n in names], session)
                progress.step, progress.cursor = step, cursor  # the learner holds this step's update now
                progress.evaluations += int(values["sandbox/evaluations"])
                values["time/sync_s"] = await self.push(session.services, session.learner)
                values["weight_version"] = float(self.version)
                values["time/step_s"] = time.perf_counter() - started
                progress.train_seconds += values["time/step_s"]
                values.update({"sandbox/evaluations_total": progress.evaluations, "time/train_total_s": progress.train_seconds})
                ctx.emit("train", step, values)
                self.watch_signal(ctx, step, values["reward/zero_spread_share"], progress)
                if self.evaluation_due(step, last):
                    await self.evaluate(ctx, session, progress)
                if step % c.checkpoint_every == 0 or step == last or ctx.stop_requested():
                    saved = self.save(ctx, session.learner, progress)
                if ctx.stop_requested() and step < last:
                    return False
        except BaseException:
            if progress.step > saved and not session.learning:  # keep the steps done: the run resumes after them
                self.save(ctx, session.learner, progress)
            raise
        return True

    async def train_steps_ahead(self, ctx: RunContext, session: Session, progress: Progress, last: int, draw,
                                checkpoint: Path | None) -> bool:
        """The asynchronous loop (max_staleness = k >= 1): while the learner trains step s, the
        rollouts of step s + k are generated and judged on the weights after update s - 1 (the
        ones the policy serves), so a batch is sampled exactly min(k, s - 1) updates behind
        the learner that trains it: a fixed lag, hence the same samples in every run with the
        same seeds. A checkpoint after step s holds the batches s + 1 .. s + k already made,
        so a resumed run trains exactly what an uninterrupted one would. False when a stop
        request ended it before `last`."""
        c = self.config
        lag = c.max_staleness
        by_id = {t.id: t for t in session.tasks}
        pending: collections.deque[StepBatch] = collections.deque()
        if checkpoint is not None and (checkpoint / PENDING_FILE).is_file():
            pending.extend(pickle.loads((checkpoint / PENDING_FILE).read_bytes()))
        saved = progress.step
        cursor = pending[-1].cursor if pending else progress.cursor  # where the next draw starts
        self.pushed = await self.on_learner(session.learner.push_state, self.served_lora)  # what open_session pushed
        consistent = True  # False while a step's generation and learning are under way

        async def generate(step: int) -> StepBatch:
            nonlocal cursor
            names, after = draw(step, dataclasses.replace(progress, cursor=cursor))
            tasks = [by_id[n] for n in names]
            for attempt in range(1, 4):
                try:
                    await self.keep_on_policy(ctx, step, session)
                    groups, ranked, values = await self.rollout(ctx, step, tasks, session)
                    break
                except StaleRollouts as err:
                    if attempt == 3:
                        raise RunFailure(f"step {step}: {err}, 3 times") from None
                    ctx.emit("log", step - 1, {}, f"the rollouts of step {step} played again: {err}")
            cursor = after
            return StepBatch(step, list(groups), ranked, values, after, progress.step)

        try:
            if progress.step and self.evaluation_due(progress.step, last) and not self.evaluated(ctx, progress.step):
                await self.evaluate(ctx, session, progress)
            while len(pending) < lag and progress.step + len(pending) < last:  # the first batches, before any learning
                pending.append(await generate(progress.step + len(pending) + 1))
            for step in range(progress.step + 1, last + 1):
                started = time.perf_counter()
                batch = pending.popleft()
                assert batch.step == step, (batch.step, step)
                staleness = batch.staleness(progress.step)
                consistent = False
                ahead = step + lag
                learning = self.on_learner(self.learn_batch, batch, session.learner, staleness)
                try:
                    if ahead <= last:
                        pending.append(await generate(ahead))
                finally:
                    learned = await asyncio.gather(learning, return_exceptions=True)  # never leave the learner running
                if isinstance(learned[0], BaseException):
                    raise learned[0]
                values = {**batch.values, **learned[0]}
                progress.step, progress.cursor = step, cursor
                progress.evaluations += int(values["sandbox/evaluations"])
                consistent = True  # the learner holds step s; the batches after it are made
                values["time/sync_s"] = await self.push(session.services, session.learner)
                values.update({"weight_version": float(self.version), "weights/bytes": self.pushed_bytes,
                               "time/step_s": time.perf_counter() - started})
                progress.train_seconds += values["time/step_s"]
                values.update({"sandbox/evaluations_total": progress.evaluations,
                               "time/train_total_s": progress.train_seconds})
                ctx.emit("train", step, values)
                self.watch_signal(ctx, step, values["reward/zero_spread_share"], progress)
                if self.evaluation_due(step, last):
                    await self.evaluate(ctx, session, progress)
                if step % c.checkpoint_every == 0 or step == last or ctx.stop_requested():
                    saved = self.save(ctx, session.learner, progress, pending)
                if ctx.stop_requested() and step < last:
                    return False
        except BaseException:
            # Only at a step's boundary is the state one a resumed run can continue exactly from.
            if consistent and progress.step > saved:
                self.save(ctx, session.learner, progress, pending)
            raise
        return True

    def learn_batch(self, batch: StepBatch, learner: Learner, staleness: int) -> dict[str, float]:
        """A batch's learner step (on the learner's thread, beside the next generation), unless its
        rollouts are older than the bound: then it is dropped and counted."""
        if staleness > self.config.max_staleness:
            dropped = float(sum(len(g.episodes) for g in batch.groups))
            return {"async/staleness": float(staleness), "async/dropped_rollouts": dropped,
                    "sequences/rolled_out": dropped, "sequences/trained": 0.0}
        try:
            values = self.learn(batch.groups, batch.ranked, learner, staleness)
        except NonFiniteError as err:  # nothing of this update is pushed or checkpointed
            raise RunFailure(err.sentence(batch.step, self.config.optimizer)) from None
        return {**values, "async/staleness": float(staleness), "async/dropped_rollouts": 0.0}

    def watch_signal(self, ctx: RunContext, step: int, zero_spread: float, progress: Progress) -> None:
        """A `warning` event (and a log line) when every group of the last N steps tied: the
        run trains on nothing. The run goes on: the warning says so, it does not decide. The
        streak is in the checkpoint, so a resumed run counts on."""
        flat = progress.flat_steps = progress.flat_steps + 1 if zero_spread >= 1.0 else 0
        every = self.settings.no_signal_warning_steps
        if every <= 0 or flat == 0 or flat % every:
            return
        message = (f"no learning signal: every group's rewards tied for the last {flat} steps (steps "
                   f"{step - flat + 1}-{step}), so no update moved the weights. The model may never pass (or always "
                   "pass) these tasks; check the rollouts log, the tasks, or warm-start the model")
        ctx.log.warning("no learning signal", step=step, steps=flat)
        ctx.emit("warning", step, {"reward/zero_spread_share": zero_spread, "steps": float(flat)}, message)

    def evaluation_due(self, step: int, last: int) -> bool:
        return bool(self.config.eval_every and step % self.config.eval_every == 0) or step == last

    @staticmethod
    def evaluated(ctx: RunContext, step: int) -> bool:
        return any(e["kind"] == "eval" and e["step"] == step for e in ctx.events(step))

    async def step_on_policy(self, ctx: RunContext, step: int, tasks: list[sandbox_pb2.Task], session: Session,
                             attempts: int = 3) -> dict[str, float]:
        """One step whose rollouts all come from the weights being trained: when some came from
        other weights (the policy restarted during the step), the step is played again."""
        for attempt in range(1, attempts + 1):
            try:
                return await self.step(ctx, step, tasks, session)
            except StaleRollouts as err:
                if attempt == attempts:
                    raise RunFailure(f"step {step}: {err}, {attempts} times") from None
                ctx.emit("log", step - 1, {}, f"step {step} played again: {err}")
        raise AssertionError("unreachable")

    def save(self, ctx: RunContext, learner: Learner, progress: Progress,
             pending: Sequence[StepBatch] | None = None) -> int:
        files = {PENDING_FILE: pickle.dumps(list(pending))} if pending is not None else None
        info = learner.save_checkpoint(ctx.checkpoint_dir, progress.step, cursor={"tasks": progress.cursor},
                                       extra=progress.to_json(), keep_last=self.settings.keep_checkpoints, files=files)
        ctx.checkpoint_saved(info)
        return progress.step

    def plot(self, ctx: RunContext) -> None:
        panels = DEFAULT_PANELS + ([("union coverage (RGRPO)", [("eval", "rgrpo/coverage")])] if self.config.rgrpo.rounds else [])
        path = plot_metrics(ctx.events(), ctx.output_dir / "metrics.png", title=self.config.display_name or ctx.run_id,
                            panels=panels)
        if path is not None:
            ctx.emit("log", ctx.total_steps, {}, f"plot written to {path}")

    async def fetch_tasks(self, services: Services, task_ids: Sequence[str]) -> list[sandbox_pb2.Task]:
        replies = await asyncio.gather(*(services.call("sandbox", "GetTask", sandbox_pb2.GetTaskRequest(task_id=t))
                                         for t in task_ids))
        return [reply.task for reply in replies]

    # --- the policy serves what the learner trains -------------------------------------------

    async def serve_learner(self, services: Services, learner: Learner) -> policy_pb2.ModelInfo:
        """Make the policy serve the learner's current weights under the run's model name
        (loading the model first where the service does not have it), with a new version."""
        name = self.config.policy_model
        info = await self.served_model(services)
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != tokenizer_fingerprint(learner.tokenizer):
            raise RunFailure(f"the policy serves {name!r} from {info.path!r}, whose tokenizer differs from the one of "
                             f"model_path {self.config.model_path!r}: the run would train on tokens it did not sample")
        self.version = info.version
        self.served_lora = info.lora if info.lora.rank else None
        if learner.settings.lora is not None and self.served_lora is None:
            log_line = (f"the policy serves {name!r} without a LoRA adapter: every step sends the merged weights "
                        f"(load it with the run's lora to send the adapter alone)")
            self.notes.append(log_line)
        await self.push(services, learner)
        return info

    async def served_model(self, services: Services) -> policy_pb2.ModelInfo:
        """The policy's description of the run's model, loading `model_path` under its name
        where the service does not have it (a fresh or restarted service)."""
        name = self.config.policy_model
        try:
            return (await services.call("policy", "GetModel", policy_pb2.GetModelRequest(name=name))).model
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
        request = policy_pb2.LoadModelRequest(name=name, path=self.config.model_path,
                                              lora=self.config.lora if self.config.lora.rank else None)
        return (await services.call("policy", "LoadModel", request)).model

    async def keep_on_policy(self, ctx: RunContext, step: int, session: Session) -> None:
        """Before a step samples: if the policy does not serve the version this run pushed
        last (it restarted, or something else updated the model), send the learner's weights
        again, so the step's rollouts come from the weights being trained."""
        info = await self.served_model(session.services)
        if info.version != self.version:
            ctx.emit("log", step - 1, {}, f"the policy serves {self.config.policy_model!r} version {info.version}, not "
                                          f"{self.version}: sending the learner's weights again")
            self.version = info.version
            await self.push(session.services, session.learner, self.pushed)

    async def push(self, services: Services, learner: Learner, state: dict | None = None) -> float:
        """Send the learner's weights (or `state`, weights pushed before) as the next version
        by the best transport the policy takes; returns the seconds it took."""
        started = time.perf_counter()
        state = state if state is not None else await self.on_learner(learner.push_state, self.served_lora)
        self.version += 1
        reply = await with_retries(lambda: self.pusher.push(self.version, state), "policy", services.addresses.policy,
                                   self.patience, "the weight update")
        self.version = reply.version
        self.pushed_bytes = float(reply.bytes)
        if self.config.max_staleness:
            self.pushed = state  # a policy that restarts mid-step is sent the weights its rollouts need
        return time.perf_counter() - started

    def rollouts(self, services: Services, learner: Learner, info: policy_pb2.ModelInfo) -> Rollouts:
        options = sandbox_pb2.EvaluateOptions(size=self.config.sandbox_size)
        if not timed(self.config):
            options.timing = False  # correctness only: no speedup, no timing flag
        return Rollouts(Endpoints(services.policy, services.sandbox, services.addresses.policy, services.addresses.sandbox),
                        learner.tokenizer, model=self.config.policy_model, toolchain=self.config.toolchain,
                        sampling=self.config.sampling, options=options, max_context_tokens=info.max_context_tokens,
                        patience=self.patience, flagged_as_failure=self.config.flagged_verdicts ==
                        trainer_pb2.FlaggedVerdicts.FLAGGED_VERDICTS_AS_FAILURE)

    # --- one step ---------------------------------------------------------------------------

    async def step(self, ctx: RunContext, step: int, tasks: list[sandbox_pb2.Task], session: Session) -> dict[str, float]:
        groups, ranked, values = await self.rollout(ctx, step, tasks, session)
        session.learning = True  # from here until the update lands, the learner holds no step's state
        try:
            values.update(await self.on_learner(self.learn, groups, ranked, session.learner))
        except NonFiniteError as err:  # nothing of this update is pushed or checkpointed
            raise RunFailure(err.sentence(step, self.config.optimizer)) from None
        session.learning = False
        return values

    async def rollout(self, ctx: RunContext, step: int, tasks: list[sandbox_pb2.Task], session: Session
                      ) -> tuple[list[Group], reward_pb2.RankResponse, dict[str, float]]:
        """The step's groups played on the weights the policy serves (version self.version),
        ranked and logged, with their metrics."""
        services, rollouts = session.services, session.rollouts
        started = time.perf_counter()
        await self.keep_on_policy(ctx, step, session)
        rollouts.generate_clock.take()  # count this step's busy time only
        rollouts.evaluate_clock.take()
        evaluations = rollouts.evaluations
        gate = GroupGate(services, self.config.gate, len(tasks), ctx.run_id, step)
        groups = await asyncio.gather(*(self.play_group(step, i, task, rollouts, gate) for i, task in enumerate(tasks)))
        stale = sum(t.weight_version != self.version for g in groups for e in g.episodes for t in e.turns)
        if stale:
            raise StaleRollouts(f"{stale} answers came from other weights than version {self.version}")
        ranked = await services.call("reward", "Rank", reward_pb2.RankRequest(
            groups=[batching.rank_group(g.task.id, g.episodes) for g in groups], config=self.config.rank))
        rollout_seconds = time.perf_counter() - started
        self.log_rollouts(ctx, step, groups, ranked)
        values = rollout_metrics([e.outcomes() for g in groups for e in g.episodes], [g.expanded for g in groups],
                                 self.config.max_turns, timed(self.config))
        values["sandbox/evaluations"] = float(rollouts.evaluations - evaluations)
        values["sandbox/evaluations_saved"] = float(gate.evaluations_saved())
        values.update(self.reward_stats(ranked))
        values["reward/zero_spread_share"] = zero_spread_share([[t.reward for t in r.trajectories] for r in ranked.results])
        values.update({
            "time/generate_s": rollouts.generate_clock.take(), "time/evaluate_s": rollouts.evaluate_clock.take(),
            "time/rollout_s": rollout_seconds,
            "tokens/generated": float(sum(len(t.completion_ids) for g in groups for e in g.episodes for t in e.turns)),
        })
        return groups, ranked, values

    async def play_group(self, step: int, index: int, task: sandbox_pb2.Task, rollouts: Rollouts,
                         gate: GroupGate) -> Group:
        """G first turns, the gate's decision, then feedback turns for expanded rollouts."""
        c = self.config
        seed = derive_seed(c.seed, "train", step, index)
        group = Group(task, await rollouts.first_turns(task, c.group_size, derive_seed(seed, 1)))
        if c.max_turns <= 1:
            return group
        group.decision = await gate.decide(index, batching.gate_group(task.id, group.episodes))
        if not group.expanded:
            return group
        chosen = [group.episodes[i] for i in group.decision.expand_rollouts]
        for turn in range(2, group.decision.max_turns + 1):
            active = [e for e in chosen if batching.continues(e, c.gate.improve_below_speedup) and not e.out_of_context]
            if not active:
                break
            await rollouts.next_turns(active, derive_seed(seed, turn))
        return group

    @staticmethod
    def log_evaluation(ctx: RunContext, step: int, per_task: dict[str, dict[str, list[float]]]) -> None:
        """`evals/step-NNNNNNNN.json` in the run's directory: each task's pass@1 by turn at the
        evaluation after `step` ("held_out/" and "train_tasks/" task sets), so two evaluations
        can be compared task by task (a paired difference has a far smaller error than two
        means)."""
        directory = ctx.output_dir / "evals"
        directory.mkdir(parents=True, exist_ok=True)
        temp = directory / f".step-{step:08d}.json.tmp"
        temp.write_text(json.dumps({"step": step, "pass_at_1_by_turn": per_task}, sort_keys=True) + "\n")
        temp.replace(directory / f"step-{step:08d}.json")

    def log_rollouts(self, ctx: RunContext, step: int, groups: Sequence[Group], ranked: reward_pb2.RankResponse) -> None:
        """`rollouts/step-NNNNNNNN.jsonl` in the run's directory: what the model wrote and how it fared."""
        if self.settings.rollout_log == "off":
            return
        records = batching.rollout_records(step, [(g.task.id, g.episodes) for g in groups], ranked,
                                           tokens=self.settings.rollout_log == "tokens")
        directory = ctx.output_dir / "rollouts"
        directory.mkdir(parents=True, exist_ok=True)
        temp = directory / f".step-{step:08d}.jsonl.tmp"
        temp.write_text("".join(json.dumps(r) + "\n" for r in records))
        temp.replace(directory / f"step-{step:08d}.jsonl")

    @staticmethod
    def reward_stats(ranked: reward_pb2.RankResponse) -> dict[str, float]:
        rewards = [t.reward for result in ranked.results for t in result.trajectories]
        return {"reward_mean": statistics.fmean(rewards) if rewards else 0.0,
                "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                "advantage_abs_mean": statistics.fmean(abs(t.advantage) for r in ranked.results for t in r.trajectories)
                if rewards else 0.0}

    def learn(self, groups: Sequence[Group], ranked: reward_pb2.RankResponse, learner: Learner,
              staleness: int = 0) -> dict[str, float]:
        """Old logprobs recomputed by the learner, then the GRPO passes and the optimizer step.
        Rollouts sampled `staleness` updates ago weigh each token by the truncated importance
        ratio min(pi_old / pi_sampler, importance_cap) (svc_trainer.losses)."""
        started = time.perf_counter()
        built = [batching.training_sequence(episode, trajectory.turn_advantages)
                 for group, result in zip(groups, ranked.results)
                 for episode, trajectory in zip(group.episodes, result.trajectories)]
        kl = self.config.loss.kl_beta > 0
        kept, normalizer = batching.learning_batch(built, kl)
        values = {"sequences/rolled_out": float(len(built)), "sequences/trained": float(len(kept))}
        if not kept:  # every group tied: no gradient this step
            return values | {"time/learn_s": time.perf_counter() - started}
        sequences = [seq for seq, _ in kept]
        old = learner.logprobs(sequences)
        values.update(batching.logprob_gap(sequences, [sampler for _, sampler in kept], old))
        columns = {"old_logprobs": old}
        if kl:
            columns["ref_logprobs"] = learner.logprobs(sequences, reference=True)
        loss = self.loss_config()
        if staleness > 0:  # off-policy: correct with the sampler's logprobs
            columns["sampler_logprobs"] = [sampler for _, sampler in kept]
            loss = dataclasses.replace(loss, importance_cap=self.importance_cap())
        stats = learner.train_step(with_values(sequences, **columns), GrpoObjective(loss), normalizer=normalizer)
        values.update({k: v for k, v in stats.items() if k != "seconds"})
        values["tokens/trained"] = values.pop("tokens", 0.0)
        values["time/learn_s"] = time.perf_counter() - started
        return values

    def importance_cap(self) -> float:
        return self.config.importance_cap if self.config.HasField("importance_cap") else DEFAULT_IMPORTANCE_CAP

    def loss_config(self) -> GrpoLossConfig:
        loss = self.config.loss
        aggregation = SEQ_MEAN_TOKEN_MEAN if loss.aggregation == trainer_pb2.LOSS_AGGREGATION_SEQ_MEAN_TOKEN_MEAN else TOKEN_MEAN
        return GrpoLossConfig(clip_low=loss.clip_low, clip_high=loss.clip_high, kl_beta=loss.kl_beta, aggregation=aggregation)

    # --- held-out evaluation ----------------------------------------------------------------

    async def evaluate(self, ctx: RunContext, session: Session, progress: Progress) -> None:
        """pass@1 and pass@k by turn on the held-out tasks (and, with eval_train_tasks, on fresh
        samples of the training tasks) with the policy's current weights; one seed per task set
        for every evaluation of the run, so two evaluations differ by the weights alone."""
        c = self.config
        await self.keep_on_policy(ctx, progress.step + 1, session)
        sets = [("", session.held_out, "eval")]
        if c.eval_train_tasks:
            measured = sorted(session.tasks, key=lambda t: t.id)[:c.eval_train_task_count or None]
            sets.append(("train_tasks/", measured, "eval-train-tasks"))
        if not any(tasks for _, tasks, _ in sets):
            return
        started = time.perf_counter()
        values: dict[str, float] = {}
        per_task: dict[str, dict[str, list[float]]] = {}
        for prefix, tasks, purpose in sets:
            if not tasks:
                continue
            report = await evaluate(None, None, session.learner.tokenizer, model=c.policy_model, tasks=tasks,
                                    toolchain=c.toolchain, samples=c.eval_samples, turns=c.eval_turns,
                                    sampling=c.sampling, seed=derive_seed(c.seed, purpose), rollouts=session.rollouts)
            values.update({prefix + k: v for k, v in report.metrics().items()})
            per_task[prefix or "held_out/"] = report.pass_rates_by_turn()
        self.log_evaluation(ctx, progress.step, per_task)
        values.update({"sandbox/evaluations_total": progress.evaluations, "time/train_total_s": progress.train_seconds,
                       "time/eval_s": time.perf_counter() - started})
        ctx.emit("eval", progress.step, values)

    # --- RGRPO: the teacher union -----------------------------------------------------------

    def union_dir(self, ctx: RunContext) -> Path:
        return ctx.output_dir / UNION_DIR

    def union_so_far(self, ctx: RunContext) -> TeacherUnion | None:
        """The union of the rounds finished before; None before the first."""
        if (self.union_dir(ctx) / UNION_FILE).is_file():
            return TeacherUnion.read(self.union_dir(ctx))
        return None

    async def add_teacher(self, ctx: RunContext, session: Session, round_: int, union: TeacherUnion | None) -> TeacherUnion:
        """Save the round's learner as teacher-<round>, measure its pass rate on every training
        task (k samples, first turn), and write the union with its row and the new coverage."""
        c = self.config
        name = f"teacher-{round_}"
        await self.keep_on_policy(ctx, round_ * c.rgrpo.steps_per_round + 1, session)
        directory = self.union_dir(ctx)
        staging = directory / f".{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        session.learner.save_model(str(staging))
        shutil.rmtree(directory / name, ignore_errors=True)
        staging.rename(directory / name)
        seed = derive_seed(c.seed, "quality")  # the same for every teacher: rows differ by the weights alone
        report = await evaluate(None, None, session.learner.tokenizer, model=c.policy_model, tasks=session.tasks,
                                toolchain=c.toolchain, samples=c.rgrpo.eval_samples, turns=1, sampling=c.sampling,
                                seed=seed, rollouts=session.rollouts)
        rates = report.pass_rates()
        earlier = (union.teachers[:round_ - 1], union.quality[:round_ - 1]) if union else ((), ())
        quality = [*earlier[1], tuple(rates[t.id] for t in session.tasks)]
        union = TeacherUnion(
            run_id=ctx.run_id, toolchain=toolchain_name(c.toolchain), task_ids=tuple(t.id for t in session.tasks),
            teachers=(*earlier[0], Teacher(name=name, round=round_, model_path=name)), quality=tuple(quality),
            samples_per_task=c.rgrpo.eval_samples, seed=seed, tau=c.rgrpo.tau,
            coverage_by_round=tuple(rgrpo.coverage(quality[:r + 1], c.rgrpo.tau) for r in range(len(quality))),
            tokenizer_fingerprint=tokenizer_fingerprint(session.learner.tokenizer))
        union.write(directory)
        coverage = union.coverage_by_round
        step = round_ * c.rgrpo.steps_per_round
        ctx.emit("eval", step, {"rgrpo/round": float(round_), "rgrpo/coverage": coverage[-1],
                                "rgrpo/teacher_pass_rate": sum(quality[-1]) / len(quality[-1]),
                                "sandbox/evaluations": float(report.evaluations)},
                 f"{name} joined the union: coverage {coverage[-1]:.2f} at tau {c.rgrpo.tau:g}")
        return union
