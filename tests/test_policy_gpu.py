"""The policy service on a GPU: the hf backend on CUDA (float32 for exactness, bfloat16 as
served in production) and the vllm backend where the vllm package is installed. Skipped,
with the reason, on machines without an NVIDIA GPU (no mocks: these run for real on one,
through scripts/gpu_checks_policy.sh)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from leap import prompts
from leap.clients.weights import push_weights_blocking
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from svc_policy.server import PolicyConfig, build, vllm_available
from tests.conftest import free_port, task_suite

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda is not available)")]


@pytest.fixture(scope="module")
def stub():
    config = PolicyConfig(port=free_port(), drain_seconds=0.0)
    with BackgroundServer(build(config), config) as server:
        channel = grpc.insecure_channel(server.address)
        yield policy_pb2_grpc.PolicyServiceStub(channel)
        channel.close()


def load(stub, name, path, **fields) -> policy_pb2.ModelInfo:
    return stub.LoadModel(policy_pb2.LoadModelRequest(name=name, path=str(path), **fields), timeout=600).model


def request(model: str, **sampling) -> policy_pb2.GenerateRequest:
    tasks = [t for t in task_suite() if t.split == "train"][:4]
    sampling = {"n": 4, "seed": 3, "max_new_tokens": 200, **sampling}
    return policy_pb2.GenerateRequest(model=model, sampling=policy_pb2.SamplingParams(**sampling), prompts=[
        policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t))) for t in tasks])


def items(response) -> list[policy_pb2.ScoreItem]:
    return [policy_pb2.ScoreItem(prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids)
            for c in response.completions]


def test_hf_on_cuda_float32_matches_cpu(stub, tiny_model_dir):
    gpu = load(stub, "gpu-f32", tiny_model_dir, device="cuda", dtype="float32")
    assert gpu.device.startswith("cuda") and gpu.dtype == "float32"
    load(stub, "cpu-f32", tiny_model_dir, device="cpu")
    response = stub.Generate(request("gpu-f32"), timeout=600)
    again = stub.Generate(request("gpu-f32"), timeout=600)
    assert [list(c.token_ids) for c in response.completions] == [list(c.token_ids) for c in again.completions]
    on_gpu = stub.Score(policy_pb2.ScoreRequest(model="gpu-f32", items=items(response)), timeout=600).results
    on_cpu = stub.Score(policy_pb2.ScoreRequest(model="cpu-f32", items=items(response)), timeout=600).results
    for c, a, b in zip(response.completions, on_gpu, on_cpu):
        np.testing.assert_allclose(c.logprobs, a.logprobs, atol=1e-3)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-3)


def test_hf_on_cuda_bfloat16_generates_scores_and_updates(stub, tiny_model_dir):
    from safetensors.torch import load_file

    info = load(stub, "gpu-bf16", tiny_model_dir, device="cuda")  # the GPU default dtype
    assert info.dtype == "bfloat16"
    response = stub.Generate(request("gpu-bf16"), timeout=600)
    scores = stub.Score(policy_pb2.ScoreRequest(model="gpu-bf16", items=items(response)), timeout=600).results
    for c, s in zip(response.completions, scores):
        np.testing.assert_allclose(c.logprobs, s.logprobs, atol=0.1)  # bf16: decode and full pass round differently
    weights = load_file(str(tiny_model_dir / "model.safetensors"))  # float32: cast to bfloat16 by the helper
    reply = push_weights_blocking(stub, "gpu-bf16", 1, {k: v * 1.5 for k, v in weights.items()})
    assert reply.version == 1
    assert stub.Generate(request("gpu-bf16"), timeout=600).weight_version == 1


@pytest.mark.skipif(bool(vllm_available()), reason=f"the vllm package is not importable here: {vllm_available()}")
def test_vllm_on_cuda_generates_scores_and_updates(stub, tiny_model_dir):
    from safetensors.torch import load_file

    info = load(stub, "vllm", tiny_model_dir, backend=policy_pb2.Backend.BACKEND_VLLM, dtype="float32")
    assert info.backend == policy_pb2.Backend.BACKEND_VLLM and info.device.startswith("cuda")
    response = stub.Generate(request("vllm"), timeout=600)
    again = stub.Generate(request("vllm"), timeout=600)
    assert [list(c.token_ids) for c in response.completions] == [list(c.token_ids) for c in again.completions]
    load(stub, "reference", tiny_model_dir, device="cuda", dtype="float32")
    exact = stub.Score(policy_pb2.ScoreRequest(model="reference", items=items(response)), timeout=600).results
    for c, s in zip(response.completions, exact):
        np.testing.assert_allclose(c.logprobs, s.logprobs, atol=2e-3)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    assert push_weights_blocking(stub, "vllm", 1, {k: v * 1.5 for k, v in weights.items()}).version == 1
    after = stub.Generate(request("vllm"), timeout=600)
    assert after.weight_version == 1
    assert [list(c.token_ids) for c in after.completions] != [list(c.token_ids) for c in response.completions]
