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
the running totals, so a stopped, failed or killed run resumes with no step lost or
repeated. A service that stops answering is retried (`service_retry_seconds`), then the run
fails with the cause after checkpointing its last completed step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence

import grpc

from leap.clients import connect
from leap.clients.retry import Patience, ServiceUnavailable, with_retries
from leap.clients.weights import push_weights
from leap.evaluation import EvalReport, evaluate
from leap.learning import Learner, LearnerSettings, OptimizerSettings, with_values
from leap.learning.data import draw_tasks
from leap.learning.metrics import plot_metrics
from leap.learning.registry import RunContext, RunFailure
from leap.policy.v1 import policy_pb2
from leap.reward.v1 import reward_pb2
from leap.rollouts import Endpoints, Episode, Rollouts, derive_seed
from leap.sandbox.v1 import sandbox_pb2
from leap.tokenization import tokenizer_fingerprint
from leap.trainer.v1 import trainer_pb2
from svc_trainer import batch as batching
from svc_trainer.losses import SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN, GrpoLossConfig, GrpoObjective
from svc_trainer.metrics import rollout_metrics

TrainMode = trainer_pb2.TrainMode
GateMode = reward_pb2.GateMode
Decision = reward_pb2.Decision
GENERATE_DEADLINE_SECONDS = 1800.0  # a big batch on a CPU is slow; a dead service is caught by health, not by this


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What a job takes from the trainer service's settings."""

    device: str = "auto"
    service_retry_seconds: float = 60.0
    keep_checkpoints: int = 3
    rollout_log: str = "text"  # "off", "text" (answers, verdicts, rewards) or "tokens" (and token ids)


@dataclasses.dataclass
class Group:
    """One task's rollouts in a step."""

    task: sandbox_pb2.Task
    episodes: list[Episode]
    decision: reward_pb2.GateDecision | None = None  # None in single-turn mode

    @property
    def expanded(self) -> bool:
        return self.decision is not None and self.decision.decision == Decision.DECISION_EXPAND


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
                                  self.patience)

    async def close(self) -> None:
        for stub in (self.policy, self.sandbox, self.reward):
            await stub.channel.close()


class GroupGate:
    """Gates each group as soon as its first turns are judged: one Gate call per group, or,
    in adaptive mode, one call for the whole step (the expansion budget is per call)."""

    def __init__(self, services: Services, config: reward_pb2.GateConfig, groups: int):
        self.services = services
        self.config = config
        self.batched = config.mode == GateMode.GATE_MODE_ADAPTIVE
        self.expected = groups
        self.arrived: dict[int, reward_pb2.GateGroup] = {}
        self.futures: dict[int, asyncio.Future] = {}
        self.summaries: list[reward_pb2.GateSummary] = []

    async def decide(self, index: int, group: reward_pb2.GateGroup) -> reward_pb2.GateDecision:
        if not self.batched:
            reply = await self.services.call("reward", "Gate", reward_pb2.GateRequest(groups=[group], config=self.config))
            self.summaries.append(reply.summary)
            return reply.decisions[0]
        self.arrived[index] = group
        self.futures[index] = asyncio.get_running_loop().create_future()
        if len(self.arrived) == self.expected:
            order = sorted(self.arrived)
            request = reward_pb2.GateRequest(groups=[self.arrived[i] for i in order], config=self.config)
            try:
                reply = await self.services.call("reward", "Gate", request)
            except BaseException as err:
                for i in order:
                    if not self.futures[i].done():
                        self.futures[i].set_exception(err)
                raise
            self.summaries.append(reply.summary)
            for i, decision in zip(order, reply.decisions):
                self.futures[i].set_result(decision)
        return await self.futures[index]

    def evaluations_saved(self) -> int:
        return sum(s.evaluations_saved for s in self.summaries)


@dataclasses.dataclass
class Progress:
    """What a checkpoint carries besides the learner."""

    step: int = 0
    cursor: int = 0  # training tasks drawn so far
    evaluations: int = 0  # sandbox evaluations of training rollouts so far
    train_seconds: float = 0.0  # wall seconds of training steps so far (evaluation excluded)

    def to_json(self) -> dict:
        return {"cursor": self.cursor, "evaluations": self.evaluations, "train_seconds": self.train_seconds}

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        extra = state.get("extra", {})
        return cls(step=int(state["step"]), cursor=int(state["cursor"].get("tasks", 0)),
                   evaluations=int(extra.get("evaluations", 0)), train_seconds=float(extra.get("train_seconds", 0.0)))


class TrainingJob:
    """One run (see the module docstring); the registry calls it in a worker thread."""

    def __init__(self, config: trainer_pb2.RunConfig, settings: JobSettings):
        self.config = config
        self.settings = settings
        self.patience = Patience(seconds=settings.service_retry_seconds)
        self.version = 0  # weight version the policy serves for this run

    def __call__(self, ctx: RunContext) -> None:
        try:
            asyncio.run(self.main(ctx))
        except ServiceUnavailable as err:
            raise RunFailure(str(err)) from err

    # --- the run ----------------------------------------------------------------------------

    def learner_settings(self) -> LearnerSettings:
        c = self.config
        optimizer = OptimizerSettings.from_proto(c.optimizer)
        return LearnerSettings(model_path=c.model_path, optimizer=optimizer,
                               total_updates=c.steps * optimizer.epochs_per_batch, temperature=c.sampling.temperature,
                               reference=c.loss.kl_beta > 0, device=self.settings.device, seed=c.seed)

    async def main(self, ctx: RunContext) -> None:
        services = Services(self.config.services, self.patience)
        try:
            with Learner(self.learner_settings()) as learner:
                await self.train(ctx, services, learner)
        finally:
            await services.close()

    async def train(self, ctx: RunContext, services: Services, learner: Learner) -> None:
        c = self.config
        progress = self.restore(ctx, learner)
        train_tasks = await self.fetch_tasks(services, c.train_tasks)
        eval_tasks = await self.fetch_tasks(services, c.eval_tasks)
        info = await self.serve_learner(services, learner)
        rollouts = self.rollouts(services, learner, info, timing=True)
        if progress.step == 0:
            await self.evaluate(ctx, services, learner, info, eval_tasks, progress)
        saved = progress.step
        try:
            for step in range(progress.step + 1, c.steps + 1):
                started = time.perf_counter()
                names, progress.cursor = draw_tasks([t.id for t in train_tasks], c.tasks_per_step, progress.cursor, c.seed)
                by_id = {t.id: t for t in train_tasks}
                values = await self.step(ctx, step, [by_id[n] for n in names], services, learner, rollouts)
                progress.step = step
                progress.evaluations += int(values["sandbox/evaluations"])
                progress.train_seconds += time.perf_counter() - started
                values.update({"sandbox/evaluations_total": progress.evaluations, "time/train_total_s": progress.train_seconds})
                ctx.emit("train", step, values)
                if (c.eval_every and step % c.eval_every == 0) or step == c.steps:
                    await self.evaluate(ctx, services, learner, info, eval_tasks, progress)
                if step % c.checkpoint_every == 0 or step == c.steps or ctx.stop_requested():
                    saved = self.save(ctx, learner, progress)
                if ctx.stop_requested():
                    return
        except BaseException:
            if progress.step > saved:  # keep the steps done: the run resumes after them
                self.save(ctx, learner, progress)
            raise
        self.plot(ctx)

    def restore(self, ctx: RunContext, learner: Learner) -> Progress:
        at = ctx.latest_checkpoint()
        if at is None:
            return Progress()
        progress = Progress.from_state(learner.load_checkpoint(at.path))
        ctx.log.info("resumed", step=progress.step, checkpoint=str(at.path))
        return progress

    def save(self, ctx: RunContext, learner: Learner, progress: Progress) -> int:
        info = learner.save_checkpoint(ctx.checkpoint_dir, progress.step, cursor={"tasks": progress.cursor},
                                       extra=progress.to_json(), keep_last=self.settings.keep_checkpoints)
        ctx.checkpoint_saved(info)
        return progress.step

    def plot(self, ctx: RunContext) -> None:
        path = plot_metrics(ctx.events(), ctx.output_dir / "metrics.png", title=self.config.display_name or ctx.run_id)
        if path is not None:
            ctx.emit("log", self.config.steps, {}, f"plot written to {path}")

    async def fetch_tasks(self, services: Services, task_ids: Sequence[str]) -> list[sandbox_pb2.Task]:
        replies = await asyncio.gather(*(services.call("sandbox", "GetTask", sandbox_pb2.GetTaskRequest(task_id=t))
                                         for t in task_ids))
        return [reply.task for reply in replies]

    # --- the policy serves what the learner trains -------------------------------------------

    async def serve_learner(self, services: Services, learner: Learner) -> policy_pb2.ModelInfo:
        """Make the policy serve the learner's current weights under the run's model name
        (loading the model first where the service does not have it), with a new version."""
        name = self.config.policy_model
        try:
            info = (await services.call("policy", "GetModel", policy_pb2.GetModelRequest(name=name))).model
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise
            request = policy_pb2.LoadModelRequest(name=name, path=self.config.model_path)
            info = (await services.call("policy", "LoadModel", request)).model
        if info.tokenizer_fingerprint and info.tokenizer_fingerprint != tokenizer_fingerprint(learner.tokenizer):
            raise RunFailure(f"the policy serves {name!r} from {info.path!r}, whose tokenizer differs from the one of "
                             f"model_path {self.config.model_path!r}: the run would train on tokens it did not sample")
        self.version = info.version
        await self.push(services, learner)
        return info

    async def push(self, services: Services, learner: Learner) -> float:
        """Send the learner's weights as the next version; returns the seconds it took."""
        started = time.perf_counter()
        state = learner.full_state_dict()
        self.version += 1
        reply = await with_retries(lambda: push_weights(services.policy, self.config.policy_model, self.version, state),
                                   "policy", services.addresses.policy, self.patience)
        self.version = reply.version
        return time.perf_counter() - started

    def rollouts(self, services: Services, learner: Learner, info: policy_pb2.ModelInfo, *, timing: bool) -> Rollouts:
        options = sandbox_pb2.EvaluateOptions(size=self.config.sandbox_size, timing=timing)
        return Rollouts(Endpoints(services.policy, services.sandbox, services.addresses.policy, services.addresses.sandbox),
                        learner.tokenizer, model=self.config.policy_model, toolchain=self.config.toolchain,
                        sampling=self.config.sampling, options=options, max_context_tokens=info.max_context_tokens,
                        patience=self.patience)

    # --- one step ---------------------------------------------------------------------------

    async def step(self, ctx: RunContext, step: int, tasks: list[sandbox_pb2.Task], services: Services,
                   learner: Learner, rollouts: Rollouts) -> dict[str, float]:
        started = time.perf_counter()
        rollouts.generate_clock.take()  # count this step's busy time only
        rollouts.evaluate_clock.take()
        evaluations = rollouts.evaluations
        gate = GroupGate(services, self.config.gate, len(tasks))
        groups = await asyncio.gather(*(self.play_group(step, i, task, rollouts, gate) for i, task in enumerate(tasks)))
        ranked = await services.call("reward", "Rank", reward_pb2.RankRequest(
            groups=[batching.rank_group(g.task.id, g.episodes) for g in groups], config=self.config.rank))
        rollout_seconds = time.perf_counter() - started
        self.log_rollouts(ctx, step, groups, ranked)
        values = rollout_metrics([e.outcomes() for g in groups for e in g.episodes], [g.expanded for g in groups],
                                 self.config.max_turns)
        values["sandbox/evaluations"] = float(rollouts.evaluations - evaluations)
        values["sandbox/evaluations_saved"] = float(gate.evaluations_saved())
        values.update(self.reward_stats(ranked))
        values.update(self.learn(groups, ranked, learner))
        sync_seconds = await self.push(services, learner)
        values.update({
            "time/generate_s": rollouts.generate_clock.take(), "time/evaluate_s": rollouts.evaluate_clock.take(),
            "time/rollout_s": rollout_seconds, "time/sync_s": sync_seconds,
            "time/step_s": time.perf_counter() - started, "weight_version": float(self.version),
            "tokens/generated": float(sum(len(t.completion_ids) for g in groups for e in g.episodes for t in e.turns)),
        })
        return values

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
            active = [e for e in chosen if batching.continues(e, c.gate.improve_below_speedup) and rollouts.can_continue(e)]
            if not active:
                break
            await rollouts.next_turns(active, derive_seed(seed, turn))
        return group

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

    def learn(self, groups: Sequence[Group], ranked: reward_pb2.RankResponse, learner: Learner) -> dict[str, float]:
        """Old logprobs recomputed by the learner, then the GRPO passes and the optimizer step."""
        started = time.perf_counter()
        built = [batching.training_sequence(episode, trajectory.turn_advantages)
                 for group, result in zip(groups, ranked.results)
                 for episode, trajectory in zip(group.episodes, result.trajectories)]
        kl = self.config.loss.kl_beta > 0
        kept = [(seq, sampler) for seq, sampler in built if kl or batching.carries_signal(seq)]
        values = {"sequences/rolled_out": float(len(built)), "sequences/trained": float(len(kept))}
        if not kept:  # every group tied: no gradient this step
            return values | {"time/learn_s": time.perf_counter() - started}
        sequences = [seq for seq, _ in kept]
        old = learner.logprobs(sequences)
        values.update(batching.logprob_gap(sequences, [sampler for _, sampler in kept], old))
        columns = {"old_logprobs": old}
        if kl:
            columns["ref_logprobs"] = learner.logprobs(sequences, reference=True)
        stats = learner.train_step(with_values(sequences, **columns), GrpoObjective(self.loss_config()))
        values.update({k: v for k, v in stats.items() if k != "seconds"})
        values["tokens/trained"] = values.pop("tokens", 0.0)
        values["time/learn_s"] = time.perf_counter() - started
        return values

    def loss_config(self) -> GrpoLossConfig:
        loss = self.config.loss
        aggregation = SEQ_MEAN_TOKEN_MEAN if loss.aggregation == trainer_pb2.LOSS_AGGREGATION_SEQ_MEAN_TOKEN_MEAN else TOKEN_MEAN
        return GrpoLossConfig(clip_low=loss.clip_low, clip_high=loss.clip_high, kl_beta=loss.kl_beta, aggregation=aggregation)

    # --- held-out evaluation ----------------------------------------------------------------

    async def evaluate(self, ctx: RunContext, services: Services, learner: Learner, info: policy_pb2.ModelInfo,
                       tasks: Sequence[sandbox_pb2.Task], progress: Progress) -> EvalReport | None:
        """pass@1 and pass@k by turn on the held-out tasks with the policy's current weights;
        the same seed every time, so before and after differ by the weights alone."""
        if not tasks:
            return None
        started = time.perf_counter()
        c = self.config
        report = await evaluate(None, None, learner.tokenizer, model=c.policy_model, tasks=tasks, toolchain=c.toolchain,
                                samples=c.eval_samples, turns=c.eval_turns, sampling=c.sampling,
                                seed=derive_seed(c.seed, "eval"), rollouts=self.rollouts(services, learner, info, timing=True))
        values = report.metrics() | {"sandbox/evaluations_total": progress.evaluations,
                                     "time/train_total_s": progress.train_seconds,
                                     "time/eval_s": time.perf_counter() - started}
        ctx.emit("eval", progress.step, values)
        return report
