"""Weight transports beside the UpdateWeights stream, over real gRPC against the policy
service (in this process, on a background thread): shared memory and a torch.distributed
group on gloo (CUDA IPC and NCCL need a GPU: tests/test_policy_gpu.py). Each commits
atomically with its version, refuses a wrong checksum, version or handle and leaves the old
weights serving, also when the learner dies mid-push; a service that offers nothing else
gets the stream."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
from pathlib import Path

import grpc
import pytest
import torch

from leap.clients import connect
from leap.clients import transports as tx
from leap.clients.transports import TransportUnavailable, WeightPusher
from leap.clients.weights import push_weights_blocking
from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import BackgroundServer
from svc_policy.server import PolicyConfig, build
from tests.conftest import free_port
from tests.test_policy_weights import bad_fields, first_turn_request, perturbed, tokens, version_of


def serve(**settings) -> BackgroundServer:
    config = PolicyConfig(port=free_port(), drain_seconds=0.0, weight_group_timeout_seconds=20.0, **settings)
    return BackgroundServer(build(config), config).start()


@pytest.fixture(scope="module")
def server():
    running = serve()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield policy_pb2_grpc.PolicyServiceStub(channel)
    channel.close()


@pytest.fixture
def model(stub, tiny_model_dir, request):
    name = request.node.name.replace("[", "-").replace("]", "")[:100]
    stub.LoadModel(policy_pb2.LoadModelRequest(name=name, path=str(tiny_model_dir)), timeout=60)
    yield name
    stub.UnloadModel(policy_pb2.UnloadModelRequest(name=name), timeout=60)


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


def push(address: str, model: str, version: int, state, transport: str = "auto") -> tx.PushResult:
    async def run():
        stub = connect("policy", address)
        pusher = WeightPusher(stub, model, transport)
        try:
            return await pusher.push(version, state)
        finally:
            await pusher.close()
            await stub.channel.close()

    return asyncio.run(run())


def ours_in(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if tx.SHM_NAME.match(n) and n.split("-")[2] == str(os.getpid())]


@pytest.mark.parametrize("transport", ["shm", "distributed"])
def test_each_transport_commits_what_the_stream_would(stub, server, model, weights, transport):
    before = stub.Generate(first_turn_request(model), timeout=60)
    new = perturbed(weights)
    result = push(server.address, model, 1, new, transport)
    assert result.transport == transport and result.version == 1 == version_of(stub, model)
    assert result.tensors == len(weights) and result.bytes == sum(t.nbytes for t in weights.values())
    after = stub.Generate(first_turn_request(model), timeout=60)
    assert after.weight_version == 1 and tokens(after) != tokens(before)
    # The stream with the same weights serves exactly the same samples.
    push_weights_blocking(stub, model, 2, weights)
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == tokens(before)
    push_weights_blocking(stub, model, 3, new)
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == tokens(after)
    # And the transport can push again (shm: a fresh object; gloo: the same group).
    assert push(server.address, model, 4, weights, transport).version == 4
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == tokens(before)
    assert not ours_in(Path("/dev/shm"))  # every object was unlinked


def test_auto_takes_shared_memory_on_the_same_host(server, model, weights):
    assert push(server.address, model, 1, weights).transport == "shm"


def test_shared_memory_serves_the_handed_over_object_and_never_writes_one_that_may_serve(stub, server, model,
                                                                                          weights):
    before = tokens(stub.Generate(first_turn_request(model), timeout=60))
    new = perturbed(weights)

    async def run():
        channel = connect("policy", server.address)
        pusher = WeightPusher(channel, model, "shm")
        written = []  # the object each push wrote
        take = pusher._shared.take
        pusher._shared.take = lambda directory, size: written.append(take(directory, size)) or written[-1]
        try:
            await pusher.push(1, new)
            after = tokens(stub.Generate(first_turn_request(model), timeout=60))
            assert after != before
            await pusher.push(2, weights)  # v1 serves from the first object: the second is written
            assert written[1] is not written[0] and tokens(stub.Generate(first_turn_request(model), timeout=60)) == before
            await pusher.push(3, new)  # v2 replaced every tensor of the first object: it is written again
            assert written[2] is written[0] and tokens(stub.Generate(first_turn_request(model), timeout=60)) == after
            # No copy was made: the service serves the object's own pages, so bytes written into
            # it (which a pusher never does while they may serve) change what it samples.
            written[0].write(tx.prepared(weights, torch.float32))
            assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == before
            written[0].write(tx.prepared(new, torch.float32))
            # A push that fails (a wrong checksum here) leaves the served weights; the object it
            # wrote may or may not serve as far as the pusher knows, so the next push takes a fresh one.
            real_entry = tx.entry
            tx.entry = lambda name, tensor, **f: real_entry(name, tensor, **{**f, "crc32c": f["crc32c"] ^ 1})
            try:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await pusher.push(4, weights)
            finally:
                tx.entry = real_entry
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and version_of(stub, model) == 3
            assert written[3] is written[1] and tokens(stub.Generate(first_turn_request(model), timeout=60)) == after
            await pusher.push(5, weights)
            assert all(written[4] is not w for w in written[:4])
            assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == before
            assert len(ours_in(Path("/dev/shm"))) == 2  # the oldest was unlinked (the service keeps its pages)
        finally:
            await pusher.close()
            await channel.channel.close()

    asyncio.run(run())
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == before  # unlinked objects still serve
    assert not ours_in(Path("/dev/shm"))


def test_handed_over_objects_are_reused_only_once_every_tensor_they_serve_was_replaced(tmp_path):
    shared = tx.HandedOver()
    first = shared.take(tmp_path, 64)
    shared.committed(first, {"a", "b"})
    second = shared.take(tmp_path, 64)
    assert second is not first
    shared.committed(second, {"a"})  # "b" still serves from the first object
    third = shared.take(tmp_path, 64)
    assert third is not first and third is not second and not first.path.exists()  # the oldest goes
    shared.committed(third, {"a", "b"})
    assert shared.take(tmp_path, 64) is second  # its "a" was replaced
    fourth = shared.take(tmp_path, 64)  # while a push uses the second: never the same object
    assert fourth is not second and fourth is not third and not third.path.exists()
    shared.unknown(second, {"a", "b"})  # that push failed: it may serve, as the third still may
    shared.committed(fourth, {"a", "b"})
    assert shared.take(tmp_path, 64) is second
    shared.committed(second, {"a", "b"})
    bigger = shared.take(tmp_path, 128)  # too small ones are not used: a larger one, the free one going
    assert bigger is not fourth and not fourth.path.exists() and second.path.exists()
    shared.close()
    assert not list(tmp_path.iterdir())


def shared_request(model: str, version: int, state,
                   castagnoli: bool = False) -> tuple[policy_pb2.CommitWeightsRequest, tx.SharedSegment]:
    tensors = tx.prepared(state, torch.float32)
    shared = tx.SharedSegment(Path("/dev/shm"), tx.shared_size(tensors))
    entries = shared.write(tensors, castagnoli)
    return policy_pb2.CommitWeightsRequest(model=model, version=version, transport=tx.SHARED_MEMORY,
                                           shared_memory_name=shared.path.name, shared_memory_bytes=shared.size,
                                           tensors=entries), shared


def test_a_segment_dropped_without_close_is_unlinked():
    # A pusher a caller forgot to close (or an exception that skipped close) must not leave
    # its object in /dev/shm for the life of the process: the collector unlinks it.
    segment = tx.SharedSegment(Path("/dev/shm"), 4096)
    path = segment.path
    assert path.exists()
    del segment
    gc.collect()
    assert not path.exists()


def commit(stub, request):
    return list(stub.CommitWeights(request, timeout=60))


def test_shared_memory_refuses_bad_checksums_versions_and_handles(stub, model, weights):
    before = tokens(stub.Generate(first_turn_request(model), timeout=60))
    cases = {
        "crc": ("tensors[3].crc32", lambda r, s: r.tensors[3].__setattr__("crc32", r.tensors[3].crc32 ^ 1)),
        "flipped byte": ("tensors[0].crc32", lambda r, s: flip(s.path, r.tensors[0].offset)),
        "version": ("version", lambda r, s: r.__setattr__("version", 0)),
        "path in name": ("shared_memory_name", lambda r, s: r.__setattr__("shared_memory_name", "../../etc/passwd")),
        "not ours": ("shared_memory_name", lambda r, s: r.__setattr__("shared_memory_name", "leap-w-1-" + "0" * 32)),
        "size": ("shared_memory_bytes", lambda r, s: r.__setattr__("shared_memory_bytes", r.shared_memory_bytes + 8)),
        "mode": ("shared_memory_name", lambda r, s: os.chmod(s.path, 0o644)),
        "overlap": ("tensors[1].offset", lambda r, s: r.tensors[1].__setattr__("offset", r.tensors[0].offset)),
        "past the end": ("tensors[2].offset", lambda r, s: r.tensors[2].__setattr__("offset", r.shared_memory_bytes)),
        "shape": ("tensors[0].shape", lambda r, s: r.tensors[0].shape.__setitem__(0, r.tensors[0].shape[0] + 1)),
        "unknown tensor": ("tensors[0].name", lambda r, s: r.tensors[0].__setattr__("name", "model.nothing.weight")),
    }
    # CRC-32C in place of CRC-32 (what this package's pusher sends where it is offered) is
    # checked as strictly, and named as its own field.
    cases["crc32c"] = ("tensors[3].crc32c", lambda r, s: r.tensors[3].__setattr__("crc32c", r.tensors[3].crc32c ^ 1))
    cases["flipped byte under crc32c"] = ("tensors[0].crc32c", lambda r, s: flip(s.path, r.tensors[0].offset))
    cases["crc32c left out of one tensor"] = ("tensors[2].crc32", lambda r, s: r.tensors[2].ClearField("crc32c"))
    for how, (field, spoil) in cases.items():
        request, shared = shared_request(model, 1, perturbed(weights), castagnoli="crc32c" in how)
        spoil(request, shared)
        with pytest.raises(grpc.RpcError) as caught:
            commit(stub, request)
        shared.close()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, how
        assert bad_fields(caught.value) == [field], how
        assert version_of(stub, model) == 0, how
    poisoned = perturbed(weights)
    name = next(iter(poisoned))
    poisoned[name] = poisoned[name].clone()
    poisoned[name].view(-1)[0] = float("nan")
    request, shared = shared_request(model, 1, poisoned)  # its checksums are right: the bytes hold a NaN
    with pytest.raises(grpc.RpcError) as caught:
        commit(stub, request)
    shared.close()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_fields(caught.value) == ["tensors[0]"]
    assert version_of(stub, model) == 0
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == before
    assert not ours_in(Path("/dev/shm"))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_a_group_push_with_a_wrong_checksum_changes_nothing_and_the_next_push_lands(stub, server, model, weights):
    before = tokens(stub.Generate(first_turn_request(model), timeout=60))

    async def run():
        channel = connect("policy", server.address)
        pusher = WeightPusher(channel, model, "distributed")
        real_entry = tx.entry
        tx.entry = lambda name, tensor, **f: real_entry(name, tensor, **{**f, "crc32": f.get("crc32", 0) ^ 1})
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pusher.push(1, perturbed(weights))
        finally:
            tx.entry = real_entry
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_fields(caught.value) == ["tensors[0].crc32"]
        assert version_of(stub, model) == 0
        result = await pusher.push(1, perturbed(weights))  # the same group, a good table
        await channel.channel.close()
        return result

    assert asyncio.run(run()).version == 1
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) != before


def _die_mid_push(address: str, model: str, state) -> None:
    """A learner that sends half of the tensors over its group, then dies."""
    async def run():
        stub = connect("policy", address)
        pusher = WeightPusher(stub, model, "distributed")
        real = tx.send_all
        tx.send_all = lambda group, tensors, peer=1: (real(group, tensors[: len(tensors) // 2], peer), os._exit(3))
        await pusher.push(1, state)

    asyncio.run(run())


def test_a_learner_that_dies_mid_push_leaves_the_old_weights_serving(stub, server, model, weights):
    before = tokens(stub.Generate(first_turn_request(model), timeout=60))
    child = multiprocessing.get_context("spawn").Process(target=_die_mid_push,
                                                         args=(server.address, model, perturbed(weights)))
    child.start()
    child.join(120)
    assert child.exitcode == 3
    assert version_of(stub, model) == 0
    assert tokens(stub.Generate(first_turn_request(model), timeout=60)) == before
    assert push(server.address, model, 1, perturbed(weights), "distributed").version == 1  # a new group


class StreamOnly(policy_pb2_grpc.PolicyServiceServicer):
    """A policy service that knows only the original contract (GetModel and the stream), as
    one in another language might: GetWeightTransports answers UNIMPLEMENTED."""

    def __init__(self):
        self.received = 0

    async def GetModel(self, request, context):
        return policy_pb2.GetModelResponse(model=policy_pb2.ModelInfo(name=request.name, dtype="float32"))

    async def UpdateWeights(self, request_iterator, context):
        version = 0
        async for message in request_iterator:
            version = message.version or version
            self.received += len(message.chunk.data)
        return policy_pb2.UpdateWeightsResponse(model="policy", version=version, bytes_received=self.received)


def test_a_service_that_offers_no_transport_gets_the_stream(weights):
    async def run():
        server = grpc.aio.server()
        servicer = StreamOnly()
        policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stub = connect("policy", f"127.0.0.1:{port}")
        try:
            result = await WeightPusher(stub, "policy").push(7, weights)
            with pytest.raises(TransportUnavailable):
                await WeightPusher(stub, "policy", "shm").push(8, weights)
        finally:
            await stub.channel.close()
            await server.stop(0)
        return result, servicer.received

    result, received = asyncio.run(run())
    assert result.transport == "stream" and result.version == 7 and received == sum(t.nbytes for t in weights.values())


def test_a_service_configured_for_the_stream_alone_offers_only_it(tiny_model_dir, weights):
    running = serve(weight_transports=[])
    try:
        channel = grpc.insecure_channel(running.address)
        stub = policy_pb2_grpc.PolicyServiceStub(channel)
        stub.LoadModel(policy_pb2.LoadModelRequest(name="policy", path=str(tiny_model_dir)), timeout=60)
        offer = stub.GetWeightTransports(policy_pb2.GetWeightTransportsRequest(model="policy"), timeout=10)
        assert list(offer.transports) == [tx.STREAM] and not offer.host_probe_path
        assert push(running.address, "policy", 1, weights).transport == "stream"
        request, shared = shared_request("policy", 2, weights)
        with pytest.raises(grpc.RpcError) as caught:
            commit(stub, request)
        shared.close()
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        channel.close()
    finally:
        running.stop()


def test_a_pusher_sends_crc32c_only_to_a_service_that_offers_it(monkeypatch, stub, server, model, weights):
    # A service built before TensorEntry.crc32c (or another language's) does not set
    # shared_memory_crc32c and checks crc32 alone: the pusher then sends CRC-32.
    # Small pieces, so that both sides combine piece CRCs (this model's tensors are each one
    # 8 MiB piece otherwise): a service combining a CRC-32C as a CRC-32 would refuse the push.
    monkeypatch.setattr(tx, "PIECE", 4096)
    sent: list[policy_pb2.TensorEntry] = []
    real_entry = tx.entry

    def recording(name, tensor, **fields):
        sent.append(real_entry(name, tensor, **fields))
        return sent[-1]

    async def run(offered: bool) -> int:
        channel = connect("policy", server.address)
        pusher = WeightPusher(channel, model, "shm")
        await pusher.transports()
        assert pusher.offer.shared_memory_crc32c  # this service takes either
        pusher.offer.shared_memory_crc32c = offered
        try:
            return (await pusher.push(version_of(stub, model) + 1, perturbed(weights))).version
        finally:
            await pusher.close()
            await channel.channel.close()

    tx.entry = recording
    try:
        for offered in (True, False):
            sent.clear()
            assert asyncio.run(run(offered)) == version_of(stub, model)
            assert sent and all(e.HasField("crc32c") == offered for e in sent), offered
            assert all(e.crc32 == 0 for e in sent) == offered  # one checksum or the other, not both
    finally:
        tx.entry = real_entry


def test_crc32c_combines_like_the_crc_of_the_joined_bytes():
    import crc32c as reference

    from leap.clients.checksums import crc32c, crc32c_combine

    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    rng = __import__("random").Random(0)
    for _ in range(200):
        a, b = rng.randbytes(rng.randint(0, 2000)), rng.randbytes(rng.choice([0, 1, 3, 4096, rng.randint(0, 9000)]))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == reference.crc32c(a + b), (len(a), len(b))


def test_checksums_taken_in_parallel_pieces_are_the_whole_buffers_crc32(monkeypatch, tmp_path):
    import zlib

    import numpy as np

    monkeypatch.setattr(tx, "PIECE", 1000)  # many pieces, some ragged
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, size, dtype=np.uint8) for size in (0, 1, 999, 1000, 1001, 3 * 1000 + 5, 20_011)]
    crcs = tx.checksum_pieces([b.size for b in buffers], lambda i, start, stop: zlib.crc32(buffers[i][start:stop]))
    assert crcs == [zlib.crc32(b) for b in buffers]
    # The shared-memory writer's copy goes the same way: each entry's CRC is zlib's of the tensor.
    tensors = [(f"t{i}", torch.from_numpy(b.copy())) for i, b in enumerate(buffers)]
    segment = tx.SharedSegment(tmp_path, tx.shared_size(tensors))
    entries = segment.write(tensors)
    assert [e.crc32 for e in entries] == [zlib.crc32(b) for b in buffers]
    assert all(bytes(segment.array[e.offset : e.offset + b.size]) == b.tobytes() for e, b in zip(entries, buffers))
    # And with CRC-32C, each entry's crc32c is the library's of the whole tensor.
    import crc32c

    entries = segment.write(tensors, castagnoli=True)
    assert [e.crc32c for e in entries] == [crc32c.crc32c(b.tobytes()) for b in buffers]
    assert all(e.HasField("crc32c") and e.crc32 == 0 for e in entries)
    segment.close()


def test_word_sum_reads_int32_words_and_a_padded_tail():
    data = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)  # one word 0x04030201, then 0x00000005
    assert tx.word_sum(data) == 0x04030201 + 5
    assert tx.word_sum(torch.tensor([-1], dtype=torch.int32)) == 2**64 - 1


@pytest.mark.gpu
def test_cuda_ipc_and_nccl_commit_gpu_tensors(tiny_model_dir, weights):
    """GPU only: a model served on cuda takes GPU tensors by CUDA IPC handles and over an NCCL
    group, committing what the stream would."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (CUDA IPC and NCCL)")
    running = serve()
    try:
        channel = grpc.insecure_channel(running.address)
        stub = policy_pb2_grpc.PolicyServiceStub(channel)
        stub.LoadModel(policy_pb2.LoadModelRequest(name="gpu", path=str(tiny_model_dir), device="cuda:0",
                                                   dtype="float32"), timeout=120)
        before = tokens(stub.Generate(first_turn_request("gpu"), timeout=120))
        on_gpu = {k: v.cuda() for k, v in perturbed(weights).items()}
        assert push(running.address, "gpu", 1, on_gpu, "cuda-ipc").transport == "cuda-ipc"
        after = tokens(stub.Generate(first_turn_request("gpu"), timeout=120))
        assert after != before
        push_weights_blocking(stub, "gpu", 2, weights)
        assert push(running.address, "gpu", 3, on_gpu, "distributed").version == 3
        assert tokens(stub.Generate(first_turn_request("gpu"), timeout=120)) == after
        channel.close()
    finally:
        running.stop()
