"""Versioned weight updates over real gRPC: the shared client helper (leap.clients.weights),
atomic commits, partial and corrupt streams that change nothing, generation in flight
during an update, reloads from a checkpoint directory, and the model registry."""

from __future__ import annotations

import asyncio
import shutil
import threading
import zlib

import grpc
import pytest
import torch
from google.rpc import error_details_pb2

from leap import prompts
from leap.clients import connect
from leap.clients.weights import push_weights, push_weights_blocking, tensor_chunks, update_requests
from leap.common.v1 import common_pb2
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from leap.runtime.errors import details_of
from svc_policy.server import PolicyConfig, build
from tests.conftest import free_port, task_suite


@pytest.fixture(scope="module")
def server():
    config = PolicyConfig(port=free_port(), drain_seconds=0.0)
    running = BackgroundServer(build(config), config).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield policy_pb2_grpc.PolicyServiceStub(channel)
    channel.close()


@pytest.fixture
def model(stub, tiny_model_dir, request):
    """A fresh copy of the tiny model, loaded under this test's name."""
    name = request.node.name.replace("[", "-").replace("]", "")[:100]
    stub.LoadModel(policy_pb2.LoadModelRequest(name=name, path=str(tiny_model_dir)), timeout=60)
    yield name
    stub.UnloadModel(policy_pb2.UnloadModelRequest(name=name), timeout=60)


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


def perturbed(weights: dict[str, torch.Tensor], scale: float = 3.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: t + scale * torch.randn(t.shape, generator=generator) * t.std() if t.numel() > 1 else t
            for name, t in weights.items()}


def first_turn_request(model: str, **sampling) -> policy_pb2.GenerateRequest:
    task = next(t for t in task_suite() if t.split == "train")
    sampling = {"n": 4, "seed": 1, "max_new_tokens": 40, **sampling}
    return policy_pb2.GenerateRequest(model=model, sampling=policy_pb2.SamplingParams(**sampling),
                                      prompts=[policy_pb2.Prompt(chat=policy_pb2.ChatPrompt(messages=prompts.first_turn(task)))])


def tokens(response) -> list[list[int]]:
    return [list(c.token_ids) for c in response.completions]


def version_of(stub, model: str) -> int:
    return stub.GetModel(policy_pb2.GetModelRequest(name=model), timeout=10).model.version


def bad_fields(error: grpc.RpcError) -> list[str]:
    (bad_request,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    return [v.field for v in bad_request.field_violations]


def test_tensor_chunks_split_large_tensors_with_a_crc_each():
    state = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 2, dtype=torch.bfloat16),
             "scalar": torch.tensor(7, dtype=torch.int64)}
    chunks = list(tensor_chunks(state, chunk_bytes=16))
    assert [(c.name, c.offset, len(c.data)) for c in chunks] == [
        ("a", 0, 16), ("a", 16, 16), ("a", 32, 8), ("b", 0, 12), ("scalar", 0, 8)]
    assert all(c.crc32 == zlib.crc32(c.data) for c in chunks)  # the IEEE CRC-32, whichever library computes it
    assert chunks[3].dtype == common_pb2.DType.D_TYPE_BFLOAT16 and list(chunks[3].shape) == [3, 2]
    assert b"".join(c.data for c in chunks[:3]) == state["a"].numpy().tobytes()
    cast = list(tensor_chunks(state, dtype=torch.bfloat16))
    assert cast[0].dtype == common_pb2.DType.D_TYPE_BFLOAT16 and cast[-1].dtype == common_pb2.DType.D_TYPE_INT64
    tied = torch.zeros(4)
    assert [c.name for c in tensor_chunks({"x": tied, "y": tied, "z": tied.clone()})] == ["x", "z"]
    messages = list(update_requests("policy", 3, state))
    assert messages[-1].commit and not messages[-1].HasField("chunk") and {m.version for m in messages} == {3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_every_nan_and_infinity_and_passes_sums_that_overflow(dtype):
    from svc_policy.weights import all_finite

    base = torch.randn(100_003, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(base) and all_finite(base[:0])
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        for where in (0, 4097, base.numel() - 1):  # first, inside a vector, last (a second value far off)
            spoiled = base.clone()
            spoiled[[where, (where + 50_000) % base.numel()][: len(bad)]] = torch.tensor(bad, dtype=dtype)
            assert not all_finite(spoiled), (bad, where)
    # Finite values whose sum overflows the dtype are finite: the exact check decides.
    huge = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)
    assert not bool(torch.isfinite(huge.sum())) and all_finite(huge)


def test_an_update_changes_the_outputs_and_bumps_the_version(stub, server, model, weights):
    before = stub.Generate(first_turn_request(model), timeout=60)
    reply = asyncio.run(_push(server.address, model, 1, perturbed(weights)))
    assert reply.version == 1 and reply.model == model
    assert reply.tensors_updated == len(weights) and reply.bytes_received == sum(t.nbytes for t in weights.values())
    assert version_of(stub, model) == 1
    after = stub.Generate(first_turn_request(model), timeout=60)
    assert after.weight_version == 1 and {c.weight_version for c in after.completions} == {1}
    assert tokens(after) != tokens(before)
    # Pushing the original weights back restores the original outputs exactly.
    push_weights_blocking(stub, model, 2, weights)
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == tokens(before)


async def _push(address: str, model: str, version: int, state) -> policy_pb2.UpdateWeightsResponse:
    stub = connect("policy", address)
    try:
        return await push_weights(stub, model, version, state, chunk_bytes=64 * 1024)
    finally:
        await stub.channel.close()


def corrupt(messages: list[policy_pb2.UpdateWeightsRequest], how: str) -> tuple[list[policy_pb2.UpdateWeightsRequest], str]:
    """A broken copy of a valid stream and the field the service must name."""
    messages = [policy_pb2.UpdateWeightsRequest.FromString(m.SerializeToString()) for m in messages]
    chunk = messages[1].chunk
    if how == "crc":
        chunk.crc32 ^= 1
        return messages, "messages[1].chunk.crc32"
    if how == "flipped byte":
        chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
        return messages, "messages[1].chunk.crc32"
    if how == "shape":
        chunk.shape[0] += 1
        return messages, "messages[1].chunk.shape"
    if how == "dtype":
        chunk.dtype = common_pb2.DType.D_TYPE_BFLOAT16
        return messages, "messages[1].chunk.dtype"
    if how == "name":
        chunk.name = "model.layers.99.mlp.up_proj.weight"
        return messages, "messages[1].chunk.name"
    if how == "offset":
        chunk.offset += 4
        return messages, "messages[1].chunk.offset"
    if how == "no commit":
        return messages[:-1], "commit"
    if how == "truncated tensor":  # the last chunk of the first tensor is missing
        name = messages[0].chunk.name
        last = max(i for i, m in enumerate(messages) if m.chunk.name == name)
        return messages[:last] + messages[last + 1 :], "commit"
    if how == "stale version":
        for m in messages:
            m.version = 0
        return messages, "messages[0].version"
    if how == "other model":
        messages[2].model = "someone-else"
        return messages, "messages[2].model"
    raise AssertionError(how)


CORRUPTIONS = ["crc", "flipped byte", "shape", "dtype", "name", "offset", "no commit", "truncated tensor",
               "stale version", "other model"]


def test_partial_or_corrupt_updates_leave_the_old_version_serving(stub, model, weights):
    before = stub.Generate(first_turn_request(model), timeout=60)
    valid = list(update_requests(model, 1, perturbed(weights), chunk_bytes=32 * 1024))
    for how in CORRUPTIONS:
        messages, field = corrupt(valid, how)
        with pytest.raises(grpc.RpcError) as caught:
            stub.UpdateWeights(iter(messages), timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, how
        assert bad_fields(caught.value) == [field], how
        assert version_of(stub, model) == 0, how
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == tokens(before)
    # A client that goes away mid-stream changes nothing either.
    broken = threading.Event()

    def stream_then_vanish():
        yield from valid[:3]
        broken.set()
        raise RuntimeError("client crashed")

    with pytest.raises(grpc.RpcError):
        stub.UpdateWeights(stream_then_vanish(), timeout=60)
    assert broken.is_set() and version_of(stub, model) == 0
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == tokens(before)
    # And the valid stream still applies afterwards.
    assert stub.UpdateWeights(iter(valid), timeout=60).version == 1


def test_generation_in_flight_finishes_on_its_version_during_an_update(stub, model, weights):
    long_request = first_turn_request(model, n=16, max_new_tokens=300, seed=5)
    stream = stub.GenerateStream(policy_pb2.GenerateStreamRequest(
        model=model, prompts=long_request.prompts, sampling=long_request.sampling), timeout=300)
    completions = [next(stream).completion]  # the generation is under way: one sample is done
    update = stub.UpdateWeights.future(update_requests(model, 1, perturbed(weights)), timeout=300)
    completions += [r.completion for r in stream]
    assert update.result().version == 1
    assert len(completions) == 16 and {c.weight_version for c in completions} == {0}
    assert stub.Generate(first_turn_request(model), timeout=60).weight_version == 1
    # The samples are what version 0 produces undisturbed.
    push_weights_blocking(stub, model, 2, weights)
    again = stub.Generate(long_request, timeout=300)
    key = lambda c: c.sample_index  # noqa: E731
    assert [list(c.token_ids) for c in sorted(completions, key=key)] == tokens(again)


def test_reload_weights_from_a_checkpoint_directory(stub, model, weights, tmp_path):
    from safetensors.torch import save_file

    before = stub.Generate(first_turn_request(model), timeout=60)
    save_file({k: v.to(torch.bfloat16) for k, v in perturbed(weights).items()}, str(tmp_path / "model.safetensors"))
    info = stub.ReloadWeights(policy_pb2.ReloadWeightsRequest(model=model, path=str(tmp_path), version=5), timeout=60).model
    assert info.version == 5 and info.dtype == "float32"  # cast to the served dtype
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) != tokens(before)
    for request, field in [
        (policy_pb2.ReloadWeightsRequest(model=model, path=str(tmp_path / "missing"), version=6), "path"),
        (policy_pb2.ReloadWeightsRequest(model=model, path=str(tmp_path), version=5), "version"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ReloadWeights(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(caught.value) == [field]
    assert version_of(stub, model) == 5


def test_load_unload_and_their_errors(stub, tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    info = stub.LoadModel(policy_pb2.LoadModelRequest(name="teacher-1", path=str(copy), version=3), timeout=60).model
    assert info.version == 3 and info.path == str(copy.resolve())
    other = stub.LoadModel(policy_pb2.LoadModelRequest(name="teacher-2", path=str(tiny_model_dir)), timeout=60).model
    assert info.tokenizer_fingerprint == other.tokenizer_fingerprint  # two directories, one tokenizer
    names = [m.name for m in stub.ListModels(policy_pb2.ListModelsRequest(), timeout=10).models]
    assert {"teacher-1", "teacher-2"} <= set(names)
    with pytest.raises(grpc.RpcError) as caught:
        stub.LoadModel(policy_pb2.LoadModelRequest(name="teacher-1", path=str(copy)), timeout=60)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for request, field in [
        (policy_pb2.LoadModelRequest(name="x", path="Qwen/Qwen2-0.5B"), "path"),  # a hub id: never downloaded
        (policy_pb2.LoadModelRequest(name="x", path=str(tmp_path)), "path"),  # no config.json
        (policy_pb2.LoadModelRequest(name="", path=str(copy)), "name"),
        (policy_pb2.LoadModelRequest(name="x", path=str(copy), dtype="int3"), "dtype"),
        (policy_pb2.LoadModelRequest(name="x", path=str(copy), device="tpu"), "device"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.LoadModel(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in bad_fields(caught.value), request
    for name in ("teacher-1", "teacher-2"):
        stub.UnloadModel(policy_pb2.UnloadModelRequest(name=name), timeout=60)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(first_turn_request("teacher-1"), timeout=60)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
