"""The hf backend: a transformers causal LM with LEAP's own decode loop.

One worker thread owns the model and runs a continuous-batching loop:

1. a pending weight update waits until no sample is in flight, then is applied in one go
   (nothing runs in between), so every sample finishes on the version it started with;
2. queued Score jobs run (between decode steps, on the current weights);
3. waiting samples join the batch, first come first served, while the batch stays within
   `max_batch_sequences` rows and `max_batch_tokens` reserved tokens (prompt plus
   max_new_tokens per row). The n samples of one prompt share a single prefill;
4. one decode step: every row samples its next token from its own counter-based stream
   (svc_policy.sampling), finished rows leave, the rest run one forward pass together.

Rows are aligned as svc_policy.kv describes; positions are explicit, so a row computes the
same values in any batch up to floating-point rounding.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from leap.runtime.logging import get_logger
from leap.tokenization import tokenizer_fingerprint
from svc_policy import sampling
from svc_policy.engine import Engine, FinishReason, Job, Limits, ModelMeta, Result, Sample, TensorSpec
from svc_policy.kv import BatchCache, cache_keyword, supports_batch_cache
from svc_policy.lora import ServedAdapter
from svc_policy.text import StopStrings, completion_text, eos_token_ids

log = get_logger("leap.policy.hf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Score computes full logits [rows, length, vocab]; keep one forward's logits under this many.
MAX_SCORE_LOGITS = 1 << 28


def resolve_device(device: str) -> str:
    if device in ("", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype in ("", "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


@dataclasses.dataclass
class _Running:
    """A sample in the batch (or waiting for it)."""

    sample: Sample
    job: Job
    key: int
    stops: StopStrings
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)

    @property
    def reserved_tokens(self) -> int:
        return len(self.sample.prompt_ids) + self.sample.max_new_tokens


@dataclasses.dataclass
class _ScoreJob:
    items: Sequence[tuple[list[int], list[int]]]
    temperature: float
    top_k: int
    top_p: float
    future: concurrent.futures.Future


@dataclasses.dataclass
class _UpdateJob:
    tensors: dict[str, torch.Tensor]
    version: int
    future: concurrent.futures.Future
    adopt: bool = False


class HFEngine(Engine):
    backend = "hf"

    def __init__(self, path: str | Path, device: str = "auto", dtype: str = "auto", limits: Limits = Limits(),
                 version: int = 0, lora=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a service logs JSON lines, not progress bars

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.limits = limits
        self.version = version
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, local_files_only=True)
        self.model = model.to(self.device).eval()
        config = self.model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        if not supports_batch_cache(layer_types):
            raise ValueError(f"the hf backend batches full-attention models only; this one has layers {sorted(set(layer_types))}")
        self._cache_arg = cache_keyword(self.model)
        self.eos_ids = frozenset(eos_token_ids(self.tokenizer, self.model.config, self.model.generation_config))
        self.meta = ModelMeta(
            num_parameters=sum(p.numel() for p in self.model.parameters()),
            vocab_size=int(self.model.get_output_embeddings().weight.shape[0]),
            max_context_tokens=int(getattr(config, "max_position_embeddings", 0) or self.tokenizer.model_max_length),
            eos_token_ids=sorted(self.eos_ids),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
            architecture=(self.model.config.architectures or [type(self.model).__name__])[0],
            dtype=str(self.dtype).removeprefix("torch."),
            device=self.device,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
        )
        self._specs = {name: TensorSpec(t.dtype, tuple(t.shape)) for name, t in self.model.state_dict().items()}
        # A LoRA adapter merged on the fly (svc_policy.lora): its tensors join the specs.
        self.adapter = ServedAdapter.of_model(self.model, lora) if lora is not None else None
        if self.adapter is not None:
            self._specs.update(self.adapter.specs())
        # Where each state-dict name lives, so an adopted tensor can replace it (tied names
        # share one Parameter object: replacing its data replaces every name's).
        self._owners: dict[str, tuple[torch.nn.Module, str]] = {}
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            for attr in (*module._parameters, *module._buffers):
                self._owners[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
        self._cond = threading.Condition()
        self._waiting: deque[_Running] = deque()
        self._scores: deque[_ScoreJob] = deque()
        self._updates: deque[_UpdateJob] = deque()
        self._active: list[_Running] = []
        self._batch = BatchCache()
        self._logits: torch.Tensor | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hf-engine-{Path(path).name}", daemon=True)
        self._thread.start()

    # -- the interface -------------------------------------------------------------------

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def submit(self, job: Job) -> None:
        running = [_Running(s, job, sampling.stream_key(s.seed, s.prompt_index, s.sample_index),
                            StopStrings(self.tokenizer, s.stops)) for s in job.samples]
        with self._cond:
            if self._closed:
                raise RuntimeError("the model is being unloaded")
            self._waiting.extend(running)
            self._cond.notify()

    def score(self, items, temperature: float, top_k: int, top_p: float) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._scores.append(_ScoreJob(list(items), temperature, top_k, top_p, future))
            self._cond.notify()
        return future

    def update(self, tensors: dict[str, torch.Tensor], version: int, adopt: bool = False) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._updates.append(_UpdateJob(tensors, version, future, adopt))
            self._cond.notify()
        return future

    def queued_samples(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._active)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        del self.model
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # -- the worker ------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # per thread
        while True:
            with self._cond:
                while not self._closed and not (self._active or self._waiting or self._scores or self._updates):
                    self._cond.wait()
                if self._closed:
                    break
                # An update waits for every sample of the requests already started (so one
                # request's completions share a version); new requests wait for the update.
                pending = bool(self._updates)
                started = pending and any(r.job.started for r in self._waiting)
                update = self._updates.popleft() if pending and not self._active and not started else None
                scores: list[_ScoreJob] = []
                admitted: list[_Running] = []
                if update is None:
                    if not pending:
                        scores = list(self._scores)
                        self._scores.clear()
                    admitted = self._admit(only_started=pending)
            try:
                if update is not None:
                    self._apply(update)
                    continue
                for job in scores:
                    self._score(job)
                if admitted:
                    self._prefill(admitted)
                if self._active:
                    self._step()
            except Exception as err:  # a failing forward pass fails its work, not the worker
                log.exception("hf engine step failed")
                self._fail_in_flight(err, scores)
        self._abort_all()

    def _admit(self, only_started: bool = False) -> list[_Running]:
        """Waiting samples that fit the budgets, in order, or only those of requests that
        already have samples running (called with the lock held)."""
        rows = len(self._active)
        tokens = sum(r.reserved_tokens for r in self._active)
        admitted: list[_Running] = []
        while self._waiting:
            head = self._waiting[0]
            if head.job.cancelled.is_set():
                self._waiting.popleft()
                self._finish(head, FinishReason.FINISH_REASON_ABORT)
                continue
            if only_started and not head.job.started:
                break
            fits = rows + 1 <= self.limits.max_batch_sequences and tokens + head.reserved_tokens <= self.limits.max_batch_tokens
            if not fits and (rows > 0 or admitted):
                break
            head.job.started = True
            admitted.append(self._waiting.popleft())
            rows += 1
            tokens += head.reserved_tokens
        return admitted

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache,
                 **kwargs):
        kwargs[self._cache_arg] = cache
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=cache is not None, **kwargs)

    def _prefill(self, admitted: list[_Running]) -> None:
        """One forward pass per distinct prompt; its n samples join the batch as copies."""
        from transformers import DynamicCache

        groups: list[list[_Running]] = []
        for running in admitted:
            same = groups and groups[-1][0].job is running.job and groups[-1][0].sample.prompt_index == running.sample.prompt_index
            if same:
                groups[-1].append(running)
            else:
                groups.append([running])
        new_logits = []
        for group in groups:
            ids = torch.tensor([group[0].sample.prompt_ids], device=self.device)
            length = ids.shape[1]
            cache = DynamicCache(config=self.model.config)
            out = self._forward(ids, torch.ones_like(ids), torch.arange(length, device=self.device)[None], cache,
                                logits_to_keep=1)
            per_layer = [(layer.keys, layer.values) for layer in cache.layers]
            spare = max(r.sample.max_new_tokens for r in group)
            self._batch.add(per_layer, length, copies=len(group), spare=spare)
            new_logits.append(out.logits[:, -1, :].float().expand(len(group), -1))
            self._active.extend(group)
        stacked = torch.cat(new_logits, dim=0)
        self._logits = stacked if self._logits is None else torch.cat([self._logits, stacked], dim=0)

    def _step(self) -> None:
        rows = self._active
        cancelled = [i for i, r in enumerate(rows) if r.job.cancelled.is_set()]
        if cancelled:
            self._drop(cancelled, FinishReason.FINISH_REASON_ABORT)
            rows = self._active
            if not rows:
                return
        greedy_rows = [r.sample.temperature <= 0 for r in rows]
        temperature = torch.tensor([r.sample.temperature for r in rows], device=self.device)
        top_k = torch.tensor([0 if g else r.sample.top_k for r, g in zip(rows, greedy_rows)], device=self.device)
        top_p = torch.tensor([1.0 if g else r.sample.top_p for r, g in zip(rows, greedy_rows)], device=self.device)
        logprobs = sampling.sampling_logprobs(self._logits, temperature, top_k, top_p)
        uniforms = torch.tensor([sampling.uniform(r.key, len(r.tokens)) for r in rows], dtype=torch.float64,
                                device=self.device)
        tokens = sampling.draw(logprobs, uniforms, torch.tensor(greedy_rows, device=self.device))
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        keep, finished = [], []
        for index, (running, token, logprob) in enumerate(zip(rows, tokens.tolist(), chosen.tolist())):
            running.tokens.append(token)
            running.logprobs.append(logprob)
            reason = self._finish_reason(running, token)
            (finished if reason else keep).append((index, reason))
        if finished:
            keep_rows = [i for i, _ in keep]
            self._batch.keep(keep_rows)
            self._logits = self._logits[keep_rows] if keep_rows else None
            self._active = [rows[i] for i in keep_rows]
            for index, reason in finished:
                self._finish(rows[index], reason)
        if not self._active:
            self._logits = None
            return
        next_ids = tokens[[i for i, _ in keep]][:, None] if finished else tokens[:, None]
        mask = self._batch.attention_mask(extra=1)
        positions = torch.tensor(self._batch.lengths, device=self.device)[:, None]
        out = self._forward(next_ids, mask, positions, self._batch.cache())
        self._batch.advance()
        self._logits = out.logits[:, -1, :].float()

    def _finish_reason(self, running: _Running, token: int) -> int:
        sample = running.sample
        if token in self.eos_ids or token in sample.stop_ids or running.stops.hit(running.tokens):
            return FinishReason.FINISH_REASON_STOP
        if len(running.tokens) >= sample.max_new_tokens:
            return FinishReason.FINISH_REASON_LENGTH
        if len(sample.prompt_ids) + len(running.tokens) >= self.meta.max_context_tokens:
            return FinishReason.FINISH_REASON_LENGTH
        return 0

    def _drop(self, indices: list[int], reason: int) -> None:
        drop = set(indices)
        keep_rows = [i for i in range(len(self._active)) if i not in drop]
        rows = self._active
        self._batch.keep(keep_rows)
        self._logits = self._logits[keep_rows] if keep_rows and self._logits is not None else None
        self._active = [rows[i] for i in keep_rows]
        for index in indices:
            self._finish(rows[index], reason)

    def _finish(self, running: _Running, reason: int) -> None:
        sample = running.sample
        ends = self.eos_ids | sample.stop_ids if reason == FinishReason.FINISH_REASON_STOP else ()
        text = completion_text(self.tokenizer, running.tokens, sample.stops, ends)
        running.job.deliver(Result(sample, running.tokens, running.logprobs, reason, self.version, text))

    def _score(self, job: _ScoreJob) -> None:
        try:
            job.future.set_result((self._score_items(job), self.version))
        except Exception as err:
            job.future.set_exception(err)

    def _score_items(self, job: _ScoreJob) -> list[list[float]]:
        order = sorted(range(len(job.items)), key=lambda i: -(len(job.items[i][0]) + len(job.items[i][1])))
        results: list[list[float]] = [[] for _ in job.items]
        budget = min(self.limits.score_batch_tokens, MAX_SCORE_LOGITS // max(1, self.meta.vocab_size))
        start = 0
        while start < len(order):
            width = len(job.items[order[start]][0]) + len(job.items[order[start]][1])
            count = max(1, budget // width)
            batch = order[start : start + count]
            start += count
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, index in enumerate(batch):
                prompt, completion = job.items[index]
                sequence = prompt + completion
                ids[row, : len(sequence)] = torch.tensor(sequence)
                mask[row, : len(sequence)] = 1
            positions = torch.arange(width)[None].expand(len(batch), -1)
            logits = self._forward(ids.to(self.device), mask.to(self.device), positions.to(self.device), None).logits
            for row, index in enumerate(batch):
                prompt, completion = job.items[index]
                rows = logits[row, len(prompt) - 1 : len(prompt) + len(completion) - 1]
                targets = torch.tensor(completion, device=self.device)
                results[index] = sampling.score_logprobs(rows, targets, job.temperature, job.top_k, job.top_p).tolist()
        return results

    def _apply(self, job: _UpdateJob) -> None:
        try:
            if job.version <= self.version:
                raise ValueError(f"version {job.version} does not exceed the serving version {self.version}")
            state = self.model.state_dict()
            tensors = self.adapter.apply(job.tensors) if self.adapter is not None else job.tensors
            for name, tensor in tensors.items():
                target = state[name]
                if job.adopt and tensor.device == target.device and tensor.dtype == target.dtype and tensor.is_contiguous():
                    self._adopt(name, tensor)  # no copy: the staged buffer becomes the parameter
                elif target.device.type == "cpu" and tensor.device.type == "cpu" and tensor.dtype == target.dtype:
                    # One thread's memcpy: torch's copy_ here fans out to an OpenMP team of this
                    # worker thread, which competes with the service's other threads for the cores.
                    np.copyto(target.detach().numpy(), tensor.detach().numpy())
                else:
                    target.copy_(tensor.to(target.device, non_blocking=True))
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            self.version = job.version
            job.future.set_result(None)
        except Exception as err:
            job.future.set_exception(err)

    def _adopt(self, name: str, tensor: torch.Tensor) -> None:
        module, attr = self._owners[name]
        if attr in module._parameters:
            module._parameters[attr].data = tensor
        else:
            module._buffers[attr] = tensor

    def _fail_in_flight(self, error: BaseException, scores: list[_ScoreJob]) -> None:
        for job in scores:
            if not job.future.done():
                job.future.set_exception(error)
        for running in self._active:
            running.job.fail(error)
        self._active, self._batch, self._logits = [], BatchCache(), None

    def _abort_all(self) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
            scores, updates = list(self._scores), list(self._updates)
            self._scores.clear()
            self._updates.clear()
        for running in [*self._active, *waiting]:
            self._finish(running, FinishReason.FINISH_REASON_ABORT)
        self._active, self._batch, self._logits = [], BatchCache(), None
        for job in [*scores, *updates]:
            job.future.set_exception(RuntimeError("the model was unloaded"))
