"""Bad input to the policy service is INVALID_ARGUMENT naming the field, never INTERNAL:
twelve broken weight streams (undecodable or non-finite tensors among them) that leave the
old weights serving, a 5,000-character model path, and sampling and scoring numbers out of
range. Over real gRPC, on the bootstrapped tiny model (tests/test_policy_weights.py has the
stream corruptions a CRC or a shape catches)."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from leap.clients.weights import crc32, update_requests
from leap.common.v1 import common_pb2
from leap.policy.v1 import policy_pb2
from leap.runtime.errors import violated_fields
from tests.test_policy_weights import first_turn_request, model, server, stub, tokens, version_of, weights  # noqa: F401

pytestmark = pytest.mark.usefixtures("server")


def chunk_of(name: str, tensor: torch.Tensor, **changes) -> policy_pb2.TensorChunk:
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    chunk = policy_pb2.TensorChunk(name=name, dtype=common_pb2.DType.D_TYPE_FLOAT32, shape=list(tensor.shape),
                                   offset=0, data=data, crc32=crc32(data))
    for key, value in changes.items():
        if key == "data":
            chunk.data, chunk.crc32 = value, crc32(value)
        elif key == "shape":
            del chunk.shape[:]
            chunk.shape.extend(value)
        else:
            setattr(chunk, key, value)
    return chunk


def stream(model_name: str, weights, case: str) -> tuple[list[policy_pb2.UpdateWeightsRequest], str]:  # noqa: F811
    """A broken UpdateWeights stream of `case` and the field the service must name."""
    name = "model.norm.weight"
    tensor = weights[name].float()
    first = policy_pb2.UpdateWeightsRequest(model=model_name, version=1)
    commit = policy_pb2.UpdateWeightsRequest(commit=True)

    def with_chunk(chunk):
        message = policy_pb2.UpdateWeightsRequest()
        message.CopyFrom(first)
        message.chunk.CopyFrom(chunk)
        return message

    if case == "unknown dtype":
        return [with_chunk(chunk_of(name, tensor, dtype=99)), commit], "messages[0].chunk.dtype"
    if case == "bytes past the tensor's end":
        return [with_chunk(chunk_of(name, tensor, data=tensor.numpy().tobytes() + b"\0\0\0\0")), commit], \
            "messages[0].chunk.data"
    if case == "negative offset":
        return [with_chunk(chunk_of(name, tensor, offset=-4)), commit], "messages[0].chunk.offset"
    if case == "a chunk sent twice":
        half = tensor.numpy().tobytes()[:8]
        return [with_chunk(chunk_of(name, tensor, data=half)), policy_pb2.UpdateWeightsRequest(
            chunk=chunk_of(name, tensor, data=half)), commit], "messages[1].chunk.offset"
    if case == "part of an element, then commit":
        return [with_chunk(chunk_of(name, tensor, data=tensor.numpy().tobytes()[:3])), commit], "commit"
    if case == "empty stream":
        return [], "messages"
    if case == "commit without a tensor":
        return [policy_pb2.UpdateWeightsRequest(model=model_name, version=1, commit=True)], "chunk"
    if case == "no model in the first message":
        return [policy_pb2.UpdateWeightsRequest(version=1, chunk=chunk_of(name, tensor)), commit], "messages[0].model"
    if case == "negative dimension":
        return [with_chunk(chunk_of(name, tensor, shape=[-1, *tensor.shape])), commit], "messages[0].chunk.shape"
    if case == "NaN values":
        bad = tensor.clone()
        bad[3] = math.nan
        return [with_chunk(chunk_of(name, bad)), commit], "messages[0].chunk.data"
    if case == "infinite values":
        bad = tensor.clone()
        bad[0] = math.inf
        return [with_chunk(chunk_of(name, bad)), commit], "messages[0].chunk.data"
    if case == "another version later":
        return [with_chunk(chunk_of(name, tensor)), policy_pb2.UpdateWeightsRequest(version=7, commit=True)], \
            "messages[1].version"
    raise AssertionError(case)


CASES = ["unknown dtype", "bytes past the tensor's end", "negative offset", "a chunk sent twice",
         "part of an element, then commit", "empty stream", "commit without a tensor", "no model in the first message",
         "negative dimension", "NaN values", "infinite values", "another version later"]


@pytest.fixture(scope="module")
def shared_model(stub, tiny_model_dir):  # noqa: F811
    stub.LoadModel(policy_pb2.LoadModelRequest(name="validation", path=str(tiny_model_dir)), timeout=60)
    yield "validation"
    stub.UnloadModel(policy_pb2.UnloadModelRequest(name="validation"), timeout=60)


@pytest.fixture(scope="module")
def reference(stub, shared_model):  # noqa: F811
    return tokens(stub.Generate(first_turn_request(shared_model, n=2, max_new_tokens=12), timeout=60))


@pytest.mark.parametrize("case", CASES)
def test_a_broken_weight_stream_is_invalid_argument_naming_the_field_and_changes_nothing(
        stub, shared_model, weights, reference, case):  # noqa: F811
    messages, field = stream(shared_model, weights, case)
    with pytest.raises(grpc.RpcError) as caught:
        stub.UpdateWeights(iter(messages), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert violated_fields(caught.value) == [field], caught.value.details()
    if case in ("NaN values", "infinite values"):
        assert "'model.norm.weight'" in caught.value.details() and "NaN or infinite" in caught.value.details()
    assert version_of(stub, shared_model) == 0
    assert tokens(stub.Generate(first_turn_request(shared_model, n=2, max_new_tokens=12), timeout=60)) == reference


def test_a_whole_update_with_one_non_finite_tensor_is_refused_and_the_valid_one_applies(stub, shared_model, weights):  # noqa: F811
    diverged = {k: v.clone() for k, v in weights.items()}
    diverged["lm_head.weight" if "lm_head.weight" in diverged else next(iter(diverged))].view(-1)[-1] = math.nan
    with pytest.raises(grpc.RpcError) as caught:
        stub.UpdateWeights(update_requests(shared_model, 5, diverged, chunk_bytes=16 * 1024), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and version_of(stub, shared_model) == 0
    (field,) = violated_fields(caught.value)
    assert field.startswith("messages[") and field.endswith("].chunk.data")
    assert stub.UpdateWeights(update_requests(shared_model, 5, weights), timeout=60).version == 5


def test_a_model_path_too_long_or_unusable_is_invalid_argument(stub, tmp_path):  # noqa: F811
    for path in ("x" * 5000, "/tmp/" + "y" * 300, "/tmp/a\0b"):
        with pytest.raises(grpc.RpcError) as caught:
            stub.LoadModel(policy_pb2.LoadModelRequest(name="too-long", path=path), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path[:20]
        assert violated_fields(caught.value) == ["path"]
        assert len(caught.value.details()) < 1000


def test_sampling_and_scoring_numbers_out_of_range_name_their_fields(stub, shared_model):  # noqa: F811
    huge = {"temperature": 1e308, "top_p": math.nan, "top_k": 2**31 - 1}
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(first_turn_request(shared_model, **huge), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(caught.value) == ["sampling.temperature", "sampling.top_p", "sampling.top_k"]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(first_turn_request(shared_model, max_new_tokens=10**9, stop=["x" * 2000]), timeout=30)
    assert violated_fields(caught.value) == ["sampling.max_new_tokens", "sampling.stop[0]"]
    item = policy_pb2.ScoreItem(prompt_token_ids=[5, 6], completion_token_ids=[7])
    for fields, expected in (({"temperature": 1e308}, ["temperature"]), ({"temperature": math.inf}, ["temperature"]),
                             ({"top_k": 10**9, "top_p": 0.0}, ["top_p", "top_k"])):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Score(policy_pb2.ScoreRequest(model=shared_model, items=[item], **fields), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert violated_fields(caught.value) == expected, fields
    assert stub.Score(policy_pb2.ScoreRequest(model=shared_model, items=[item], temperature=100.0), timeout=30).results


def test_model_info_says_the_services_limits(stub, shared_model):  # noqa: F811
    info = stub.GetModel(policy_pb2.GetModelRequest(name=shared_model), timeout=10).model
    assert (info.max_samples_per_prompt, info.max_prompts) == (64, 1024)
    listed = stub.ListModels(policy_pb2.ListModelsRequest(), timeout=10)
    assert (listed.max_samples_per_prompt, listed.max_prompts) == (64, 1024)


def test_undecodable_bytes_in_a_weight_stream_are_invalid_argument_naming_the_message(server, stub, shared_model):  # noqa: F811
    channel = grpc.insecure_channel(server.address)
    raw = channel.stream_unary("/leap.policy.v1.PolicyService/UpdateWeights", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    serving = version_of(stub, shared_model)
    valid = policy_pb2.UpdateWeightsRequest(model=shared_model, version=serving + 1).SerializeToString()
    for messages, field in (([b"\xff\xff\xff"], "messages[0]"), ([valid, b"\x0a\xff\xff\xff\xff\x0f"], "messages[1]")):
        with pytest.raises(grpc.RpcError) as caught:
            raw(iter(messages), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(caught.value) == [field]
    channel.close()
    assert version_of(stub, shared_model) == serving
