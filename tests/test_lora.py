"""LoRA: a learner that trains only a PEFT adapter (and resumes exactly from a checkpoint),
its merged save that `from_pretrained` loads, and a policy service (real gRPC, in this
process) that serves base + adapter and takes a push of the adapter alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from leap.clients import connect
from leap.clients.transports import WeightPusher
from leap.common.v1 import common_pb2
from leap.learning import Learner, LearnerSettings, with_values
from leap.learning.lora import LoraSettings, adapter_state
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from svc_policy.server import PolicyConfig, build
from svc_trainer.losses import GrpoLossConfig, GrpoObjective
from tests.conftest import free_port
from tests.learning_cases import SETTINGS_KW, grpo_batch

pytest.importorskip("peft")
LORA = LoraSettings(rank=4, alpha=8.0)


def lora_learner(model_dir) -> Learner:
    return Learner(LearnerSettings(str(model_dir), lora=LORA, **SETTINGS_KW))


def step(learner: Learner, sequences) -> None:
    old = learner.logprobs(sequences)
    learner.train_step(with_values(sequences, old_logprobs=old), GrpoObjective(GrpoLossConfig()))


def test_a_lora_learner_trains_the_adapter_alone_saves_a_merged_model_and_resumes_exactly(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = grpo_batch()
    learner = lora_learner(tiny_model_dir)
    base = {k: v.clone() for k, v in learner.full_state_dict().items()}
    trainable = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    step(learner, batch)
    adapter = adapter_state(learner.model)
    merged = learner.full_state_dict()
    assert set(merged) == set(base) and any(not torch.equal(merged[k], base[k]) for k in base)
    full_bytes = sum(t.nbytes for t in merged.values())
    assert sum(t.nbytes for t in adapter.values()) < 0.1 * full_bytes  # a push is a fraction of the model
    # The merged save loads as a plain Hugging Face model and computes what the adapter does.
    learner.save_model(str(tmp_path / "merged"))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = torch.tensor([batch[0].token_ids])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, learner.model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    # Checkpoint, go on one step; a second learner resumed from the checkpoint takes the same step.
    info = learner.save_checkpoint(tmp_path / "checkpoints", step=1)
    step(learner, grpo_batch(seed=1))
    resumed = lora_learner(tiny_model_dir)
    resumed.load_checkpoint(info.path)
    step(resumed, grpo_batch(seed=1))
    for name, tensor in adapter_state(learner.model).items():
        assert torch.equal(tensor, adapter_state(resumed.model)[name]), name
    learner.close()
    resumed.close()


@pytest.fixture(scope="module")
def server():
    config = PolicyConfig(port=free_port(), drain_seconds=0.0)
    running = BackgroundServer(build(config), config).start()
    yield running
    running.stop()


def scores(stub, model: str, ids: list[int]) -> list[float]:
    request = policy_pb2.ScoreRequest(model=model, items=[policy_pb2.ScoreItem(prompt_token_ids=ids[:4],
                                                                                completion_token_ids=ids[4:])])
    return list(stub.Score(request, timeout=60).results[0].logprobs)


def test_an_adapter_push_changes_what_the_policy_serves_exactly_as_the_merged_weights_would(server, tiny_model_dir):
    channel = grpc.insecure_channel(server.address)
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    lora = common_pb2.LoraConfig(rank=LORA.rank, alpha=LORA.alpha)
    info = stub.LoadModel(policy_pb2.LoadModelRequest(name="adapted", path=str(tiny_model_dir), lora=lora),
                          timeout=60).model
    assert info.lora.rank == 4 and info.lora.alpha == 8.0 and "q_proj" in info.lora.target_modules
    stub.LoadModel(policy_pb2.LoadModelRequest(name="plain", path=str(tiny_model_dir)), timeout=60)
    ids = grpo_batch()[0].token_ids
    assert scores(stub, "adapted", ids) == scores(stub, "plain", ids)  # a fresh adapter is zero

    learner = lora_learner(tiny_model_dir)
    step(learner, grpo_batch())
    adapter = learner.push_state(info.lora)
    assert set(adapter) == set(adapter_state(learner.model))  # the served shape matches: the adapter alone
    merged = learner.push_state(None)  # a policy without the adapter gets the merged weights

    async def push():
        async_stub = connect("policy", server.address)
        pushers = [WeightPusher(async_stub, "adapted"), WeightPusher(async_stub, "plain")]
        try:
            a = await pushers[0].push(1, adapter)
            b = await pushers[1].push(1, merged)
        finally:
            for pusher in pushers:
                await pusher.close()
            await async_stub.channel.close()
        return a, b

    a, b = asyncio.run(push())
    assert a.tensors == len(adapter) and a.bytes < 0.1 * b.bytes
    adapted, plain = scores(stub, "adapted", ids), scores(stub, "plain", ids)
    torch.testing.assert_close(torch.tensor(adapted), torch.tensor(plain), rtol=0, atol=1e-5)
    with torch.no_grad():
        expected = learner.logprobs([grpo_batch()[0]])[0][4:]
    assert max(abs(x - y) for x, y in zip(adapted, expected)) < 1e-4
    learner.close()
    for name in ("adapted", "plain"):
        stub.UnloadModel(policy_pb2.UnloadModelRequest(name=name), timeout=60)
    channel.close()
