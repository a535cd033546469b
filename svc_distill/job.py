"""One distillation run (DESIGN.md "TU-OPD") as a job of the run registry: called with a
`RunContext` in a worker thread, it runs its own event loop for the gRPC calls.

Per step:
  1. draw examples (leap.learning.data.draw_tasks: seeded, cursor in the checkpoint) and find
     each one's reliable teachers and weights from the quality matrix; an example with none
     is skipped and counted;
  2. the student samples its own answers (Generate, seeded by (seed, step));
  3. each reliable teacher scores the student's tokens (Score, at the sampling temperature);
  4. one learner step on the TU-OPD loss (the student's logprobs carry the gradient);
  5. the new weights are pushed to the policy service serving the student (version + 1);
  6. checkpoint every `checkpoint_every` steps, at a stop and at the end.

A service answering UNAVAILABLE is retried for `service_retry_seconds`; then, or on any other
failure outside the learner step, the last completed step is checkpointed and the run fails
with the cause, resumable from there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from leap.clients import connect
from leap.clients.retry import Patience, ServiceUnavailable, with_retries
from leap.clients.transports import WeightPusher
from leap.distill.v1 import distill_pb2
from leap.evaluation import EvalReport, evaluate
from leap.learning import Learner, LearnerSettings, NonFiniteError, OptimizerSettings
from leap.learning.data import draw_tasks
from leap.learning.lora import LoraSettings
from leap.learning.metrics import plot_metrics
from leap.learning.registry import RunContext, RunFailure
from leap.policy.v1 import policy_pb2
from leap.rollouts import Endpoints, Rollouts
from leap.sandbox.v1 import sandbox_pb2
from leap.union import UNION_FILE, TeacherUnion
from svc_distill.config import tu_opd_config
from svc_distill.losses import TuOpdObjective
from svc_distill.steps import (
    ExamplePlan, build_sequences, distill_panels, generate_request, plan_examples, score_items, step_values,
)

T = TypeVar("T")
SCORE_ITEMS_PER_CALL = 512  # below the policy service's max_prompts default (1024)
PLOT_FILE = "metrics.png"
UNION_COPY = "union"  # the run's copy of the teacher union, under its output directory


@dataclasses.dataclass
class Endpoint:
    """Where one union teacher is served."""

    name: str
    address: str
    model: str
    load_from: Path | None  # the distiller loads it from this directory when set


def endpoints(config: distill_pb2.DistillConfig, union: TeacherUnion) -> list[Endpoint]:
    """Each union teacher's endpoint, in union order: as listed in config.teachers, else the
    student's policy service under the teacher's own name, loaded from the union."""
    listed = {t.name: t for t in config.teachers}
    out = []
    for teacher in union.teachers:
        if teacher.name in listed:
            t = listed[teacher.name]
            out.append(Endpoint(teacher.name, t.address, t.model, None))
        else:
            out.append(Endpoint(teacher.name, config.student_address, teacher.name, union.model_dir(teacher).resolve()))
    return out


def pinned_union(path: str, copy: Path) -> TeacherUnion:
    """The union as the run first read it: a copy in the run's directory (model paths made
    absolute) is written on the first attempt and read on every resume, so a union that RGRPO
    rewrites meanwhile does not change a run half-way."""
    try:
        if (copy / UNION_FILE).is_file():
            return TeacherUnion.read(copy)
        union = TeacherUnion.read(path)
    except ValueError as err:
        raise RunFailure(f"the teacher union can no longer be read: {err}") from None
    teachers = [dataclasses.replace(t, model_path=str(union.model_dir(t).resolve())) for t in union.teachers]
    dataclasses.replace(union, teachers=teachers).write(copy)
    return union


class DistillJob:
    """The registry's job for one run: `DistillJob(config, settings)(ctx)`."""

    def __init__(self, config: distill_pb2.DistillConfig, settings):
        self.config = config
        self.settings = settings

    def __call__(self, ctx: RunContext) -> None:
        asyncio.run(DistillRun(self.config, self.settings, ctx).run())


class DistillRun:
    """The state of one run while its job executes."""

    def __init__(self, config: distill_pb2.DistillConfig, settings, ctx: RunContext):
        self.config, self.settings, self.ctx = config, settings, ctx
        self.union = pinned_union(config.teacher_union_path, ctx.output_dir / UNION_COPY)
        self.loss_config = tu_opd_config(config)
        self.objective = TuOpdObjective(self.loss_config, teachers=len(self.union.teachers))
        self.teachers = endpoints(config, self.union)
        self.learner: Learner | None = None
        self.cursor = 0
        self.completed = 0  # last step the learner finished
        self.saved = 0  # last step checkpointed
        self.learner_consistent = True  # False while a learner step is under way
        self.tasks: dict[str, sandbox_pb2.Task] = {}
        self.stubs: dict[tuple[str, str], object] = {}
        self.pusher: WeightPusher | None = None  # the student's weights, by the best transport its service takes
        self.patience = Patience(seconds=settings.service_retry_seconds)

    # --- calls to other services ----------------------------------------------------------------

    def stub(self, service: str, address: str):
        key = (service, address)
        if key not in self.stubs:
            self.stubs[key] = connect(service, address, unary_deadline=self.settings.call_timeout_seconds)
        return self.stubs[key]

    @property
    def student(self):
        return self.stub("policy", self.config.student_address)

    @property
    def sandbox(self):
        return self.stub("sandbox", self.config.sandbox_address)

    async def call(self, service: str, address: str, what: str, make_call: Callable[[], Awaitable[T]], *,
                   tolerate: grpc.StatusCode | None = None) -> T | None:
        """`make_call()`, riding out a `service` at `address` that went away for
        service_retry_seconds (leap.clients.retry); None when it fails with `tolerate`; any other
        failure fails the run, naming `what` was being done."""
        try:
            return await with_retries(make_call, service, address, self.patience)
        except ServiceUnavailable as err:
            raise RunFailure(f"{what}: {err}") from None
        except grpc.aio.AioRpcError as err:
            if err.code() == tolerate:
                return None
            raise RunFailure(f"{what}: the {service} service at {address} answered {err.code().name}: "
                             f"{err.details()}") from None

    async def close_stubs(self) -> None:
        if self.pusher is not None:
            await self.pusher.close()
        for stub in self.stubs.values():
            await stub.channel.close()

    # --- the run ---------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            self.learner = Learner(self.learner_settings())
            start = self.restore()
            await self.prepare_services()
            if start == 0:
                await self.evaluate(0, with_teachers=True)
            for step in range(start + 1, self.ctx.total_steps + 1):
                if await self.step(step):
                    break
            self.finish()
        except BaseException:
            if self.learner is not None and self.learner_consistent and self.completed > self.saved:
                self.save(self.completed)  # resumable from the last step that finished
            raise
        finally:
            await self.close_stubs()
            if self.learner is not None:
                self.learner.close()

    def learner_settings(self) -> LearnerSettings:
        optimizer = OptimizerSettings.from_proto(self.config.optimizer)
        return LearnerSettings(
            model_path=self.config.student_model_path, optimizer=optimizer,
            total_updates=self.config.steps * optimizer.epochs_per_batch,
            temperature=self.config.sampling.temperature, device=self.settings.device, seed=self.config.seed % 2**63,
            lora=LoraSettings.from_proto(self.config.lora))

    def restore(self) -> int:
        """Continue from the latest checkpoint (weights, optimizer, RNG, cursor): its step."""
        at = self.ctx.latest_checkpoint()
        if at is None:
            return 0
        state = self.learner.load_checkpoint(at.path)
        self.cursor = int(state["cursor"]["examples"])
        self.completed = self.saved = int(state["step"])
        self.ctx.emit("log", self.completed, message=f"resumed from the checkpoint of step {self.completed}")
        return self.completed

    async def prepare_services(self) -> None:
        """Load the student and teachers where the distiller serves them, fetch the tasks, and
        make the student's service serve exactly the weights this run trains."""
        await self.ensure_loaded(self.config.student_address, self.config.student_model,
                                 Path(self.config.student_model_path).resolve(), same_path=False,
                                 lora=self.config.lora if self.config.lora.rank else None)
        for teacher in self.teachers:
            if teacher.load_from is not None:
                await self.ensure_loaded(teacher.address, teacher.model, teacher.load_from, same_path=True)
        for task_id in dict.fromkeys([*self.config.train_tasks, *self.config.eval_tasks]):
            request = sandbox_pb2.GetTaskRequest(task_id=task_id)
            reply = await self.call("sandbox", self.config.sandbox_address, f"GetTask {task_id}",
                                    lambda: self.sandbox.GetTask(request))
            self.tasks[task_id] = reply.task
        self.ctx.progress(extra={"teachers": [t.name for t in self.teachers], "union_coverage": self.union.coverage()})
        await self.push_student()

    async def ensure_loaded(self, address: str, model: str, path: Path, *, same_path: bool, lora=None) -> None:
        """LoadModel unless `model` is already served there; a teacher already served from
        another directory is refused (the run would learn from the wrong teacher)."""
        policy = self.stub("policy", address)
        request = policy_pb2.LoadModelRequest(name=model, path=str(path), lora=lora)
        loaded = await self.call("policy", address, f"LoadModel {model}", lambda: policy.LoadModel(request),
                                 tolerate=grpc.StatusCode.ALREADY_EXISTS)
        if loaded is not None:
            return
        info = await self.call("policy", address, f"GetModel {model}",
                               lambda: policy.GetModel(policy_pb2.GetModelRequest(name=model)))
        if same_path and Path(info.model.path).resolve() != path:
            raise RunFailure(f"model {model!r} at {address} is already loaded from {info.model.path}, not from the "
                             f"union's {path}: unload it, or serve the teacher elsewhere and list it in config.teachers")

    async def push_student(self) -> None:
        """Serve the learner's current weights as the next version of the student."""
        name, address = self.config.student_model, self.config.student_address
        info = await self.call("policy", address, f"GetModel {name}",
                               lambda: self.student.GetModel(policy_pb2.GetModelRequest(name=name)))
        state = self.learner.push_state(info.model.lora if info.model.lora.rank else None)  # LoRA: the adapter alone
        if self.pusher is None:
            self.pusher = WeightPusher(self.student, name, getattr(self.settings, "weight_transport", "auto"),
                                       timeout=self.settings.call_timeout_seconds)
        await self.call("policy", address, f"UpdateWeights {name}",
                        lambda: self.pusher.push(info.model.version + 1, state))

    # --- one step ---------------------------------------------------------------------------------

    async def step(self, step: int) -> bool:
        """One step; True when the run should stop after it (a stop was requested)."""
        started = time.perf_counter()
        task_ids, cursor = draw_tasks(list(self.config.train_tasks), self.config.examples_per_step, self.cursor,
                                      self.config.seed)
        plan = plan_examples(task_ids, self.union, self.loss_config)
        timings: dict[str, float] = {}
        stats = None
        if plan.kept:
            completions = await self.timed(timings, "generate", self.sample(plan, step))
            scores = await self.timed(timings, "score", self.score(plan, completions))
            sequences = build_sequences(plan, completions, scores)
            learn_started = time.perf_counter()
            self.learner_consistent = False
            try:
                stats = self.learner.train_step(sequences, self.objective)
            except NonFiniteError as err:  # nothing of this update is pushed or checkpointed
                raise RunFailure(err.sentence(step, self.config.optimizer)) from None
            self.learner_consistent = True
            timings["learn"] = time.perf_counter() - learn_started
        self.cursor, self.completed = cursor, step
        values = step_values(plan, stats, [t.name for t in self.teachers])
        if stats is not None:
            await self.timed(timings, "sync", self.push_student())
        values.update({f"time/{name}_s": seconds for name, seconds in timings.items()})
        values["time/step_s"] = time.perf_counter() - started
        self.ctx.emit("train", step, values)
        stopping = self.ctx.stop_requested()
        if stopping or step % self.config.checkpoint_every == 0 or step == self.ctx.total_steps:
            self.save(step)
        if step == self.ctx.total_steps or (self.config.eval_every and step % self.config.eval_every == 0):
            await self.evaluate(step, with_teachers=False)
        return stopping

    @staticmethod
    async def timed(timings: dict[str, float], name: str, work: Awaitable[T]) -> T:
        started = time.perf_counter()
        result = await work
        timings[name] = time.perf_counter() - started
        return result

    async def sample(self, plan: ExamplePlan, step: int) -> list[list[policy_pb2.Completion]]:
        """The student's samples of each kept example, grouped by example."""
        tasks = [self.tasks[plan.task_ids[i]] for i in plan.kept]
        request = generate_request(self.config.student_model, tasks, self.config.toolchain, self.config, step)
        reply = await self.call("policy", self.config.student_address, f"Generate {self.config.student_model}",
                                lambda: self.student.Generate(request))
        grouped: list[list[policy_pb2.Completion]] = [[] for _ in tasks]
        for completion in reply.completions:
            grouped[completion.prompt_index].append(completion)
        return grouped

    async def score(self, plan: ExamplePlan, completions: list[list[policy_pb2.Completion]]
                    ) -> dict[int, list[list[float]]]:
        """Each teacher's logprobs of the student's samples of the examples it teaches, all
        teachers at once."""
        async def one(k: int) -> list[list[float]]:
            mine = [c for j, i in enumerate(plan.kept) if plan.teaches(k, i) for c in completions[j]]
            return await self.score_with(self.teachers[k], mine)

        results = await asyncio.gather(*(one(k) for k in range(len(self.teachers))))
        return dict(enumerate(results))

    async def score_with(self, teacher: Endpoint, completions: Sequence[policy_pb2.Completion]) -> list[list[float]]:
        policy = self.stub("policy", teacher.address)
        out: list[list[float]] = []
        for first in range(0, len(completions), SCORE_ITEMS_PER_CALL):
            request = policy_pb2.ScoreRequest(model=teacher.model, temperature=self.config.sampling.temperature,
                                              items=score_items(completions[first:first + SCORE_ITEMS_PER_CALL]))
            reply = await self.call("policy", teacher.address, f"Score by teacher {teacher.name!r}",
                                    lambda: policy.Score(request))
            out += [list(result.logprobs) for result in reply.results]
        return out

    # --- checkpoints, evaluation, the end ----------------------------------------------------------

    def save(self, step: int) -> None:
        info = self.learner.save_checkpoint(self.ctx.checkpoint_dir, step, cursor={"examples": self.cursor},
                                            keep_last=self.settings.keep_checkpoints)
        self.ctx.checkpoint_saved(info)
        self.saved = step

    async def evaluate(self, step: int, *, with_teachers: bool) -> None:
        """Held-out pass@1 of the student (and, before training, of every teacher and of their
        union: per task the best teacher's pass rate) through the shared evaluator."""
        if not self.config.eval_tasks:
            self.ctx.emit("log", step, message="held-out evaluation skipped: the run has no held-out tasks")
            return
        report = await self.evaluate_model(self.config.student_address, self.config.student_model)
        values = report.metrics()
        if with_teachers:
            rates = []
            for teacher in self.teachers:
                report = await self.evaluate_model(teacher.address, teacher.model)
                values.update({f"teacher/{teacher.name}/{k}": v for k, v in report.metrics().items()})
                rates.append(report.pass_rates(turn=1))
            best = [max(r[task] for r in rates) for task in self.config.eval_tasks]
            values["union/pass_at_1/turn_1"] = sum(best) / len(best)
        self.ctx.emit("eval", step, values)

    async def evaluate_model(self, address: str, model: str) -> EvalReport:
        """One model's first answers to every held-out task, judged by the sandbox (untimed)."""
        policy = self.stub("policy", address)
        endpoints = Endpoints(policy, self.sandbox, policy_target=address, sandbox_target=self.config.sandbox_address)
        rollouts = Rollouts(endpoints, self.learner.tokenizer, model=model, toolchain=self.config.toolchain,
                            sampling=self.config.sampling, options=sandbox_pb2.EvaluateOptions(timing=False),
                            patience=self.patience)
        tasks = [self.tasks[t] for t in self.config.eval_tasks]
        try:
            return await evaluate(policy, self.sandbox, self.learner.tokenizer, model=model, tasks=tasks,
                                  toolchain=self.config.toolchain, samples=self.config.eval_samples, turns=1,
                                  sampling=self.config.sampling, seed=self.config.seed, rollouts=rollouts)
        except ServiceUnavailable as err:
            raise RunFailure(f"held-out evaluation of {model!r}: {err}") from None

    def finish(self) -> None:
        """The PNG of the main curves, from every event recorded so far (and, with
        lora.save_merged, the student with its adapter merged, in `merged/`)."""
        if self.config.lora.save_merged:
            self.learner.save_model(str(self.ctx.output_dir / "merged"))
        events = self.ctx.events()
        plot_metrics(events, self.ctx.output_dir / PLOT_FILE, title=f"distill {self.ctx.run_id}",
                     panels=distill_panels([t.name for t in self.teachers]))
