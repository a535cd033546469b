"""The service's side of the weight transports beside the UpdateWeights stream
(`leap.clients.transports` is the learner's). Each one turns a CommitWeights request into
checked tensors for the backend, or raises INVALID_ARGUMENT naming the field; the backend
then applies them exactly as it applies a stream's (atomically, once nothing started on the
old weights is running), so the commit semantics are one for every transport.

- `HostProbe`: a file with random bytes in the shared-memory directory; a client that reads
  them back shares this host's /dev/shm (a dead service's probe is removed by the next one).
- `read_shared`: opens a learner's shared-memory object by name (refusing names that are not
  weight objects, objects others could have written, sizes and tables that do not add up),
  checks every tensor's CRC-32 (or CRC-32C where the entry carries one) and returns views
  of the mapping, which the backend serves as they are when the learner handed the object
  over (`shared_memory_handover`) and copies into the model otherwise (`SharedMappings`
  keeps the mapping for the next push).
- `WeightGroups`: torch.distributed groups with learners (a TCP store per group, this
  service rank 1), and the receiving side of a push over one.
- `open_cuda_ipc`: tensors from a learner's CUDA IPC handles (GPU only).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from leap.clients.checksums import crc32c, crc32c_combine
from leap.clients.transports import SHM_NAME, checksum_pieces, crc32, crc32_combine, word_sum
from leap.policy.v1 import policy_pb2
from leap.runtime import Violations, failed_precondition, invalid_argument, not_found
from leap.runtime.logging import get_logger
from svc_policy.engine import TensorSpec
from svc_policy.weights import all_finite, check_finite, check_table

log = get_logger("leap.policy.transports")


class HostProbe:
    """`leap-probe-<random>` in the shared-memory directory, holding 32 random bytes."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.nonce = secrets.token_bytes(32)
        self.path: Path | None = None
        self.sweep()
        try:
            path = self.directory / f"leap-probe-{os.getpid()}-{secrets.token_hex(8)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(self.nonce)
            self.path = path
        except OSError as err:  # no shared-memory directory: the transport is simply not offered
            log.warning("no host probe: shared memory is not offered", directory=str(directory), error=str(err))

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def sweep(self) -> None:
        """Remove the probes of services that died without closing theirs (SIGKILL)."""
        for path in self.directory.glob("leap-probe-*-*"):
            try:
                pid = int(path.name.split("-")[2])
                if path.stat().st_uid == os.geteuid():
                    os.kill(pid, 0)
            except ProcessLookupError:
                path.unlink(missing_ok=True)
            except (OSError, ValueError):
                continue


class SharedMappings:
    """The learners' shared-memory objects this service has mapped, by name. A learner writes
    one object for every push, so its mapping is kept (no page tables to build again, which
    on a virtual machine costs as much as copying the bytes); one whose name is gone (the
    learner closed its pusher) or has another inode is dropped at the next call."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.maps: dict[str, tuple[int, int, mmap.mmap]] = {}
        self.lock = threading.Lock()

    def get(self, directory: Path, name: str, fd: int, info: os.stat_result) -> mmap.mmap:
        with self.lock:
            self.sweep(directory)
            cached = self.maps.pop(name, None)
            if cached is not None and cached[:2] == (info.st_ino, info.st_size):
                self.maps[name] = cached
                return cached[2]
            mapped = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            self.maps[name] = (info.st_ino, info.st_size, mapped)
            while len(self.maps) > self.keep:
                self.maps.pop(next(iter(self.maps)))
            return mapped

    def sweep(self, directory: Path) -> None:
        for name, (inode, _, _) in list(self.maps.items()):
            try:
                alive = (directory / name).stat().st_ino == inode
            except OSError:
                alive = False
            if not alive:
                self.maps.pop(name)  # the mapping closes once no view of it is left

    def clear(self) -> None:
        with self.lock:
            self.maps.clear()


def read_shared(directory: Path, request: policy_pb2.CommitWeightsRequest, specs: Mapping[str, TensorSpec],
                max_bytes: int, mappings: SharedMappings) -> dict[str, torch.Tensor]:
    """The request's tensors, checked (name, dtype, shape, bounds, no overlap, CRC-32, finite), as
    views of the learner's shared-memory object: the backend adopts them when the learner
    handed the object over, and copies out of them otherwise (the learner may then write the
    object again once this commit has answered)."""
    name = request.shared_memory_name
    if not SHM_NAME.match(name):
        raise invalid_argument("shared_memory_name", f"{name!r} is not a weight object's name "
                                                     f"('leap-w-<pid>-<32 hex digits>')")
    v = Violations()
    v.check(request.shared_memory_bytes > 0, "shared_memory_bytes", "is required: the object's size")
    v.check(request.shared_memory_bytes <= max_bytes, "shared_memory_bytes",
            f"{request.shared_memory_bytes} exceeds the {max_bytes} bytes this model's weights can take")
    table = check_table(request.tensors, specs, v)
    v.raise_if_any()
    path = directory / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise invalid_argument("shared_memory_name", f"no object {name!r} in {directory} (is the learner on this "
                                                     f"host, with the same /dev/shm?)") from None
    except PermissionError:
        raise failed_precondition(f"the service may not open {path}: shared memory needs the learner and the service "
                                  f"to run as the same user", "SHARED_MEMORY_DENIED") from None
    try:
        info = os.fstat(fd)
        v.check(stat.S_ISREG(info.st_mode), "shared_memory_name", "is not a regular file")
        v.check(info.st_uid == os.geteuid() or os.geteuid() == 0, "shared_memory_name",
                "belongs to another user")
        v.check(info.st_mode & 0o077 == 0, "shared_memory_name",
                f"has mode {stat.S_IMODE(info.st_mode):o}; it must be 0600 (nobody else may have written it)")
        v.check(info.st_size == request.shared_memory_bytes, "shared_memory_bytes",
                f"says {request.shared_memory_bytes}, the object has {info.st_size} bytes")
        v.raise_if_any()
        mapped = mappings.get(directory, name, fd, info)
    finally:
        os.close(fd)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)
    spans = []
    for index, (item, spec) in enumerate(zip(request.tensors, table)):
        field = f"tensors[{index}]"
        size = spec.nbytes
        element = torch.empty((), dtype=spec.dtype).element_size()
        v.check(item.offset >= 0 and item.offset % element == 0, f"{field}.offset",
                f"must be a non-negative multiple of the element size {element}, got {item.offset}")
        v.check(item.offset + size <= info.st_size, f"{field}.offset",
                f"{item.name!r} ({size} bytes at {item.offset}) ends past the object's {info.st_size} bytes")
        spans.append((item.offset, item.offset + size, index))
    spans.sort(key=lambda span: (span[0], span[2]))
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        v.check(start >= end, f"tensors[{max(first, second)}].offset", f"overlaps tensors[{min(first, second)}]")
    v.raise_if_any()
    views = [flat[item.offset : item.offset + spec.nbytes] for item, spec in zip(request.tensors, table)]
    arrays = [view.numpy() for view in views]
    not_finite: set[int] = set()
    castagnoli = [item.HasField("crc32c") for item in request.tensors]

    def verify(i: int, start: int, stop: int) -> int:
        # One read of the bytes from memory: a piece's CRC (8 MiB, `PIECE`), then its finite
        # check while it is in cache (`all_finite`; the commit's own check_finite is skipped).
        crc = (crc32c if castagnoli[i] else crc32)(arrays[i][start:stop])
        dtype = table[i].dtype
        if dtype.is_floating_point and i not in not_finite and not all_finite(views[i][start:stop].view(dtype)):
            not_finite.add(i)
        return crc

    checksums = checksum_pieces([array.size for array in arrays], verify,
                                [crc32c_combine if c else crc32_combine for c in castagnoli])
    tensors: dict[str, torch.Tensor] = {}
    for index, (item, spec, view, actual) in enumerate(zip(request.tensors, table, views, checksums)):
        field, expected = ("crc32c", item.crc32c) if castagnoli[index] else ("crc32", item.crc32)
        if actual != expected:
            raise invalid_argument(f"tensors[{index}].{field}", f"checksum mismatch for {item.name!r}: the table says "
                                                                f"{expected:#010x}, the object has {actual:#010x}")
        tensors[item.name] = view.view(spec.dtype).reshape(spec.shape)
    bad = {item.name: tensors[item.name] for index, item in enumerate(request.tensors) if index in not_finite}
    check_finite(bad, {item.name: f"tensors[{index}]" for index, item in enumerate(request.tensors)})
    return tensors


# --- torch.distributed -----------------------------------------------------------------------------


@dataclasses.dataclass
class Group:
    """One learner's group with this service (rank 1)."""

    group_id: str
    model: str
    backend: str
    device: str
    store: object
    ready: concurrent.futures.Future  # resolves to the process group once both ranks joined
    busy: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class WeightGroups:
    """The open groups, by id; a group that failed a transfer is closed (the learner opens a
    new one)."""

    def __init__(self, host: str, timeout_seconds: float, max_groups: int = 8):
        self.host = host
        self.timeout = datetime.timedelta(seconds=timeout_seconds)
        self.max_groups = max_groups
        self.groups: dict[str, Group] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_groups, thread_name_prefix="weight-group")

    def open(self, model: str, backend: str, device: str) -> tuple[Group, int, str]:
        """Start a store and join it as rank 1 in the background; returns the group, the store's
        port and the key prefix the learner must use."""
        import torch.distributed as dist

        while len(self.groups) >= self.max_groups:  # the oldest goes: its learner reopens if still there
            self.close(next(iter(self.groups)))
        store = dist.TCPStore(self.host, 0, 2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        group_id, prefix = secrets.token_hex(8), secrets.token_hex(16)

        def join():
            prefixed = dist.PrefixStore(prefix, store)
            if backend == "nccl":
                return dist.ProcessGroupNCCL(prefixed, 1, 2)
            return dist.ProcessGroupGloo(prefixed, 1, 2, self.timeout)

        group = Group(group_id, model, backend, device, store, self._pool.submit(join))
        self.groups[group_id] = group
        log.info("weight group opened", group=group_id, model=model, backend=backend, store=f"{self.host}:{store.port}")
        return group, store.port, prefix

    def get(self, group_id: str, model: str) -> Group:
        if not group_id:
            raise invalid_argument("group_id", "is required for WEIGHT_TRANSPORT_TORCH_DISTRIBUTED: open one with "
                                               "OpenWeightGroup")
        group = self.groups.get(group_id)
        if group is None:
            raise not_found("weight group", group_id, "it was closed (a failed transfer, or the service restarted): "
                                                      "open another with OpenWeightGroup")
        if group.model != model:
            raise invalid_argument("group_id", f"the group carries weights to {group.model!r}, not {model!r}")
        return group

    def receive(self, group: Group, table: Sequence[tuple[policy_pb2.TensorEntry, TensorSpec]]) -> dict[str, torch.Tensor]:
        """Receive every tensor of the table from rank 0, in order, and check its checksum
        (blocking; a timeout or a broken peer raises and closes the group)."""
        try:
            process_group = group.ready.result(timeout=self.timeout.total_seconds())
            device = group.device if group.backend == "nccl" else "cpu"
            tensors: dict[str, torch.Tensor] = {}
            for item, spec in table:
                buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                process_group.recv([buffer], 0, 0).wait()
                tensors[item.name] = buffer
        except Exception:
            self.close(group.group_id)
            raise
        for index, (item, _) in enumerate(table):
            tensor = tensors[item.name]
            if tensor.device.type == "cpu":
                actual, expected, what = crc32(tensor.reshape(-1).view(torch.uint8).numpy()), item.crc32, "crc32"
            else:
                actual, expected, what = word_sum(tensor), item.word_sum, "word_sum"
            if actual != expected:
                raise invalid_argument(f"tensors[{index}].{what}", f"checksum mismatch for {item.name!r}: the table "
                                                                   f"says {expected:#x}, the bytes received {actual:#x}")
        return tensors

    def close(self, group_id: str) -> None:
        group = self.groups.pop(group_id, None)
        if group is None:
            return
        log.info("weight group closed", group=group_id, model=group.model)
        group.ready.cancel()

    def shutdown(self) -> None:
        for group_id in list(self.groups):
            self.close(group_id)
        self._pool.shutdown(wait=False, cancel_futures=True)


# --- CUDA IPC --------------------------------------------------------------------------------------


def open_cuda_ipc(request: policy_pb2.CommitWeightsRequest, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The request's tensors, opened from their CUDA IPC handles and checked by word sum (they
    stay the learner's memory: the backend copies them before this call returns)."""
    if not torch.cuda.is_available():
        raise failed_precondition("CUDA IPC needs a GPU on the service's side", "NO_GPU")
    v = Violations()
    table = check_table(request.tensors, specs, v)
    for index, item in enumerate(request.tensors):
        v.check(bool(item.cuda_ipc.storage_handle), f"tensors[{index}].cuda_ipc.storage_handle", "is required")
    v.raise_if_any()
    tensors = {}
    for index, (item, spec) in enumerate(zip(request.tensors, table)):
        handle = item.cuda_ipc
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device_index, handle.storage_handle, handle.storage_size_bytes, handle.storage_offset_bytes,
            handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)
        tensor = torch.empty(0, dtype=spec.dtype, device=f"cuda:{handle.device_index}")
        tensor.set_(storage, handle.storage_offset, spec.shape)
        if word_sum(tensor) != item.word_sum:
            raise invalid_argument(f"tensors[{index}].word_sum", f"checksum mismatch for {item.name!r}")
        tensors[item.name] = tensor
    return tensors
