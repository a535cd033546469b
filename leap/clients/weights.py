"""Pushing weights to a policy service: a state dict becomes a client stream of
`TensorChunk`s (raw little-endian C-order bytes, a CRC-32 per chunk, large tensors split),
ended by a commit message; the service applies all of it atomically or nothing.

    from leap.clients import connect
    from leap.clients.weights import push_weights

    policy = connect("policy", "127.0.0.1:50051")
    reply = await push_weights(policy, "policy", version=step, state_dict=model.state_dict())
    reply.version, reply.bytes_received, reply.seconds

`dtype="auto"` (the default) asks the service for the model's compute dtype first and
casts floating-point tensors to it, so an fp32 learner can feed a bf16 server (the service
rejects a chunk whose dtype differs from its parameter's). Tensors that share storage (tied
embeddings) are sent once, under the first name.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch

try:  # ISA-L's CRC-32 (same polynomial as zlib's) is several times faster where installed
    from isal.isal_zlib import crc32, crc32_combine
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    from zlib import crc32

    crc32_combine = None  # Python's zlib does not expose it: checksums are then taken in one piece

from leap.common.v1 import common_pb2
from leap.policy.v1 import policy_pb2

DType = common_pb2.DType
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # well under the default 64 MiB message limit

TORCH_TO_PROTO = {
    torch.float32: DType.D_TYPE_FLOAT32,
    torch.float16: DType.D_TYPE_FLOAT16,
    torch.bfloat16: DType.D_TYPE_BFLOAT16,
    torch.float64: DType.D_TYPE_FLOAT64,
    torch.int8: DType.D_TYPE_INT8,
    torch.uint8: DType.D_TYPE_UINT8,
    torch.int16: DType.D_TYPE_INT16,
    torch.int32: DType.D_TYPE_INT32,
    torch.int64: DType.D_TYPE_INT64,
    torch.bool: DType.D_TYPE_BOOL,
}
PROTO_TO_TORCH = {proto: dtype for dtype, proto in TORCH_TO_PROTO.items()}
NAMED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def proto_dtype(dtype: torch.dtype) -> int:
    if dtype not in TORCH_TO_PROTO:
        raise ValueError(f"tensors of dtype {dtype} cannot be sent")
    return TORCH_TO_PROTO[dtype]


def _unique(state_dict: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[tuple[Any, ...]] = set()
    for name, tensor in state_dict.items():
        identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() > 0 and identity in seen:
            continue
        seen.add(identity)
        yield name, tensor


def _pieces(state_dict: Mapping[str, torch.Tensor], chunk_bytes: int, dtype: torch.dtype | None
            ) -> Iterator[tuple[str, int, list[int], int, bytes]]:
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be at least 1")
    for name, tensor in _unique(state_dict):
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.cpu().contiguous()
        raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        shape = list(tensor.shape)
        kind = proto_dtype(tensor.dtype)
        for offset in range(0, max(len(raw), 1), chunk_bytes):
            yield name, kind, shape, offset, raw[offset : offset + chunk_bytes].tobytes()


def tensor_chunks(state_dict: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  dtype: torch.dtype | None = None) -> Iterator[policy_pb2.TensorChunk]:
    """The chunks of every tensor of `state_dict`, in order, each at most `chunk_bytes` long
    with its CRC-32; floating-point tensors cast to `dtype` when given; tensors sharing
    storage with an earlier one skipped."""
    for name, kind, shape, offset, data in _pieces(state_dict, chunk_bytes, dtype):
        yield policy_pb2.TensorChunk(name=name, dtype=kind, shape=shape, offset=offset, data=data, crc32=crc32(data))


def update_requests(model: str, version: int, state_dict: Mapping[str, torch.Tensor],
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: torch.dtype | None = None,
                    commit: bool = True) -> Iterator[policy_pb2.UpdateWeightsRequest]:
    """The messages of one UpdateWeights stream: every chunk, then the commit (unless
    `commit` is False: such a stream changes nothing on the service)."""
    for name, kind, shape, offset, data in _pieces(state_dict, chunk_bytes, dtype):
        # Filled in place: a TensorChunk built apart would be copied into the request.
        request = policy_pb2.UpdateWeightsRequest(model=model, version=version)
        chunk = request.chunk
        chunk.name, chunk.dtype, chunk.offset, chunk.data, chunk.crc32 = name, kind, offset, data, crc32(data)
        chunk.shape.extend(shape)
        yield request
    if commit:
        yield policy_pb2.UpdateWeightsRequest(model=model, version=version, commit=True)


def keep_freed_memory(threshold_bytes: int = 256 * 1024 * 1024) -> bool:
    """Make glibc keep and reuse freed blocks up to `threshold_bytes` instead of mapping
    fresh pages for each (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD). Streaming weights allocates
    a few chunk-sized buffers per chunk; fresh pages fault in at a fraction of memcpy speed
    on virtual machines, and this is what holds a stream below 1 GB/s there. Process-wide,
    costs resident memory that stays allocated; the policy service does it at start.
    Returns False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, threshold_bytes)) and bool(mallopt(m_trim_threshold, 4 * threshold_bytes))


def _served_dtype(info: policy_pb2.ModelInfo) -> torch.dtype | None:
    return NAMED_DTYPES.get(info.dtype)


async def _in_thread(iterator: Iterator[Any], depth: int = 4) -> AsyncIterator[Any]:
    """Yield the items of a blocking iterator produced on a worker thread, `depth` ahead, so
    that copying and checksumming overlap with sending and never block the event loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    slots = threading.Semaphore(depth)
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in iterator:
                slots.acquire()
                if stop.is_set():
                    return
                loop.call_soon_threadsafe(queue.put_nowait, (item, None))
            loop.call_soon_threadsafe(queue.put_nowait, (end, None))
        except BaseException as err:  # handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, (end, err))

    worker = threading.Thread(target=produce, name="weight-chunks", daemon=True)
    worker.start()
    try:
        while True:
            item, error = await queue.get()
            if item is end:
                if error is not None:
                    raise error
                return
            slots.release()
            yield item
    finally:
        stop.set()
        slots.release()


async def push_weights(stub, model: str, version: int, state_dict: Mapping[str, torch.Tensor],
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: torch.dtype | str | None = "auto",
                       timeout: float | None = None) -> policy_pb2.UpdateWeightsResponse:
    """Send `state_dict` to `model` on a grpc.aio PolicyServiceStub as weight version
    `version` (greater than the serving one) and commit it. Raises grpc.aio.AioRpcError with
    the service's status (INVALID_ARGUMENT naming the bad field) when it refuses; the old
    weights keep serving then."""
    if dtype == "auto":
        info = await stub.GetModel(policy_pb2.GetModelRequest(name=model), timeout=timeout)
        dtype = _served_dtype(info.model)
    requests = update_requests(model, version, state_dict, chunk_bytes, dtype)  # type: ignore[arg-type]
    return await stub.UpdateWeights(_in_thread(requests), timeout=timeout)


def push_weights_blocking(stub, model: str, version: int, state_dict: Mapping[str, torch.Tensor],
                          chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype: torch.dtype | str | None = "auto",
                          timeout: float | None = None) -> policy_pb2.UpdateWeightsResponse:
    """push_weights on a blocking PolicyServiceStub (`connect("policy", ..., aio=False)`)."""
    if dtype == "auto":
        dtype = _served_dtype(stub.GetModel(policy_pb2.GetModelRequest(name=model), timeout=timeout).model)
    return stub.UpdateWeights(update_requests(model, version, state_dict, chunk_bytes, dtype),  # type: ignore[arg-type]
                              timeout=timeout)
