"""Pushing weights by the fastest transport a learner and a policy service share, with the
same atomic, versioned, checksummed commit as the UpdateWeights stream:

- shared memory (same host): the learner writes every tensor into a POSIX shared-memory
  object (O_EXCL, mode 0600, an unguessable name), computing each tensor's CRC-32C (CRC-32
  for a service that does not take it) as it copies; `CommitWeights` carries only the
  object's name, the tensor table and the checksums, and hands the object over: the service
  verifies it and serves from its pages (no second copy), so the learner alternates between
  two objects it keeps for every push (`HandedOver`) and unlinks them when the pusher closes;
- CUDA IPC (same host, GPU tensors): the table carries each tensor's IPC handles and a word
  sum computed on the GPU; the service copies device to device;
- torch.distributed (any host): a two-process group (learner rank 0, service rank 1; gloo on
  CPU, NCCL on GPU) opened once with `OpenWeightGroup` and reused; `CommitWeights` carries the
  table, the service answers READY, the learner sends each tensor, the service verifies
  the CRC-32s and applies;
- the UpdateWeights stream (`leap.clients.weights`), which every service accepts.

    from leap.clients import connect
    from leap.clients.transports import WeightPusher

    pusher = WeightPusher(connect("policy", "127.0.0.1:50051"), "policy")   # transport="auto"
    result = await pusher.push(version, model.state_dict())
    result.transport, result.bytes, result.seconds
    await pusher.close()

`transport="auto"` asks the service which transports it takes (`GetWeightTransports`; a
service that does not know the RPC takes only the stream) and uses shared memory when the
service's host probe is readable here (same host and /dev/shm), else a torch.distributed
group when offered, else the stream. A transport that cannot work here (no shared memory
to write, a group that does not form, a service that refuses it as unavailable) is dropped
for the pusher's life and the push goes by the next one; a refusal of the weights themselves
(INVALID_ARGUMENT: a stale version, a bad checksum) is raised, never retried elsewhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

import grpc
import numpy as np
import torch

from leap.clients.checksums import crc32c, crc32c_combine
from leap.clients.weights import NAMED_DTYPES, _unique, crc32, crc32_combine, proto_dtype, push_weights
from leap.policy.v1 import policy_pb2
from leap.runtime.logging import get_logger

Transport = policy_pb2.WeightTransport
STREAM = Transport.WEIGHT_TRANSPORT_GRPC_STREAM
SHARED_MEMORY = Transport.WEIGHT_TRANSPORT_SHARED_MEMORY
CUDA_IPC = Transport.WEIGHT_TRANSPORT_CUDA_IPC
DISTRIBUTED = Transport.WEIGHT_TRANSPORT_TORCH_DISTRIBUTED
NAMES = {"stream": STREAM, "shm": SHARED_MEMORY, "cuda-ipc": CUDA_IPC, "distributed": DISTRIBUTED}
CHOICES = ("auto", *NAMES)

SHM_NAME = re.compile(r"^leap-w-(\d{1,10})-[0-9a-f]{32}$")
ALIGN = 64  # byte alignment of each tensor in a shared-memory object
PIECE = 8 * 1024 * 1024  # tensors are split into pieces of this size, copied and checksummed on parallel threads

log = get_logger("leap.weights")


def transport_name(transport: int) -> str:
    return next((name for name, value in NAMES.items() if value == transport), str(transport))


# --- checksums and tables ---------------------------------------------------------------------


def word_sum(tensor: torch.Tensor) -> int:
    """The CUDA IPC checksum: the sum modulo 2^64 of the tensor's bytes read as little-endian
    int32 words (the last 1-3 bytes, if any, as one zero-padded word), computed where the
    tensor lives. Cheap on a GPU, where a CRC-32 is not at hand; it catches a wrong handle,
    offset or size, not a reordering."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = flat.numel() // 4 * 4
    total = int(flat[:whole].view(torch.int32).sum(dtype=torch.int64).item()) if whole else 0
    if whole < flat.numel():
        tail = bytes(flat[whole:].cpu().tolist()) + b"\0" * (4 - (flat.numel() - whole))
        total += int.from_bytes(tail, "little", signed=True)
    return total % 2**64


def prepared(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
             device: str | None = "cpu") -> list[tuple[str, torch.Tensor]]:
    """The tensors to send: tied ones once, floating ones cast to `dtype`, contiguous, on
    `device` (None: where they are)."""
    out = []
    for name, tensor in _unique(state_dict):
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if device is not None:
            tensor = tensor.to(device)
        out.append((name, tensor.contiguous()))
    return out


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat uint8 array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def entry(name: str, tensor: torch.Tensor, **fields) -> policy_pb2.TensorEntry:
    return policy_pb2.TensorEntry(name=name, dtype=proto_dtype(tensor.dtype), shape=list(tensor.shape), **fields)


# --- checksums in parallel -------------------------------------------------------------------------

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for copies and checksums (NumPy's copy and ISA-L's CRC release the GIL): as
    many as this process may use cores, at most 4 (memory bandwidth runs out before that)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, cores)),
                                                          thread_name_prefix="leap-weights")
        return _POOL


def checksum_pieces(sizes: list[int], work, combine=crc32_combine) -> list[int]:
    """Each buffer's CRC, its bytes taken in pieces on parallel threads: `work(index, start,
    stop)` handles bytes [start, stop) of buffer `index` (copying them, say) and returns their
    CRC; the pieces' checksums are combined in order (`combine(crc_a, crc_b, len_b)`: CRC-32's
    `crc32_combine` by default, `crc32c_combine` for CRC-32C; a list gives each buffer its
    own), so the result is the CRC of the whole buffer. Without a combine a buffer is one piece."""
    combines = combine if isinstance(combine, list) else [combine] * len(sizes)
    jobs = []
    for index, size in enumerate(sizes):
        step = PIECE if combines[index] is not None else max(size, 1)
        jobs.extend((index, start, min(start + step, size)) for start in range(0, size, step))
    results = list(_pool().map(lambda job: work(*job), jobs)) if len(jobs) > 1 else [work(*job) for job in jobs]
    crcs = [0] * len(sizes)
    for (index, start, stop), crc in zip(jobs, results):
        crcs[index] = crc if start == 0 else combines[index](crcs[index], crc, stop - start)
    return crcs


# --- shared memory ------------------------------------------------------------------------------


def shm_name() -> str:
    """A fresh object name: this process's id (so leftovers of a dead writer can be found) and
    128 random bits (so nobody can guess it in advance)."""
    return f"leap-w-{os.getpid()}-{secrets.token_hex(16)}"


def sweep_leftovers(directory: Path) -> int:
    """Unlink shared-memory objects of this user whose writer process is gone (a learner
    killed between writing and committing); returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = SHM_NAME.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        path = directory / name
        try:
            if path.stat().st_uid != os.geteuid() or pid == os.getpid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except OSError:
            continue
    return removed


class SharedSegment:
    """One shared-memory object this process created (O_EXCL, 0600) and writes every push
    into: its pages stay allocated between pushes, so a push copies into warm memory (a
    fresh tmpfs page costs more to fault in than to copy on virtual machines). Unlinked by
    `close`; by the garbage collector or at interpreter exit when a pusher is dropped without
    one; and, if this process is killed first, by the next writer's `sweep_leftovers`."""

    def __init__(self, directory: Path, size: int):
        self.path = directory / shm_name()
        self.size = max(size, 1)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        self._unlink = weakref.finalize(self, _unlink, self.path)  # no reference to self: it can be collected

    def write(self, tensors: list[tuple[str, torch.Tensor]], castagnoli: bool = False) -> list[policy_pb2.TensorEntry]:
        """Copy every tensor in (each at an aligned offset) with its checksum: CRC-32, or
        CRC-32C in `crc32c` where the service takes it (`castagnoli`). Tensors go in pieces
        on parallel threads (`checksum_pieces`); each piece's CRC reads the source, which
        brings it into cache for the copy that follows (a piece fits in L3), and a copy that
        large is written around the cache (glibc's non-temporal stores), so the bytes cross
        the memory bus once each way. (A CRC of the copy after it, in blocks that fit L2,
        measured 20-30% slower here: the small copies allocate their lines in cache first.)"""
        checksum, combine = (crc32c, crc32c_combine) if castagnoli else (crc32, crc32_combine)
        sources, offsets, offset = [], [], 0
        for _, tensor in tensors:
            offset = (offset + ALIGN - 1) // ALIGN * ALIGN
            sources.append(host_bytes(tensor))
            offsets.append(offset)
            offset += sources[-1].size

        def copy(index: int, start: int, stop: int) -> int:
            source, base = sources[index], offsets[index]
            crc = checksum(source[start:stop])
            np.copyto(self.array[base + start : base + stop], source[start:stop])
            return crc

        crcs = checksum_pieces([source.size for source in sources], copy, combine)
        field = "crc32c" if castagnoli else "crc32"
        return [entry(name, tensor, offset=at, **{field: crc})
                for (name, tensor), at, crc in zip(tensors, offsets, crcs)]

    def close(self) -> None:
        self._unlink()
        self.array = None  # type: ignore[assignment]
        try:
            self.mapping.close()
        except BufferError:  # a view still exported: the mapping goes with it
            pass


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


class HandedOver:
    """A pusher's shared-memory objects under handover (`shared_memory_handover`): the
    service may serve a committed tensor from the object's own pages, so an object is written
    again only once this pusher's later commits have replaced every tensor it may still serve.
    Pushes alternate between two objects; after a push whose outcome is not known (any error:
    the service may or may not have applied it) both may be serving, and the next push writes
    a fresh one, the oldest being unlinked (the service keeps the pages it maps). An object a
    push is writing or committing is never handed to another push on the same pusher."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.segments: list[tuple[SharedSegment, set[str]]] = []  # oldest first, with what may serve from each
        self.busy: set[int] = set()  # id() of the objects pushes are using now
        self.lock = threading.Lock()

    def take(self, directory: Path, size: int) -> SharedSegment:
        """An object of at least `size` bytes that nothing served lives in (made if need be),
        in use until `committed` or `unknown` is called for it."""
        with self.lock:
            return self._take(directory, size)

    def _take(self, directory: Path, size: int) -> SharedSegment:
        for segment, serving in self.segments:
            if not serving and segment.size >= size and id(segment) not in self.busy:
                self.busy.add(id(segment))
                return segment
        while len(self.segments) >= self.keep:
            idle = [i for i, (segment, _) in enumerate(self.segments) if id(segment) not in self.busy]
            if not idle:
                break
            free = [i for i in idle if not self.segments[i][1]]
            self.segments.pop(free[0] if free else idle[0])[0].close()
        segment = SharedSegment(directory, size)
        self.segments.append((segment, set()))
        self.busy.add(id(segment))
        return segment

    def committed(self, segment: SharedSegment, names: set[str]) -> None:
        """`names` now serve from `segment`, and from no other object."""
        with self.lock:
            self.busy.discard(id(segment))
            for other, serving in self.segments:
                if other is segment:
                    serving.clear()
                    serving.update(names)
                else:
                    serving.difference_update(names)

    def unknown(self, segment: SharedSegment, names: set[str]) -> None:
        """A push of `names` from `segment` failed: they may serve from it, or still from the others."""
        with self.lock:
            self.busy.discard(id(segment))
            for other, serving in self.segments:
                if other is segment:
                    serving.update(names)

    def close(self) -> None:
        with self.lock:
            for segment, _ in self.segments:
                segment.close()
            self.segments.clear()
            self.busy.clear()


def shared_size(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes of an object holding `tensors` at ALIGN-aligned offsets."""
    size = 0
    for _, tensor in tensors:
        size = (size + ALIGN - 1) // ALIGN * ALIGN + tensor.numel() * tensor.element_size()
    return size


def same_host(reply: policy_pb2.GetWeightTransportsResponse) -> bool:
    """Whether the service's host probe is readable here with its nonce: this process sees the
    service's shared-memory directory (same host, same /dev/shm)."""
    if not reply.host_probe_path or not reply.host_probe_nonce:
        return False
    try:
        return Path(reply.host_probe_path).read_bytes() == reply.host_probe_nonce
    except OSError:
        return False


# --- torch.distributed ----------------------------------------------------------------------------


def join_group(reply: policy_pb2.OpenWeightGroupResponse):
    """This side (rank 0) of a group OpenWeightGroup opened (blocks until both have joined)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=reply.timeout_seconds or 120)
    store = dist.TCPStore(reply.store_host, reply.store_port, reply.world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(reply.store_prefix, store)
    if reply.backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, reply.client_rank, reply.world_size)
    else:
        group = dist.ProcessGroupGloo(prefixed, reply.client_rank, reply.world_size, timeout)
    return store, group


def send_all(group, tensors: list[tuple[str, torch.Tensor]], peer: int = 1) -> None:
    """Send each tensor to the service in table order (blocking)."""
    for _, tensor in tensors:
        group.send([tensor], peer, 0).wait()


# --- the pusher ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What one push did."""

    version: int
    transport: str
    bytes: int
    seconds: float
    tensors: int


class TransportUnavailable(Exception):
    """This transport cannot work between these two ends; the next one should be tried."""


UNAVAILABLE_HERE = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.PERMISSION_DENIED}


class WeightPusher:
    """Pushes weights to one model of one policy service (see the module docstring)."""

    def __init__(self, stub, model: str, transport: str = "auto", *, timeout: float | None = None,
                 chunk_bytes: int | None = None):
        if transport not in CHOICES:
            raise ValueError(f"transport must be one of {', '.join(CHOICES)}, not {transport!r}")
        self.stub = stub
        self.model = model
        self.requested = transport
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.offer: policy_pb2.GetWeightTransportsResponse | None = None
        self.dropped: set[int] = set()
        self._group = None  # (group_id, store, process group)
        self._shared = HandedOver()

    async def transports(self) -> list[int]:
        """The transports to try, best first (asks the service once)."""
        if self.offer is None:
            try:
                self.offer = await self.stub.GetWeightTransports(
                    policy_pb2.GetWeightTransportsRequest(model=self.model), timeout=self.timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.offer = policy_pb2.GetWeightTransportsResponse(transports=[STREAM])  # a stream-only service
        offered = set(self.offer.transports)
        if self.requested != "auto":
            wanted = NAMES[self.requested]
            order = [wanted] if wanted in offered or wanted == STREAM else []
            if not order:
                raise TransportUnavailable(f"the policy service does not offer the {self.requested} transport for "
                                           f"{self.model!r} (it offers "
                                           f"{', '.join(transport_name(t) for t in self.offer.transports)})")
            return order
        local = same_host(self.offer)
        order = [t for t in (CUDA_IPC, SHARED_MEMORY, DISTRIBUTED)
                 if t in offered and (t == DISTRIBUTED or local)]
        return [t for t in order if t not in self.dropped] + [STREAM]

    async def push(self, version: int, state_dict: Mapping[str, torch.Tensor],
                   dtype: torch.dtype | str | None = "auto") -> PushResult:
        """Send `state_dict` as `version` (above the serving one) and commit it."""
        started = time.perf_counter()
        if dtype == "auto":
            info = await self.stub.GetModel(policy_pb2.GetModelRequest(name=self.model), timeout=self.timeout)
            dtype = NAMED_DTYPES.get(info.model.dtype)
        for transport in await self.transports():
            try:
                reply = await self._push(transport, version, state_dict, dtype)  # type: ignore[arg-type]
            except TransportUnavailable as why:
                if self.requested != "auto":
                    raise
                self.dropped.add(transport)
                log.warning("weight transport unavailable, trying the next", transport=transport_name(transport),
                            reason=str(why))
                continue
            return PushResult(reply.version, transport_name(transport), reply.bytes_received,
                              time.perf_counter() - started, reply.tensors_updated)
        raise AssertionError("the stream is always tried last")

    async def _push(self, transport: int, version: int, state_dict, dtype):
        if transport == STREAM:
            kwargs = {"chunk_bytes": self.chunk_bytes} if self.chunk_bytes else {}
            return await push_weights(self.stub, self.model, version, state_dict, dtype=dtype, timeout=self.timeout,
                                      **kwargs)
        try:
            if transport == SHARED_MEMORY:
                return await self._push_shared(version, state_dict, dtype)
            if transport == DISTRIBUTED:
                return await self._push_group(version, state_dict, dtype)
            if transport == CUDA_IPC:
                return await self._push_cuda_ipc(version, state_dict, dtype)
        except grpc.aio.AioRpcError as err:
            if err.code() in UNAVAILABLE_HERE:
                raise TransportUnavailable(f"{err.code().name}: {err.details()}") from None
            raise
        raise TransportUnavailable(f"transport {transport_name(transport)} is not built into this client")

    async def _push_shared(self, version: int, state_dict, dtype):
        directory = Path(self.offer.shared_memory_dir or "/dev/shm")
        tensors = prepared(state_dict, dtype)
        size = shared_size(tensors)
        names = {name for name, _ in tensors}
        try:
            if not self._shared.segments:
                await asyncio.to_thread(sweep_leftovers, directory)
            segment = await asyncio.to_thread(self._shared.take, directory, size)
        except OSError as err:  # no room (two objects of the weights' size are needed), no such directory
            raise TransportUnavailable(f"cannot write shared memory in {directory}: {err}") from None
        try:
            try:
                entries = await asyncio.to_thread(segment.write, tensors, self.offer.shared_memory_crc32c)
            except OSError as err:
                raise TransportUnavailable(f"cannot write shared memory in {directory}: {err}") from None
            request = policy_pb2.CommitWeightsRequest(
                model=self.model, version=version, transport=SHARED_MEMORY, shared_memory_name=segment.path.name,
                shared_memory_bytes=segment.size, tensors=entries, shared_memory_handover=True)
            reply = await self._commit(request)
        except BaseException:
            self._shared.unknown(segment, names)
            raise
        self._shared.committed(segment, names)
        return reply

    async def _push_cuda_ipc(self, version: int, state_dict, dtype):
        """GPU tensors by their CUDA IPC handles (the service copies them device to device
        before it answers; `tensors` keeps them alive until then)."""
        tensors = prepared(state_dict, dtype, device=None)
        if not tensors or any(t.device.type != "cuda" for _, t in tensors):
            raise TransportUnavailable("CUDA IPC carries GPU tensors; these are on the CPU")
        entries = []
        for name, tensor in tensors:
            device, handle, size, offset, ref_handle, ref_offset, event, sync = tensor.untyped_storage()._share_cuda_()
            ipc = policy_pb2.CudaIpcHandle(storage_handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                                           ref_counter_handle=ref_handle, ref_counter_offset=ref_offset,
                                           event_handle=event or b"", event_sync_required=bool(sync),
                                           device_index=device, storage_offset=tensor.storage_offset())
            entries.append(entry(name, tensor, word_sum=word_sum(tensor), cuda_ipc=ipc))
        request = policy_pb2.CommitWeightsRequest(model=self.model, version=version, transport=CUDA_IPC,
                                                  tensors=entries)
        reply = await self._commit(request)
        del tensors
        return reply

    async def _commit(self, request: policy_pb2.CommitWeightsRequest, on_ready=None):
        call = self.stub.CommitWeights(request, timeout=self.timeout)
        last = None
        async for reply in call:
            if reply.phase == policy_pb2.COMMIT_PHASE_READY and on_ready is not None:
                await on_ready()
            last = reply
        if last is None or last.phase != policy_pb2.COMMIT_PHASE_COMMITTED:
            raise RuntimeError("CommitWeights ended without COMMITTED")
        return last

    async def group(self):
        """The torch.distributed group with the service (opened on first use)."""
        if self._group is None:
            reply = await self.stub.OpenWeightGroup(policy_pb2.OpenWeightGroupRequest(model=self.model),
                                                    timeout=self.timeout)
            try:
                store, group = await asyncio.to_thread(join_group, reply)
            except Exception as err:  # unreachable store, a group that never formed
                raise TransportUnavailable(f"cannot join the weight group at {reply.store_host}:{reply.store_port}: "
                                           f"{err}") from None
            self._group = (reply.group_id, store, group, reply.backend)
        return self._group

    async def _push_group(self, version: int, state_dict, dtype):
        group_id, _, group, backend = await self.group()
        device = None if backend == "nccl" else "cpu"
        tensors = prepared(state_dict, dtype, device=device)
        entries = await asyncio.to_thread(
            lambda: [entry(n, t, crc32=crc32(host_bytes(t)) if t.device.type == "cpu" else 0,
                           word_sum=word_sum(t) if t.device.type == "cuda" else 0) for n, t in tensors])
        request = policy_pb2.CommitWeightsRequest(model=self.model, version=version, transport=DISTRIBUTED,
                                                  group_id=group_id, tensors=entries)

        async def send() -> None:
            try:
                await asyncio.to_thread(send_all, group, tensors)
            except Exception:
                self._group = None  # a broken group is not used again; the next push opens another
                raise

        try:
            return await self._commit(request, on_ready=send)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._group = None  # the service gave the group up: reopen on the next push
            raise

    async def close(self) -> None:
        self._group = None
        self._shared.close()
