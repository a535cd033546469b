"""Asynchronous rollouts (RunConfig.max_staleness) end to end, on real `leap serve` processes:
at staleness 1 the first step is the synchronous loop's exactly (same rollouts, same
weights and optimizer state), the next ones train on rollouts the previous weights sampled,
and a trainer killed with a batch generated ahead of the learner resumes exactly."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from leap.clients import connect
from leap.learning.registry import SUCCEEDED
from leap.trainer.v1 import trainer_pb2
from tests.conftest import leap_serve, wait_for
from tests.test_trainer_e2e import (  # noqa: F401 (services is a fixture)
    assert_same_state, checkpoint_state, follow, resumable_config, services, start, train_steps, trainer_flags,
)

pytestmark = pytest.mark.slow


def rollouts(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step-{step:08d}.jsonl").open()]


def async_config(model_dir: Path, steps: int, staleness: int) -> trainer_pb2.RunConfig:
    """resumable_config in single-turn mode (a step is one Generate of the group: the file stays
    small), with a one-turn evaluation of one sample."""
    config = resumable_config(model_dir)
    config.mode, config.max_turns, config.eval_turns = trainer_pb2.TRAIN_MODE_SINGLE, 1, 1
    config.steps, config.max_staleness = steps, staleness
    return config


def run_to_end(runs: Path, services, config) -> tuple[trainer_pb2.Run, list]:
    with leap_serve("trainer", *trainer_flags(runs, services)) as (address, _):
        trainer = connect("trainer", address, aio=False)
        run = start(trainer, config)
        events = follow(trainer, run.run_id)
        done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
    assert done.state == SUCCEEDED, done.error
    return done, events


@pytest.fixture(scope="module")
def whole(services, tiny_model_dir, tmp_path_factory) -> tuple[trainer_pb2.Run, list]:
    """An uninterrupted run at staleness 1: step 1 on the initial weights' rollouts, step 2 on
    rollouts the same weights sampled while the learner took step 1."""
    return run_to_end(tmp_path_factory.mktemp("async"), services, async_config(tiny_model_dir, 2, 1))


def test_staleness_one_starts_as_the_synchronous_loop_then_trains_one_update_behind(services, tiny_model_dir,
                                                                                     tmp_path, whole):
    sync, _ = run_to_end(tmp_path / "sync", services, async_config(tiny_model_dir, 1, 0))
    run, events = whole
    a = Path(run.output_dir)
    # Step 1 trains on rollouts of the initial weights, as the synchronous loop does.
    assert [r["token_ids"] for r in rollouts(a, 1)] == [r["token_ids"] for r in rollouts(Path(sync.output_dir), 1)]
    assert_same_state(checkpoint_state(Path(sync.output_dir), 1), checkpoint_state(a, 1))
    train = {e.step: e.values for e in events if e.kind == "train"}
    assert [train[s]["async/staleness"] for s in (1, 2)] == [0.0, 1.0]
    assert all(train[s]["async/dropped_rollouts"] == 0 for s in (1, 2))
    assert "importance_weight_mean" in train[2] and "importance_weight_mean" not in train[1]
    # Step 2's rollouts were sampled by the weights step 1 also sampled with (one update behind).
    versions = [{t["weight_version"] for r in rollouts(a, s) for t in r["turns"]} for s in (1, 2)]
    assert versions[0] == versions[1] and len(versions[0]) == 1, versions


def test_a_trainer_killed_with_a_batch_generated_ahead_resumes_exactly(services, tiny_model_dir, tmp_path, whole):
    runs = tmp_path / "killed"
    with leap_serve("trainer", *trainer_flags(runs, services)) as (address, process):
        trainer = connect("trainer", address, aio=False)
        killed = start(trainer, async_config(tiny_model_dir, 2, 1))
        first = Path(killed.output_dir) / "checkpoints" / "step-00000001"
        wait_for(first.is_dir, timeout=500, what="the checkpoint of step 1")
        assert (first / "pending.pkl").is_file()  # the batch of step 2, generated ahead, is in it
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with leap_serve("trainer", *trainer_flags(runs, services)) as (address, _):
        trainer = connect("trainer", address, aio=False)
        resumed_events = follow(trainer, killed.run_id)
        resumed = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=killed.run_id)).run
    assert resumed.state == SUCCEEDED and resumed.step == 2, resumed.error
    assert train_steps(resumed_events) == [1, 2]
    a, b = Path(whole[0].output_dir), Path(resumed.output_dir)
    assert [r["token_ids"] for r in rollouts(a, 2)] == [r["token_ids"] for r in rollouts(b, 2)]
    assert_same_state(checkpoint_state(a, 2), checkpoint_state(b, 2))


def test_a_lora_run_pushes_only_its_adapter_and_saves_a_merged_model(services, tiny_model_dir, tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from leap.common.v1 import common_pb2
    from leap.policy.v1 import policy_pb2

    config = async_config(tiny_model_dir, 1, 0)
    config.policy_model = "policy-lora"  # the trainer loads it with the run's adapter shape
    config.lora.CopyFrom(common_pb2.LoraConfig(rank=4, save_merged=True))
    config.optimizer.learning_rate = 1e-2
    run, events = run_to_end(tmp_path, services, config)
    policy = connect("policy", services.policy, aio=False)
    info = policy.GetModel(policy_pb2.GetModelRequest(name="policy-lora")).model
    # The policy saw two pushes (the start, step 1), each of the adapter alone.
    assert info.lora.rank == 4 and info.lora.alpha == 8.0 and info.version == 2
    records = rollouts(Path(run.output_dir), 1)
    item = policy_pb2.ScoreItem(prompt_token_ids=records[0]["token_ids"][:1],
                                completion_token_ids=records[0]["token_ids"][1:])
    served = policy.Score(policy_pb2.ScoreRequest(model="policy-lora", items=[item])).results[0].logprobs
    policy.LoadModel(policy_pb2.LoadModelRequest(name="lora-base", path=str(tiny_model_dir)))
    base = policy.Score(policy_pb2.ScoreRequest(model="lora-base", items=[item])).results[0].logprobs
    policy.UnloadModel(policy_pb2.UnloadModelRequest(name="lora-base"))
    policy.channel.close()
    assert served != base  # the adapter push changed what the policy serves
    merged = AutoModelForCausalLM.from_pretrained(str(Path(run.output_dir) / "merged"))
    assert merged.config.architectures == ["Qwen2ForCausalLM"]
    checkpoint = Path(run.output_dir) / "checkpoints" / "step-00000001"
    assert (checkpoint / "adapter.safetensors").is_file() and (checkpoint / "model" / "model.safetensors").is_file()
