"""PolicyService over real gRPC with the bootstrapped tiny model (hf backend): seeded
reproducibility, logprobs against Score, batching invariance, stop strings, token-level
multi-turn prompts, streaming, and the statuses of bad requests."""

from __future__ import annotations

import concurrent.futures

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2

from leap import prompts
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from leap.runtime.errors import details_of
from svc_policy.server import PolicyConfig, build
from tests.conftest import free_port, task_suite

FinishReason = policy_pb2.FinishReason


def start_policy(model_dir, **settings) -> BackgroundServer:
    config = PolicyConfig(port=free_port(), drain_seconds=0.0, models=[f"policy={model_dir}"], **settings)
    return BackgroundServer(build(config), config).start()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_policy(tiny_model_dir)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield policy_pb2_grpc.PolicyServiceStub(channel)
    channel.close()


def task_prompts(count: int = 3) -> list[policy_pb2.Prompt]:
    tasks = [t for t in task_suite() if t.split == "train"][:count]
    return [policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(t))) for t in tasks]


def generate(stub, prompt_list, **sampling) -> policy_pb2.GenerateResponse:
    sampling.setdefault("max_new_tokens", 48)
    request = policy_pb2.GenerateRequest(model="policy", prompts=prompt_list, sampling=policy_pb2.SamplingParams(**sampling))
    return stub.Generate(request, timeout=120)


def samples(response) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(c.prompt_index, c.sample_index, tuple(c.token_ids)) for c in response.completions]


def bad_fields(error: grpc.RpcError) -> list[str]:
    (bad_request,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    return [v.field for v in bad_request.field_violations]


def test_model_info_describes_the_tiny_model(stub):
    (info,) = stub.ListModels(policy_pb2.ListModelsRequest(), timeout=10).models
    assert info == stub.GetModel(policy_pb2.GetModelRequest(name="policy"), timeout=10).model
    assert info.name == "policy" and info.version == 0 and info.backend == policy_pb2.Backend.BACKEND_HF
    assert info.architecture == "Qwen2ForCausalLM" and info.device == "cpu" and info.dtype == "float32"
    assert 100_000 < info.num_parameters < 5_000_000 and info.has_chat_template
    assert info.max_context_tokens >= 1024 and len(info.tokenizer_fingerprint) == 64
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(info.path)
    assert list(info.eos_token_ids) == [tokenizer.convert_tokens_to_ids(prompts.END_OF_TURN)]


def test_sampling_is_reproducible_with_a_seed(stub):
    first = generate(stub, task_prompts(), n=3, seed=11, max_new_tokens=200)
    again = generate(stub, task_prompts(), n=3, seed=11, max_new_tokens=200)
    other = generate(stub, task_prompts(), n=3, seed=12, max_new_tokens=200)
    assert samples(first) == samples(again)
    assert [list(c.logprobs) for c in first.completions] == [list(c.logprobs) for c in again.completions]
    assert samples(first) != samples(other)
    # The n samples of one prompt differ from each other (their streams are independent).
    assert len({tuple(c.token_ids) for c in first.completions}) > 1


def test_completions_are_ordered_and_complete(stub):
    response = generate(stub, task_prompts(2), n=3, seed=1)
    assert [(c.prompt_index, c.sample_index) for c in response.completions] == [(i, j) for i in range(2) for j in range(3)]
    for c in response.completions:
        assert len(c.logprobs) == len(c.token_ids) == c.usage.completion_tokens
        assert c.usage.prompt_tokens == len(c.prompt_token_ids) > 0
        assert c.weight_version == response.weight_version == 0
        assert all(lp <= 0.0 for lp in c.logprobs)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 8, 0.9)])
def test_generate_logprobs_match_score(stub, temperature, top_k, top_p):
    response = generate(stub, task_prompts(), n=2, seed=5, temperature=temperature, top_k=top_k, top_p=top_p)
    items = [policy_pb2.ScoreItem(prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids)
             for c in response.completions]
    same = stub.Score(policy_pb2.ScoreRequest(model="policy", items=items, temperature=temperature, top_k=top_k,
                                              top_p=top_p), timeout=60)
    untruncated = stub.Score(policy_pb2.ScoreRequest(model="policy", items=items, temperature=temperature), timeout=60)
    assert same.weight_version == 0
    for c, exact, plain in zip(response.completions, same.results, untruncated.results):
        np.testing.assert_allclose(c.logprobs, exact.logprobs, atol=1e-4)
        # Truncation renormalizes over the kept tokens, so it can only raise a kept token's logprob.
        assert all(g >= p - 1e-4 for g, p in zip(c.logprobs, plain.logprobs))
        if top_k == 0 and top_p == 1.0:
            np.testing.assert_allclose(c.logprobs, plain.logprobs, atol=1e-4)


def test_batching_does_not_change_results(tiny_model_dir, stub):
    """The same request alone, alongside concurrent requests, and on a server that decodes
    one sequence at a time gives the same tokens (and logprobs up to rounding)."""
    alone = generate(stub, task_prompts(), n=2, seed=21)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(generate, stub, task_prompts(), n=3, seed=100 + k, max_new_tokens=24 + 8 * k)
                  for k in range(3)]
        crowded = pool.submit(generate, stub, task_prompts(), n=2, seed=21).result()
        for other in others:
            other.result()
    assert samples(crowded) == samples(alone)
    serial_server = start_policy(tiny_model_dir, max_batch_sequences=1)
    try:
        with grpc.insecure_channel(serial_server.address) as channel:
            serial = generate(policy_pb2_grpc.PolicyServiceStub(channel), task_prompts(), n=2, seed=21)
    finally:
        serial_server.stop()
    assert samples(serial) == samples(alone)
    for a, b in zip(alone.completions, serial.completions):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_stop_strings_stop(stub):
    free = generate(stub, task_prompts(), n=2, seed=3, max_new_tokens=64)
    stopped = generate(stub, task_prompts(), n=2, seed=3, max_new_tokens=64, stop=["{"])
    hits = 0
    for a, b in zip(free.completions, stopped.completions):
        if "{" not in a.text:
            assert list(b.token_ids) == list(a.token_ids)
            continue
        hits += 1
        assert b.finish_reason == FinishReason.FINISH_REASON_STOP
        assert b.text == a.text[: a.text.index("{") + 1]  # cut right after the stop string, which is kept
        assert list(b.token_ids) == list(a.token_ids)[: len(b.token_ids)]  # the same sample, ended early
        assert len(b.token_ids) < len(a.token_ids)
    assert hits > 0, "no completion contained the stop string: choose another"


def test_stop_token_ids_and_the_end_of_turn_token(stub, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    end = tokenizer.convert_tokens_to_ids(prompts.END_OF_TURN)
    response = generate(stub, task_prompts(), n=2, seed=9, max_new_tokens=400)
    ended = [c for c in response.completions if c.finish_reason == FinishReason.FINISH_REASON_STOP]
    assert ended, "the warm-started model should end its answers"
    for c in ended:
        assert c.token_ids[-1] == end and end not in c.token_ids[:-1]
        assert prompts.END_OF_TURN not in c.text and c.text == tokenizer.decode(c.token_ids[:-1])
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    cut = generate(stub, task_prompts(), n=2, seed=9, stop_token_ids=[newline])
    for c in cut.completions:
        assert c.finish_reason == FinishReason.FINISH_REASON_STOP and c.token_ids[-1] == newline
    capped = generate(stub, task_prompts(1), seed=9, max_new_tokens=5)
    assert [len(c.token_ids) for c in capped.completions] == [5]
    assert capped.completions[0].finish_reason == FinishReason.FINISH_REASON_LENGTH


def test_greedy_decoding_is_the_argmax_of_score(stub):
    response = generate(stub, task_prompts(1), n=2, temperature=0.0, max_new_tokens=16)
    first, second = response.completions
    assert list(first.token_ids) == list(second.token_ids)  # no randomness at temperature 0
    scored = stub.Score(policy_pb2.ScoreRequest(model="policy", items=[policy_pb2.ScoreItem(
        prompt_token_ids=first.prompt_token_ids, completion_token_ids=first.token_ids)]), timeout=60)
    np.testing.assert_allclose(first.logprobs, scored.results[0].logprobs, atol=1e-4)


def test_token_id_prompts_continue_a_dialogue_exactly(stub, tiny_model_dir):
    """Turn 2 of a rollout: the previous prompt ids + the sampled ids + the continuation's ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (turn1,) = generate(stub, task_prompts(1), seed=4, max_new_tokens=400).completions
    history = [*task_prompts(1)[0].chat.messages, prompts.assistant(turn1.text)]
    feedback = prompts.user("Compilation failed:\nkernel.cpp:3:5: error: expected ';' Fix the code.")
    extra = tokenizer(prompts.continuation_text(tokenizer, history, feedback), add_special_tokens=False)["input_ids"]
    ids = [*turn1.prompt_token_ids, *turn1.token_ids, *extra]
    (turn2,) = generate(stub, [policy_pb2.Prompt(token_ids=policy_pb2.TokenIds(ids=ids))], seed=4).completions
    assert list(turn2.prompt_token_ids) == ids
    if turn1.finish_reason == FinishReason.FINISH_REASON_STOP:  # ended on <|end|>: the text is the template's
        # (the ids need not be: the model may spell its answer with other tokens than the
        # tokenizer would, which is why later turns are sent as ids)
        whole = tokenizer.apply_chat_template(prompts.as_dicts([*history, feedback]), tokenize=False,
                                              add_generation_prompt=True)
        assert tokenizer.decode(ids) == whole


def test_generate_stream_yields_every_completion_once(stub):
    request = policy_pb2.GenerateStreamRequest(model="policy", prompts=task_prompts(2),
                                               sampling=policy_pb2.SamplingParams(n=2, seed=8, max_new_tokens=32))
    streamed = [r.completion for r in stub.GenerateStream(request, timeout=120)]
    unary = generate(stub, task_prompts(2), n=2, seed=8, max_new_tokens=32)
    assert sorted(samples(policy_pb2.GenerateResponse(completions=streamed))) == samples(unary)


def test_text_prompts_are_tokenized_as_is(stub):
    (c,) = generate(stub, [policy_pb2.Prompt(text="extern \"C\" void")], seed=1, max_new_tokens=8).completions
    assert c.usage.prompt_tokens == len(c.prompt_token_ids) > 1


@pytest.mark.parametrize("request_fields, field", [
    ({"prompts": []}, "prompts"),
    ({"sampling": {"n": -1, "max_new_tokens": 4}}, "sampling.n"),
    ({"sampling": {"n": 65, "max_new_tokens": 4}}, "sampling.n"),
    ({"sampling": {"max_new_tokens": 0}}, "sampling.max_new_tokens"),
    ({"sampling": {"max_new_tokens": 1_000_000}}, "sampling.max_new_tokens"),
    ({"sampling": {"max_new_tokens": 4, "temperature": -1}}, "sampling.temperature"),
    ({"sampling": {"max_new_tokens": 4, "top_p": 0}}, "sampling.top_p"),
    ({"sampling": {"max_new_tokens": 4, "stop": [""]}}, "sampling.stop[0]"),
    ({"sampling": {"max_new_tokens": 4, "stop_token_ids": [10**8]}}, "sampling.stop_token_ids[0]"),
    ({"prompts": [{"text": ""}]}, "prompts[0].text"),
    ({"prompts": [{}]}, "prompts[0]"),
    ({"prompts": [{"token_ids": {"ids": []}}]}, "prompts[0].token_ids.ids"),
    ({"prompts": [{"token_ids": {"ids": [1, 10**8]}}]}, "prompts[0].token_ids.ids[1]"),
    ({"prompts": [{"chat": {"messages": [{"role": "robot", "content": "hi"}]}}]}, "prompts[0].chat.messages[0].role"),
    ({"prompts": [{"token_ids": {"ids": [1] * 2000}}], "sampling": {"max_new_tokens": 100}}, "prompts[0]"),
])
def test_bad_generate_requests_name_the_field(stub, request_fields, field):
    from google.protobuf import json_format

    body = {"model": "policy", "prompts": [{"text": "int"}], "sampling": {"max_new_tokens": 4}, **request_fields}
    request = json_format.ParseDict(body, policy_pb2.GenerateRequest())
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in bad_fields(caught.value)


def test_unknown_model_is_not_found(stub):
    for call, request in [
        (stub.Generate, policy_pb2.GenerateRequest(model="nope", prompts=task_prompts(1))),
        (stub.Score, policy_pb2.ScoreRequest(model="nope")),
        (stub.GetModel, policy_pb2.GetModelRequest(name="nope")),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            call(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "nope" in caught.value.details()


@pytest.mark.parametrize("item, field", [
    ({"prompt_token_ids": [], "completion_token_ids": [1]}, "items[0].prompt_token_ids"),
    ({"prompt_token_ids": [1], "completion_token_ids": []}, "items[0].completion_token_ids"),
    ({"prompt_token_ids": [1], "completion_token_ids": [10**8]}, "items[0].completion_token_ids[0]"),
    ({"prompt_token_ids": [1] * 3000, "completion_token_ids": [1]}, "items[0]"),
])
def test_bad_score_requests_name_the_field(stub, item, field):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(policy_pb2.ScoreRequest(model="policy", items=[policy_pb2.ScoreItem(**item)]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in bad_fields(caught.value)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Score(policy_pb2.ScoreRequest(model="policy", temperature=0.0, items=[
            policy_pb2.ScoreItem(prompt_token_ids=[1], completion_token_ids=[2])]), timeout=10)
    assert bad_fields(caught.value) == ["temperature"]


def test_score_batches_items_of_different_lengths_like_one_at_a_time(stub):
    response = generate(stub, task_prompts(), seed=2, max_new_tokens=40)
    items = [policy_pb2.ScoreItem(prompt_token_ids=c.prompt_token_ids[: 30 + 7 * k], completion_token_ids=c.token_ids)
             for k, c in enumerate(response.completions)]
    together = stub.Score(policy_pb2.ScoreRequest(model="policy", items=items), timeout=60).results
    for item, batched in zip(items, together):
        (single,) = stub.Score(policy_pb2.ScoreRequest(model="policy", items=[item]), timeout=60).results
        assert len(single.logprobs) == len(item.completion_token_ids)
        np.testing.assert_allclose(batched.logprobs, single.logprobs, atol=1e-4)
