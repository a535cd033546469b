"""Multi-turn rollouts over gRPC, shared by the trainer (LEAP steps, held-out evaluation,
RGRPO's quality matrix) and the distiller (the student's pass@1).

An `Episode` is one sample's dialogue with the sandbox: turn 1 answers the task prompt,
each later turn answers the verdict's feedback. Token ids are kept exactly as sampled: turn
t+1's prompt is turn t's prompt, its sampled tokens, then the template's tokens of the
feedback message (`leap.prompts.continuation_ids`), sent to the policy as token ids. So the
learner scores the very tokens the sampler produced, and `Episode.sequence()` is one token
sequence with the model's own tokens marked.

`Rollouts` samples (policy `Generate`) and judges (sandbox `EvaluateBatch`, verdicts
streamed back) through stubs of `leap.clients.connect`, retrying services that went away
(`leap.clients.retry`) and timing how long each service was busy (`BusyClock`). Its
methods are coroutines; run many groups concurrently with `asyncio.gather` and the policy
batches their generations while the sandbox already judges finished ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence

from leap import prompts
from leap.clients.retry import Patience, with_retries
from leap.common.v1 import common_pb2
from leap.policy.v1 import policy_pb2
from leap.sandbox.v1 import sandbox_pb2

Stage = common_pb2.Stage
FinishReason = policy_pb2.FinishReason
Flag = sandbox_pb2.VerdictFlag


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one turn achieved, as metrics and rewards read it."""

    correct: bool
    speedup: float = 0.0  # reference time / candidate time; 0 when not correct or not timed
    stage: int = Stage.STAGE_UNSPECIFIED
    speedup_low: float = 0.0  # the speedup's 95% interval (Verdict.speedup_low/high); 0 when not timed
    speedup_high: float = 0.0
    suspicious: bool = False  # a pass the sandbox flagged SUSPICIOUS_SPEEDUP
    unreliable: bool = False  # ... or TIMING_UNRELIABLE

    @property
    def flagged(self) -> bool:
        """Its speed is not to be trusted: no speed credit (see RunConfig.flagged_verdicts)."""
        return self.suspicious or self.unreliable

    @property
    def credited_speedup(self) -> float:
        """The speedup that counts: 0 when not correct, not timed or flagged."""
        return 0.0 if self.flagged or not self.correct else self.speedup


@dataclasses.dataclass
class Turn:
    """One answer of the model and its verdict."""

    prompt_ids: list[int]  # everything the model saw before answering (earlier turns included)
    completion_ids: list[int]  # what it sampled (the end-of-turn token included when it ended the turn)
    sampler_logprobs: list[float]  # the sampler's logprob of each completion token
    text: str
    end_token_id: int | None  # the token that ended the answer (end of turn); None when cut at max_new_tokens
    weight_version: int
    verdict: sandbox_pb2.Verdict | None = None
    flagged_as_failure: bool = False  # a flagged pass counts as a failure at CORRECT (RunConfig.flagged_verdicts)

    @property
    def outcome(self) -> Outcome:
        verdict = self.verdict or sandbox_pb2.Verdict()
        passed = verdict.stage == Stage.STAGE_PASSED
        suspicious = passed and Flag.VERDICT_FLAG_SUSPICIOUS_SPEEDUP in verdict.flags
        unreliable = passed and Flag.VERDICT_FLAG_TIMING_UNRELIABLE in verdict.flags
        if (suspicious or unreliable) and self.flagged_as_failure:
            return Outcome(False, 0.0, Stage.STAGE_CORRECT, suspicious=suspicious, unreliable=unreliable)
        if not passed:
            return Outcome(False, 0.0, verdict.stage)
        return Outcome(True, verdict.speedup, verdict.stage, verdict.speedup_low, verdict.speedup_high, suspicious,
                       unreliable)


@dataclasses.dataclass
class Episode:
    """One sample's turns on one task."""

    task: sandbox_pb2.Task
    sample: int
    messages: list[common_pb2.ChatMessage]  # the dialogue as text (for the template), last turn's prompt
    turns: list[Turn] = dataclasses.field(default_factory=list)
    out_of_context: bool = False  # another turn would not fit the model's context: the episode ends here

    @property
    def last(self) -> Turn:
        return self.turns[-1]

    @property
    def solved(self) -> bool:
        return any(turn.outcome.correct for turn in self.turns)

    @property
    def best_speedup(self) -> float:
        """The best speedup that counts over its turns (correct, timed, not flagged)."""
        return max((turn.outcome.credited_speedup for turn in self.turns), default=0.0)

    def outcomes(self) -> list[Outcome]:
        return [turn.outcome for turn in self.turns]

    def sequence(self) -> tuple[list[int], list[int]]:
        """The whole dialogue as token ids, and per id the turn (0-based) that sampled it, or
        -1 for prompt and feedback tokens."""
        ids = self.last.prompt_ids + self.last.completion_ids
        owner = [-1] * len(ids)
        for index, turn in enumerate(self.turns):
            start = len(turn.prompt_ids)
            owner[start:start + len(turn.completion_ids)] = [index] * len(turn.completion_ids)
        return ids, owner


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (run seed, step, group, turn ...): reproducible across
    processes, unlike hash()."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class BusyClock:
    """Seconds during which at least one call was in flight (overlapping calls count once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> BusyClock:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._active -= 1
        if self._active == 0:
            self.seconds += time.perf_counter() - self._since

    def take(self) -> float:
        """The seconds counted so far (ongoing calls included), and start again from zero."""
        now = time.perf_counter()
        total = self.seconds + (now - self._since if self._active else 0.0)
        self.seconds = 0.0
        self._since = now
        return total


@dataclasses.dataclass
class Endpoints:
    """The stubs a rollout needs, and their targets (for error messages)."""

    policy: object
    sandbox: object
    policy_target: str = "policy"
    sandbox_target: str = "sandbox"


class Rollouts:
    """Samples and judges episodes; see the module docstring."""

    def __init__(self, endpoints: Endpoints, tokenizer, *, model: str, toolchain: int,
                 sampling: common_pb2.RolloutSampling, options: sandbox_pb2.EvaluateOptions | None = None,
                 max_context_tokens: int = 0, patience: Patience = Patience(), flagged_as_failure: bool = False):
        self.endpoints = endpoints
        self.tokenizer = tokenizer
        self.model = model
        self.toolchain = toolchain
        self.sampling = sampling
        self.options = options or sandbox_pb2.EvaluateOptions()
        self.max_context_tokens = max_context_tokens  # 0: unknown, no turn is refused for length
        self.patience = patience
        self.flagged_as_failure = flagged_as_failure  # a pass whose timing the sandbox flagged counts as a failure
        self.generate_clock = BusyClock()
        self.evaluate_clock = BusyClock()
        self.evaluations = 0

    # --- the two services -------------------------------------------------------------------

    def _sampling(self, n: int, seed: int) -> policy_pb2.SamplingParams:
        return policy_pb2.SamplingParams(n=n, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                         max_new_tokens=self.sampling.max_new_tokens, seed=seed)

    async def _generate(self, prompts_: list[policy_pb2.Prompt], n: int, seed: int) -> list[policy_pb2.Completion]:
        request = policy_pb2.GenerateRequest(model=self.model, prompts=prompts_, sampling=self._sampling(n, seed))
        with self.generate_clock:
            reply = await with_retries(lambda: self.endpoints.policy.Generate(request), "policy",
                                       self.endpoints.policy_target, self.patience, "the generation")
        return list(reply.completions)

    async def judge(self, episodes: Sequence[Episode]) -> None:
        """Evaluate the last turn of each episode in one streamed batch; after a service
        restart only the candidates still without a verdict are sent again. An empty answer
        is judged here (FORMAT): the sandbox refuses empty sources as bad requests."""
        for episode in episodes:
            if not episode.last.text.strip():
                episode.last.verdict = sandbox_pb2.Verdict(stage=Stage.STAGE_FORMAT, task_id=episode.task.id,
                                                           message="the answer is empty")
        pending = {i: e for i, e in enumerate(episodes) if e.last.verdict is None}
        if not pending:
            return

        async def stream() -> None:  # each try sends only what has no verdict yet
            order = list(pending)
            request = sandbox_pb2.EvaluateBatchRequest(options=self.options, candidates=[
                sandbox_pb2.Candidate(task_id=pending[i].task.id, toolchain=self.toolchain, source=pending[i].last.text,
                                      candidate_id=f"{pending[i].task.id}/{pending[i].sample}/{len(pending[i].turns)}")
                for i in order])
            async for reply in self.endpoints.sandbox.EvaluateBatch(request):
                episode = pending.pop(order[reply.index], None)
                if episode is not None:
                    episode.last.verdict = reply.verdict
                    self.evaluations += 1

        with self.evaluate_clock:
            await with_retries(stream, "sandbox", self.endpoints.sandbox_target, self.patience, "the evaluation")
        if pending:
            raise RuntimeError(f"the sandbox ended an EvaluateBatch stream without {len(pending)} of its verdicts")

    # --- turns ------------------------------------------------------------------------------

    def _turn(self, completion: policy_pb2.Completion, prompt_ids: list[int]) -> Turn:
        ended = completion.finish_reason == FinishReason.FINISH_REASON_STOP and len(completion.token_ids) > 0
        return Turn(prompt_ids=prompt_ids, completion_ids=list(completion.token_ids),
                    sampler_logprobs=list(completion.logprobs), text=completion.text,
                    end_token_id=completion.token_ids[-1] if ended else None,
                    weight_version=completion.weight_version, flagged_as_failure=self.flagged_as_failure)

    async def first_turns(self, task: sandbox_pb2.Task, n: int, seed: int) -> list[Episode]:
        """`n` episodes of `task`, each with its first answer judged."""
        opening = prompts.first_turn(task, self.toolchain)
        prompt = policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=opening))
        completions = await self._generate([prompt], n, seed)
        episodes = []
        for completion in sorted(completions, key=lambda c: c.sample_index):
            episode = Episode(task, completion.sample_index, list(opening))
            episode.turns.append(self._turn(completion, list(completion.prompt_token_ids)))
            episodes.append(episode)
        await self.judge(episodes)
        return episodes

    def next_prompt(self, episode: Episode) -> list[int] | None:
        """The token ids of the episode's next turn (everything so far, then the feedback on
        its last verdict), or None when they and an answer would not fit the model's context."""
        last = episode.last
        history = [*episode.messages, prompts.assistant(last.text)]
        feedback = prompts.user(prompts.feedback(last.verdict or sandbox_pb2.Verdict()))
        end_text = self.tokenizer.decode([last.end_token_id]) if last.end_token_id is not None else None
        ids = last.prompt_ids + last.completion_ids + prompts.continuation_ids(self.tokenizer, history, feedback,
                                                                               end_text=end_text)
        if self.max_context_tokens and len(ids) + self.sampling.max_new_tokens > self.max_context_tokens:
            return None
        episode.messages = [*history, feedback]
        return ids

    async def next_turns(self, episodes: Sequence[Episode], seed: int) -> list[Episode]:
        """One more turn for each episode that has room for it: the feedback on its last
        verdict, a new answer (one sample each, in one Generate call), judged. Episodes
        without room are marked out_of_context. Returns the episodes that got a turn."""
        requests: list[tuple[Episode, list[int]]] = []
        for episode in episodes:
            ids = self.next_prompt(episode)
            if ids is None:
                episode.out_of_context = True
            else:
                requests.append((episode, ids))
        if not requests:
            return []
        completions = await self._generate([policy_pb2.Prompt(token_ids=policy_pb2.TokenIds(ids=ids)) for _, ids in requests],
                                           1, seed)
        for completion in completions:
            episode, ids = requests[completion.prompt_index]
            episode.turns.append(self._turn(completion, ids))
        played = [episode for episode, _ in requests]
        await self.judge(played)
        return played
