"""From episodes to reward requests and learner sequences (svc_trainer.batch), by hand."""

from __future__ import annotations

import pytest

from leap.common.v1 import common_pb2
from leap.reward.v1 import reward_pb2
from leap.rollouts import Episode, Turn
from leap.sandbox.v1 import sandbox_pb2
from svc_trainer import batch

Stage = common_pb2.Stage
TASK = sandbox_pb2.Task(id="relu")


def turn(prompt, completion, stage, speedup=0.0, logprobs=None):
    return Turn(prompt_ids=prompt, completion_ids=completion, sampler_logprobs=logprobs or [-0.5] * len(completion),
                text="```cpp\n...\n```", end_token_id=completion[-1], weight_version=1,
                verdict=sandbox_pb2.Verdict(stage=stage, speedup=speedup))


def two_turn_episode() -> Episode:
    """Prompt [1, 2], answer [3, 4] (compile error), feedback [5], answer [6] (passed, 2x)."""
    first = turn([1, 2], [3, 4], Stage.STAGE_COMPILE)
    second = turn([1, 2, 3, 4, 5], [6], Stage.STAGE_PASSED, speedup=2.0, logprobs=[-0.25])
    return Episode(TASK, 0, [], [first, second])


def test_the_sequence_marks_each_turns_own_tokens_and_its_advantage():
    sequence, sampler = batch.training_sequence(two_turn_episode(), [0.25, 1.0])
    assert sequence.token_ids == [1, 2, 3, 4, 5, 6]
    assert sequence.loss_mask == [0, 0, 1, 1, 0, 1]  # prompt and feedback are masked
    assert sequence.values["advantages"] == [0.0, 0.0, 0.25, 0.25, 0.0, 1.0]
    assert sampler == [0.0, 0.0, -0.5, -0.5, 0.0, -0.25]
    with pytest.raises(ValueError, match="2 turns"):
        batch.training_sequence(two_turn_episode(), [1.0])


def test_gate_and_rank_groups_carry_stages_speedups_and_token_counts():
    episodes = [two_turn_episode(), Episode(TASK, 1, [], [turn([1, 2], [7, 8, 9], Stage.STAGE_PASSED, speedup=1.5)])]
    gate = batch.gate_group("relu", episodes)
    assert [r.stage for r in gate.rollouts] == [Stage.STAGE_COMPILE, Stage.STAGE_PASSED]
    assert not gate.rollouts[0].HasField("speedup") and gate.rollouts[1].speedup == 1.5
    rank = batch.rank_group("relu", episodes)
    first = rank.trajectories[0].turns
    assert [t.stage for t in first] == [Stage.STAGE_COMPILE, Stage.STAGE_PASSED]
    assert [t.generated_tokens for t in first] == [2, 1] and first[1].speedup == 2.0
    assert not first[0].HasField("speedup")  # a failing turn's speedup is not sent


def flagged_turn(flag, as_failure: bool = False) -> Turn:
    flagged = turn([1, 2], [3], Stage.STAGE_PASSED, speedup=40.0)
    flagged.verdict.speedup_low, flagged.verdict.speedup_high = 30.0, 50.0
    flagged.verdict.flags.append(flag)
    flagged.flagged_as_failure = as_failure
    return flagged


def test_a_flagged_pass_is_ranked_without_speed_credit_and_gated_as_untimed():
    flagged = flagged_turn(sandbox_pb2.VERDICT_FLAG_SUSPICIOUS_SPEEDUP)
    honest = turn([1, 2], [3], Stage.STAGE_PASSED, speedup=1.5)
    honest.verdict.speedup_low, honest.verdict.speedup_high = 1.3, 1.7
    episodes = [Episode(TASK, 0, [], [flagged]), Episode(TASK, 1, [], [honest])]
    rank = batch.rank_group("relu", episodes)
    sent = rank.trajectories[0].turns[0]
    assert sent.stage == Stage.STAGE_PASSED and sent.speedup == 40.0 and sent.speedup_flagged
    assert (sent.speedup_low, sent.speedup_high) == (30.0, 50.0)
    other = rank.trajectories[1].turns[0]
    assert not other.speedup_flagged and (other.speedup_low, other.speedup_high) == (1.3, 1.7)
    gate = batch.gate_group("relu", episodes)
    assert not gate.rollouts[0].HasField("speedup") and gate.rollouts[1].speedup == 1.5
    assert episodes[0].best_speedup == 0.0  # improve_below_speedup never sees a flagged speedup
    assert batch.continues(episodes[0], improve_below_speedup=2.0) is False  # solved, no speed to improve
    ranked = reward_pb2.RankResponse(results=[reward_pb2.RankResult(task_id="relu", trajectories=[
        reward_pb2.TrajectoryReward(turn_advantages=[0.0]), reward_pb2.TrajectoryReward(turn_advantages=[0.0])])])
    kept, _ = batch.rollout_records(1, [("relu", episodes)], ranked)  # the flagged rollout is logged, flags and all
    assert kept["turns"][0]["flags"] == ["SUSPICIOUS_SPEEDUP"] and kept["turns"][0]["speedup_interval"] == [30.0, 50.0]


def test_a_flagged_pass_can_count_as_a_failure():
    demoted = flagged_turn(sandbox_pb2.VERDICT_FLAG_TIMING_UNRELIABLE, as_failure=True)
    outcome = demoted.outcome
    assert not outcome.correct and outcome.stage == Stage.STAGE_CORRECT and outcome.unreliable
    episode = Episode(TASK, 0, [], [demoted])
    assert not episode.solved and batch.continues(episode, improve_below_speedup=0.0)
    (sent,) = batch.rank_group("relu", [episode, episode]).trajectories[0].turns
    assert sent.stage == Stage.STAGE_CORRECT and not sent.HasField("speedup")


def test_an_expanded_rollout_continues_while_unsolved_or_slower_than_the_target():
    unsolved = Episode(TASK, 0, [], [turn([1], [2], Stage.STAGE_CORRECT)])
    slow = Episode(TASK, 1, [], [turn([1], [2], Stage.STAGE_PASSED, speedup=0.8)])
    untimed = Episode(TASK, 2, [], [turn([1], [2], Stage.STAGE_PASSED, speedup=0.0)])
    assert batch.continues(unsolved, 0.0)
    assert not batch.continues(slow, 0.0) and batch.continues(slow, 1.0) and not batch.continues(slow, 0.5)
    assert not batch.continues(untimed, 1.0)


def test_sequences_without_signal_and_the_logprob_gap():
    with_signal, sampler = batch.training_sequence(two_turn_episode(), [0.0, 1.0])
    tied, _ = batch.training_sequence(two_turn_episode(), [0.0, 0.0])
    assert batch.carries_signal(with_signal) and not batch.carries_signal(tied)
    learner = [[0.0, 0.0, -0.5, -0.75, 9.0, -0.25]]  # position 4 is feedback: not counted
    gap = batch.logprob_gap([with_signal], [sampler], learner)
    assert gap == {"logprob_gap/mean_abs": pytest.approx(0.25 / 3), "logprob_gap/max_abs": 0.25}


def test_the_learning_batch_drops_tied_sequences_but_normalizes_by_every_generated_token():
    with_signal = batch.training_sequence(two_turn_episode(), [0.0, 1.0])  # 3 generated tokens
    tied = batch.training_sequence(two_turn_episode(), [0.0, 0.0])  # 3 more, no gradient
    kept, normalizer = batch.learning_batch([with_signal, tied], kl=False)
    assert [seq for seq, _ in kept] == [with_signal[0]]
    assert (normalizer.tokens, normalizer.sequences) == (6.0, 2.0)
    kept, normalizer = batch.learning_batch([with_signal, tied], kl=True)  # a KL term: the tied one trains too
    assert len(kept) == 2 and normalizer.tokens == 6.0


def test_rollout_records_describe_each_trajectory():
    ranked = reward_pb2.RankResponse(results=[reward_pb2.RankResult(task_id="relu", trajectories=[
        reward_pb2.TrajectoryReward(reward=1.0, advantage=1.0, turn_advantages=[1.0, 1.0])])])
    (record,) = batch.rollout_records(3, [("relu", [two_turn_episode()])], ranked, tokens=True)
    assert record["step"] == 3 and record["task_id"] == "relu" and record["reward"] == 1.0
    assert [t["stage"] for t in record["turns"]] == ["STAGE_COMPILE", "STAGE_PASSED"]
    assert record["solved_by_turn"] == [False, True]
    assert record["token_ids"] == [1, 2, 3, 4, 5, 6] and record["owner"] == [-1, -1, 0, 0, -1, 1]
    assert record["sampler_logprobs"] == [0.0, 0.0, -0.5, -0.5, 0.0, -0.25]
    (text_only,) = batch.rollout_records(3, [("relu", [two_turn_episode()])], ranked)
    assert "token_ids" not in text_only


class ShortReward:
    """The edge of the reward contract that a real service never shows: a Gate reply with
    fewer decisions than groups (stands in for Services, which the GroupGate calls)."""

    async def call(self, service, rpc, request):
        return reward_pb2.GateResponse(decisions=[reward_pb2.GateDecision(task_id="only")] * (len(request.groups) - 1))


@pytest.mark.parametrize("mode", [reward_pb2.GATE_MODE_STATIC, reward_pb2.GATE_MODE_ADAPTIVE])
def test_a_gate_reply_short_of_decisions_fails_the_run_naming_the_count(mode):
    import asyncio

    from leap.learning.registry import RunFailure
    from svc_trainer.job import GroupGate

    async def decide_two():
        gate = GroupGate(ShortReward(), reward_pb2.GateConfig(mode=mode), groups=2)
        return await asyncio.gather(*(gate.decide(i, reward_pb2.GateGroup(task_id=f"t{i}")) for i in range(2)))

    expected = "0 Gate decisions for 1 groups" if mode == reward_pb2.GATE_MODE_STATIC else "1 Gate decisions for 2"
    with pytest.raises(RunFailure, match=expected):
        asyncio.run(decide_two())
