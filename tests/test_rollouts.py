"""Judging episodes through a real sandbox service (leap.rollouts.Rollouts.judge): verdicts
land on the right episodes, an empty answer is a FORMAT verdict rather than a request the
sandbox refuses, and only real evaluations are counted."""

from __future__ import annotations

import asyncio

from leap import prompts
from leap.clients import connect
from leap.common.v1 import common_pb2
from leap.rollouts import Endpoints, Episode, Rollouts, Turn
from leap.sandbox.v1 import sandbox_pb2
from tests.sandbox_helpers import RELU_LOOP, relu, running_sandbox

Stage = common_pb2.Stage
CPU = common_pb2.Toolchain.TOOLCHAIN_CPU


def episode(sample: int, text: str) -> Episode:
    turn = Turn(prompt_ids=[1], completion_ids=[2], sampler_logprobs=[-0.1], text=text, end_token_id=2, weight_version=1)
    return Episode(sandbox_pb2.Task(id="relu"), sample, [], [turn])


def test_judging_sets_each_episodes_verdict_and_judges_empty_answers_itself(tmp_path):
    episodes = [episode(0, prompts.answer(relu(RELU_LOOP), CPU)), episode(1, "  \n"),
                episode(2, prompts.answer(relu("    y[0] = 1.0f;"), CPU))]
    with running_sandbox(tmp_path, workers=2) as sandbox:
        async def judge() -> int:
            stub = connect("sandbox", sandbox.server.address)
            rollouts = Rollouts(Endpoints(None, stub), None, model="policy", toolchain=CPU,
                                sampling=common_pb2.RolloutSampling(), options=sandbox_pb2.EvaluateOptions(timing=False))
            try:
                await rollouts.judge(episodes)
            finally:
                await stub.channel.close()
            return rollouts.evaluations

        evaluations = asyncio.run(judge())
    stages = [e.last.verdict.stage for e in episodes]
    assert stages == [Stage.STAGE_PASSED, Stage.STAGE_FORMAT, Stage.STAGE_CORRECT]
    assert episodes[1].last.verdict.message == "the answer is empty"
    assert evaluations == 2 and [e.solved for e in episodes] == [True, False, False]


def test_an_episode_whose_next_turn_would_not_fit_the_context_ends_without_a_call(tmp_path):
    """The check is exact: the next prompt's own tokens (with the feedback) plus an answer's
    max_new_tokens against the model's context; the policy is not asked (it would refuse)."""
    from transformers import AutoTokenizer

    from tests.tiny_lm import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    sampling = common_pb2.RolloutSampling(max_new_tokens=100)

    def failed_once() -> Episode:
        played = episode(0, prompts.answer(relu(RELU_LOOP), CPU))
        played.messages = prompts.first_turn(sandbox_pb2.Task(id="relu", title="ReLU"), CPU)
        played.last.verdict = sandbox_pb2.Verdict(stage=Stage.STAGE_COMPILE)
        return played

    def rollouts(context: int) -> Rollouts:
        return Rollouts(Endpoints(None, None), tokenizer, model="policy", toolchain=CPU, sampling=sampling,
                        max_context_tokens=context)

    needed = len(rollouts(0).next_prompt(failed_once())) + 100
    assert rollouts(needed).next_prompt(failed_once()) is not None
    cramped = failed_once()
    assert asyncio.run(rollouts(needed - 1).next_turns([cramped], seed=0)) == []  # no Generate: the stub is None
    assert cramped.out_of_context and len(cramped.turns) == 1
