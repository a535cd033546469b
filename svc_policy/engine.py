"""The interface every backend implements, and the plain values that cross it.

A backend owns one model: it samples, scores and swaps weights, each on its own worker (a
thread or an engine process), never on the service's event loop. Requests cross as plain
dataclasses; results come back through callbacks and `concurrent.futures.Future`s, which
the servicer awaits with `asyncio.wrap_future`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch

from leap.policy.v1 import policy_pb2

FinishReason = policy_pb2.FinishReason


class Unsupported(Exception):
    """A valid request this backend cannot serve (FAILED_PRECONDITION for the client)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Scheduling budgets of a backend (from the service config)."""

    max_batch_sequences: int = 64
    max_batch_tokens: int = 65536
    score_batch_tokens: int = 16384


@dataclasses.dataclass
class Sample:
    """One sequence to generate: sample `sample_index` of prompt `prompt_index`."""

    prompt_ids: list[int]
    prompt_index: int
    sample_index: int
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stops: list[str]
    stop_ids: frozenset[int]
    seed: int  # the request's seed; the sample's stream is keyed by (seed, prompt_index, sample_index)


@dataclasses.dataclass
class Result:
    """A finished sample."""

    sample: Sample
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: int
    version: int
    text: str = ""


@dataclasses.dataclass
class ModelMeta:
    """What a backend reports about its model (ModelInfo without the registry's fields)."""

    num_parameters: int
    vocab_size: int
    max_context_tokens: int
    eos_token_ids: list[int]
    has_chat_template: bool
    architecture: str
    dtype: str
    device: str
    tokenizer_fingerprint: str


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Name-independent description of one tensor a weight update may replace."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


class Job:
    """A submitted set of samples: `on_result` is called (on the backend's worker) for each as
    it finishes; `done` resolves once all have."""

    def __init__(self, samples: Sequence[Sample], on_result: Callable[[Result], None]):
        self.samples = list(samples)
        self.on_result = on_result
        self.done: concurrent.futures.Future = concurrent.futures.Future()
        self.cancelled = threading.Event()
        self.started = False  # set by the backend once a sample of it runs
        self._remaining = len(self.samples)
        self._lock = threading.Lock()

    def deliver(self, result: Result) -> None:
        try:
            self.on_result(result)
        finally:
            with self._lock:
                self._remaining -= 1
                last = self._remaining == 0
            if last and not self.done.done():
                self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


class Engine(abc.ABC):
    """One model served by one backend."""

    backend: str
    tokenizer: object
    meta: ModelMeta
    version: int

    @abc.abstractmethod
    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every tensor a weight update may name, by state-dict name."""

    @abc.abstractmethod
    def submit(self, job: Job) -> None:
        """Queue the job's samples; results arrive through the job."""

    @abc.abstractmethod
    def score(self, items: Sequence[tuple[list[int], list[int]]], temperature: float, top_k: int,
              top_p: float) -> concurrent.futures.Future:
        """Resolves to (per-item lists of logprobs, weight version)."""

    @abc.abstractmethod
    def update(self, tensors: dict[str, torch.Tensor], version: int, adopt: bool = False) -> concurrent.futures.Future:
        """Replace the named tensors and set `version`, atomically: samples in flight finish on
        the old weights first, later work sees only the new ones. Resolves to None. With
        `adopt`, the tensors are the caller's to give away (staged or shared-memory buffers
        nobody else writes): a backend may make them its parameters instead of copying."""

    @abc.abstractmethod
    def queued_samples(self) -> int:
        """Samples waiting or running."""

    @abc.abstractmethod
    def close(self) -> None:
        """Abort what is in flight (results with FINISH_REASON_ABORT) and free the model."""
