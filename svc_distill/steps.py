"""The pure parts of a TU-OPD step (no gRPC, no model): which examples are trained on and by
which teachers, the student's sampling request, the learner sequences built from the
student's completions and the teachers' scores, and the step's metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from leap import prompts
from leap.distill.v1 import distill_pb2
from leap.learning import Sequence as LearnerSequence
from leap.policy.v1 import policy_pb2
from leap.sandbox.v1 import sandbox_pb2
from leap.union import TeacherUnion
from svc_distill.losses import SAMPLER_LOGPS, TuOpdConfig, quality_key, teacher_key, teacher_weights


def sampling_seed(seed: int, step: int) -> int:
    """The Generate seed of a step: fixed by (run seed, step), so a resumed run samples what an
    uninterrupted one would have."""
    return (seed * 1_000_003 + step) % 2**64


@dataclasses.dataclass(frozen=True)
class ExamplePlan:
    """Who teaches which drawn example."""

    task_ids: list[str]  # drawn this step, in order
    quality: torch.Tensor  # [K, B] q[k][x] of the drawn examples
    weights: torch.Tensor  # [K, B] w_k(x); a column of zeros: no reliable teacher

    @property
    def kept(self) -> list[int]:
        """Indices of the examples with at least one reliable teacher (the ones trained on)."""
        return [i for i in range(len(self.task_ids)) if float(self.weights[:, i].sum()) > 0]

    @property
    def skipped(self) -> int:
        return len(self.task_ids) - len(self.kept)

    def teaches(self, k: int, example: int) -> bool:
        return float(self.weights[k, example]) > 0

    def reliable_counts(self) -> list[int]:
        """|R(x)| of each drawn example (teachers with a weight)."""
        return [int((self.weights[:, i] > 0).sum()) for i in range(len(self.task_ids))]


def plan_examples(task_ids: Sequence[str], union: TeacherUnion, config: TuOpdConfig) -> ExamplePlan:
    quality = torch.tensor([union.quality_of(t) for t in task_ids], dtype=torch.float32).T.reshape(
        len(union.teachers), len(task_ids))
    return ExamplePlan(list(task_ids), quality, teacher_weights(quality, config))


def generate_request(model: str, tasks: Sequence[sandbox_pb2.Task], toolchain: int,
                     config: distill_pb2.DistillConfig, step: int) -> policy_pb2.GenerateRequest:
    """The student's on-policy samples of one step: n per example, chat prompts in the shared
    format, seeded by (seed, step)."""
    sampling = policy_pb2.SamplingParams(
        n=config.samples_per_example, temperature=config.sampling.temperature, top_p=config.sampling.top_p,
        max_new_tokens=config.sampling.max_new_tokens, seed=sampling_seed(config.seed, step))
    chats = [policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t, toolchain))) for t in tasks]
    return policy_pb2.GenerateRequest(model=model, prompts=chats, sampling=sampling)


def score_items(completions: Sequence[policy_pb2.Completion]) -> list[policy_pb2.ScoreItem]:
    """What a teacher scores: the student's exact prompt tokens and sampled tokens."""
    return [policy_pb2.ScoreItem(prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids)
            for c in completions]


def build_sequences(plan: ExamplePlan, completions: Sequence[Sequence[policy_pb2.Completion]],
                    scores: Mapping[int, Sequence[Sequence[float]]]) -> list[LearnerSequence]:
    """Learner sequences of the kept examples: prompt then the student's tokens (only those in
    the loss), each teacher's logprobs of them and each teacher's q of the example.

    completions[j]: the samples of the j-th kept example. scores[k]: teacher k's logprobs of
    every sample of the kept examples it teaches, in order; a teacher that does not teach an
    example gets zeros there (its weight is 0, so they never count)."""
    teachers = plan.weights.shape[0]
    cursors = {k: iter(scores.get(k, ())) for k in range(teachers)}
    sequences = []
    for j, example in enumerate(plan.kept):
        for completion in completions[j]:
            prompt, sampled = list(completion.prompt_token_ids), list(completion.token_ids)
            pad = [0.0] * len(prompt)
            values: dict[str, list[float] | float] = {SAMPLER_LOGPS: pad + list(completion.logprobs)}
            for k in range(teachers):
                scored = list(next(cursors[k])) if plan.teaches(k, example) else [0.0] * len(sampled)
                if len(scored) != len(sampled):
                    raise ValueError(f"teacher {k} returned {len(scored)} logprobs for {len(sampled)} tokens")
                values[teacher_key(k)] = pad + scored
                values[quality_key(k)] = float(plan.quality[k, example])
            sequences.append(LearnerSequence(prompt + sampled, [0] * len(prompt) + [1] * len(sampled), values))
    return sequences


def step_values(plan: ExamplePlan, stats: Mapping[str, float] | None, teacher_names: Sequence[str]) -> dict[str, float]:
    """The metrics of one step: the learner's statistics with the KL to each teacher made a
    mean over that teacher's own tokens, and who taught how much."""
    reliable = plan.reliable_counts()
    values = {
        "examples": float(len(plan.kept)),
        "skipped_examples": float(plan.skipped),
        "reliable_teachers_mean": sum(reliable) / max(len(reliable), 1),
    }
    for k, name in enumerate(teacher_names):
        values[f"examples_taught/{name}"] = float(sum(plan.teaches(k, i) for i in plan.kept))
    if not stats:
        return values
    skip = ("kl_teacher_sum/", "teacher_share/")
    values.update({("kl/target" if key == "kl_target" else key): v for key, v in stats.items()
                   if not key.startswith(skip)})
    for k, name in enumerate(teacher_names):
        share = stats.get(f"teacher_share/{k}", 0.0)
        if share > 0:
            values[f"kl/teacher/{name}"] = stats[f"kl_teacher_sum/{k}"] / share
    return values


def distill_panels(teacher_names: Sequence[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The curves of a distillation run's PNG (`leap.learning.metrics.plot_metrics`)."""
    return [
        ("held-out pass@1", [("eval", "pass_at_1/turn_1"), ("eval", "union/pass_at_1/turn_1")]),
        ("loss", [("train", "loss")]),
        ("reverse KL per token (student to ...)",
         [("train", "kl/target")] + [("train", f"kl/teacher/{name}") for name in teacher_names]),
        ("examples", [("train", "reliable_teachers_mean"), ("train", "skipped_examples")]),
        ("entropy / grad norm", [("train", "entropy"), ("train", "grad_norm")]),
        ("step time (s)", [("train", "time/generate_s"), ("train", "time/score_s"), ("train", "time/learn_s"),
                           ("train", "time/sync_s")]),
    ]
