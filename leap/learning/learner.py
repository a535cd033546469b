"""The learner shared by the trainer (GRPO) and the distiller (TU-OPD): a causal LM being
trained, its optimizer and schedule, gradient accumulation to a token budget, checkpoints,
and the full weights to push to a policy service.

The loss is the caller's: `train_step(sequences, loss_fn)` calls

    loss, stats = loss_fn(logprobs, batch, normalizer, entropy)

once per micro-batch, where `logprobs` [n, L] carries the gradient (see
`leap.learning.model.token_logprobs` for the convention), `batch` is the micro-batch's
`leap.learning.sequences.Batch` (its `values` hold whatever per-token or per-sequence numbers
the sequences carried: advantages, old logprobs, teacher scores ...), `normalizer` counts the
whole batch's loss tokens and sequences (so summing micro-batch losses gives the batch mean),
and `entropy` is the policy's entropy per position (no gradient) or None. `stats` are
detached scalars averaged over this micro-batch's kept tokens, with a `tokens` entry; they are
combined over micro-batches and ranks by `combine_stats`.

Under several processes (see `leap.learning.distributed`) the same calls run on every rank;
`loss_fn` must then be picklable (a module-level function or a dataclass instance).

Every update is checked: a loss or gradient norm that is NaN or infinite stops it before the
optimizer steps (the weights stay those of the last good update), and weights that became
non-finite in the step are found right after it; both raise `NonFiniteError`, on every rank
alike, so a caller fails its run before it pushes or checkpoints anything of that update.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence as SequenceOf
from pathlib import Path
from typing import Any

import numpy as np
import torch

from leap.learning import checkpoint as ckpt
from leap.learning import lora as lora_
from leap.learning.distributed import World, current_world, shard_model
from leap.learning.model import autocast, load_model, load_tokenizer, resolve_device, token_logprobs
from leap.learning.optim import OptimizerSettings, build_optimizer
from leap.learning.sequences import Batch, Sequence, collate, micro_batches, shard
from leap.learning.stats import combine_stats, mean_of_passes

STRATEGIES = ("auto", "none", "fsdp")
ADAPTER_FILE = "adapter.safetensors"  # a LoRA learner's checkpoint: the adapter, PEFT-named


class NonFiniteError(ArithmeticError):
    """An update produced NaN or infinity: in the loss, the gradient norm or the weights.
    `what` is "loss", "gradient norm" or "weights"; the message says where and the value."""

    def __init__(self, what: str, detail: str):
        super().__init__(f"the {what} became {detail}")
        self.what = what

    def sentence(self, step: int, optimizer) -> str:
        """What a person reads when update `step` went non-finite (`optimizer`: the run's
        `leap.common.v1.OptimizerConfig`, defaults filled), with what to change."""
        return (f"step {step}: {self}, so the update was dropped: the policy keeps serving, and the last checkpoint "
                f"keeps, the weights of step {step - 1}. Start a new run with a lower optimizer.learning_rate (this "
                f"run: {optimizer.learning_rate:g}) or a gradient clip (optimizer.max_grad_norm, this run: "
                f"{optimizer.max_grad_norm:g}), or ResumeRun this one to retry from its last checkpoint")


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """Counts over the whole batch (every micro-batch and rank), for batch means."""

    tokens: float  # loss tokens
    sequences: float  # sequences with at least one loss token

    @classmethod
    def of(cls, sequences: SequenceOf[Sequence]) -> Normalizer:
        """The counts of `sequences`. A caller that leaves sequences out of the forward pass
        because they carry no gradient (the trainer's zero-advantage ones) passes the counts
        of the batch *before* it dropped them, so the loss keeps the scale of the whole batch."""
        return cls(tokens=float(sum(s.loss_tokens for s in sequences)),
                   sequences=float(sum(1 for s in sequences if s.loss_tokens > 0)))


LossFn = Callable[[torch.Tensor, Batch, Normalizer, "torch.Tensor | None"], tuple[torch.Tensor, Mapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
    """What a learner is built from."""

    model_path: str  # local Hugging Face model directory
    optimizer: OptimizerSettings = OptimizerSettings()
    total_updates: int = 1  # optimizer updates of the whole run, for the cosine schedule
    temperature: float = 1.0  # the sampler's: logprobs are of softmax(logits / temperature)
    reference: bool = False  # keep a frozen copy of the initial weights (KL to a reference)
    reference_path: str = ""  # the reference's directory; empty means model_path
    device: str = "auto"  # "auto": this rank's GPU when present, else cpu
    strategy: str = "auto"  # "auto": FSDP when there are several processes; "none"; "fsdp"
    gradient_checkpointing: bool = False
    track_entropy: bool = True  # measure the policy's entropy while training (no gradient)
    seed: int = 0
    lora: lora_.LoraSettings | None = None  # train a LoRA adapter (PEFT) instead of every weight

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive")


def collective(method: Callable) -> Callable:
    """Run `method` on every rank: on rank 0 the call is broadcast to the followers first."""

    @functools.wraps(method)
    def wrapper(self: Learner, *args: Any, **kwargs: Any) -> Any:
        if self.world.distributed and self.world.is_driver:
            self.world.broadcast(("call", method.__name__, args, kwargs))
        return method(self, *args, **kwargs)

    return wrapper


class Learner:
    """A trainable causal LM with its optimizer. See the module docstring."""

    def __init__(self, settings: LearnerSettings, *, world: World | None = None, follower: bool = False):
        self.settings = settings
        self.world = world or current_world()
        if self.world.distributed and self.world.is_driver and not follower:
            self.world.broadcast(("create", settings))
        self.device = resolve_device(settings.device, self.world.local_rank)
        seed_everything(settings.seed + self.world.rank)
        self.tokenizer = load_tokenizer(settings.model_path)
        self.pad_token_id = pad_token_id(self.tokenizer)
        self.model = self._load(settings.model_path, trainable=True)
        self.reference = self._load(settings.reference_path or settings.model_path, trainable=False) if settings.reference else None
        self.optimizer, self.scheduler = build_optimizer(self.model, settings.optimizer, settings.total_updates)
        self.updates = 0  # optimizer updates done
        self.closed = False

    @property
    def sharded(self) -> bool:
        return self.world.distributed and self.settings.strategy in ("auto", "fsdp")

    def _load(self, path: str, trainable: bool) -> torch.nn.Module:
        model = load_model(path, self.device, trainable=trainable,
                           gradient_checkpointing=trainable and self.settings.gradient_checkpointing)
        disable_dropout(model)
        if trainable and self.settings.lora is not None:
            if self.world.distributed:
                raise ValueError("LoRA on several processes is not supported yet: train it on one (a LoRA run "
                                 "needs far less memory)")
            model = lora_.wrap(model, self.settings.lora)
        if self.world.distributed:
            if not self.sharded:
                raise ValueError("several processes need strategy 'fsdp' (or 'auto')")
            shard_model(model)
        return model

    # --- lockstep with follower ranks -------------------------------------------------------

    def follow(self) -> None:
        """Replay rank 0's calls until it closes this learner (follower ranks only)."""
        while True:
            message = self.world.broadcast(None)
            if message[0] == "close":
                self._release()
                return
            _, name, args, kwargs = message
            try:
                getattr(type(self), name).__wrapped__(self, *args, **kwargs)
            except NonFiniteError:  # rank 0 raised it too, at the same point: it decides what follows
                continue

    def close(self) -> None:
        if self.closed:
            return
        if self.world.distributed and self.world.is_driver:
            self.world.broadcast(("close",))
        self._release()

    def _release(self) -> None:
        self.closed = True
        self.model = self.reference = None  # type: ignore[assignment]
        self.optimizer = self.scheduler = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the work ---------------------------------------------------------------------------

    def _plan(self, sequences: SequenceOf[Sequence]) -> list[list[int]]:
        """This rank's micro-batches (indices into `sequences`), as many on every rank."""
        if not sequences:
            raise ValueError("at least one sequence is needed")
        mine = shard([len(s) for s in sequences], self.world.size)[self.world.rank]
        groups = micro_batches([len(sequences[i]) for i in mine], self.settings.optimizer.micro_batch_tokens)
        groups = [[mine[i] for i in group] for group in groups]
        count = self.world.max(len(groups))
        return groups + [[]] * (count - len(groups))  # [] is a placeholder that only keeps ranks in step

    def _batch(self, sequences: SequenceOf[Sequence], group: list[int]) -> tuple[Batch, bool]:
        if group:
            return collate([sequences[i] for i in group], self.pad_token_id).to(self.device), False
        template = sequences[0]
        values = {k: ([0.0, 0.0] if isinstance(v, (list, tuple)) else 0.0) for k, v in template.values.items()}
        filler = Sequence([self.pad_token_id] * 2, [0, 0], values)
        return collate([filler], self.pad_token_id).to(self.device), True

    @collective
    def logprobs(self, sequences: SequenceOf[Sequence], *, reference: bool = False) -> list[list[float]] | None:
        """Per-token logprobs of every sequence (no gradient) under the current weights, or the
        frozen reference's. Complete on rank 0; None on the other ranks."""
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("this learner keeps no reference model (settings.reference is off)")
        results: dict[int, list[float]] = {}
        with torch.no_grad():
            for group in self._plan(sequences):
                batch, filler = self._batch(sequences, group)
                with autocast(self.device):
                    logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, self.settings.temperature)
                if filler:
                    continue
                rows = logprobs.float().cpu()
                for row, index in enumerate(group):
                    results[index] = rows[row, : len(sequences[index])].tolist()
        gathered = self.world.gather(results)
        if gathered is None:
            return None
        merged: dict[int, list[float]] = {}
        for part in gathered:
            merged.update(part)
        return [merged[i] for i in range(len(sequences))]

    @collective
    def train_step(self, sequences: SequenceOf[Sequence], loss_fn: LossFn, *, epochs: int | None = None,
                   normalizer: Normalizer | None = None) -> dict[str, float] | None:
        """`epochs` optimizer updates (default: settings.optimizer.epochs_per_batch) over the
        whole batch, each accumulating gradients over micro-batches. `normalizer` defaults to
        the counts of `sequences` (`Normalizer.of`). Returns the combined statistics on rank 0
        (None elsewhere): the loss's own, plus grad_norm, lr, updates, micro_batches and seconds."""
        started = time.perf_counter()
        epochs = epochs or self.settings.optimizer.epochs_per_batch
        normalizer = normalizer or Normalizer.of(sequences)
        plan = self._plan(sequences)
        passes: list[dict[str, float]] = []
        norms: list[float] = []
        for _ in range(epochs):
            self.optimizer.zero_grad(set_to_none=True)
            parts: list[Mapping[str, Any]] = []
            bad_loss = 0.0  # the first non-finite micro-batch loss of this rank, or 0
            for position, group in enumerate(plan):
                batch, filler = self._batch(sequences, group)
                if self.sharded:  # reduce gradients once, after the last micro-batch
                    self.model.set_requires_gradient_sync(position == len(plan) - 1)
                with autocast(self.device):
                    logprobs, entropy = token_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                                       self.settings.temperature, with_entropy=self.settings.track_entropy)
                loss, stats = loss_fn(logprobs, batch, normalizer, entropy)
                if not filler and not bad_loss and not bool(torch.isfinite(loss.detach()).all()):
                    bad_loss = float(loss.detach().float().reshape(-1)[0])
                # FSDP averages gradients over ranks; each rank's loss is its share of the
                # batch sum, so scale back up to get the gradient of the whole batch's loss.
                scale = 0.0 if filler else float(self.world.size)
                (loss * scale).backward()
                if not filler:
                    parts.append({k: float(v) for k, v in stats.items()})
            norms.append(self._clip_and_step(bad_loss))
            gathered = self.world.gather(parts)
            if gathered is not None:
                passes.append(combine_stats([p for rank_parts in gathered for p in rank_parts]))
        if not self.world.is_driver:
            return None
        result = mean_of_passes(passes)
        result.update(grad_norm=float(np.mean(norms)), grad_norm_max=float(np.max(norms)), lr=self.current_lr(),
                      updates=float(self.updates), micro_batches=float(len(plan)), epochs=float(epochs),
                      seconds=time.perf_counter() - started)
        return result

    def _clip_and_step(self, bad_loss: float = 0.0) -> float:
        """Clip, check, step, check. A non-finite loss (on any rank) or gradient norm raises
        before the optimizer moves anything; weights made non-finite by the step raise after
        it (the caller must not push or save them). Every rank decides alike."""
        limit = self.settings.optimizer.max_grad_norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, limit if limit > 0 else math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
            norm = norm.full_tensor()
        norm = float(norm)
        if self.world.max(1 if bad_loss else 0):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError("loss", f"{bad_loss if bad_loss else 'NaN or infinite'} (on some rank)"
                                 if self.world.distributed else f"{bad_loss}")
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError("gradient norm", f"{norm}")
        self.optimizer.step()
        self.scheduler.step()
        self.updates += 1
        if self.world.max(0 if weights_finite(params) else 1):
            raise NonFiniteError("weights", "non-finite after the update")
        return norm

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # --- weights ----------------------------------------------------------------------------

    @collective
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter and buffer, unsharded, on CPU, named as in the Hugging Face model
        (what a policy service's UpdateWeights takes). On rank 0; None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.settings.lora is not None:
            return lora_.merged_state(self.model)  # the adapter merged into the base weights
        if not self.world.distributed:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.world.is_driver else None

    def push_state(self, served_lora=None) -> dict[str, torch.Tensor] | None:
        """What to push to a policy whose ModelInfo.lora is `served_lora`: the adapter alone when
        the policy serves an adapter of this learner's shape, else the full (merged) weights."""
        if self.settings.lora is not None and served_lora is not None and self.settings.lora.matches(served_lora):
            return lora_.adapter_state(self.model)
        return self.full_state_dict()

    @collective
    def rank_fingerprints(self) -> list[str] | None:
        """A SHA-256 of the full weights as each rank sees them (gathered on every rank), on
        rank 0: all equal when the ranks are in step. For checks and debugging."""
        import hashlib

        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.world.distributed:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        else:
            state = self.model.state_dict()
        digest = hashlib.sha256()
        for name in sorted(state):
            digest.update(name.encode())
            digest.update(state[name].detach().float().cpu().numpy().tobytes())
        return self.world.gather(digest.hexdigest())

    @collective
    def save_model(self, directory: str) -> None:
        """Write the current weights and the tokenizer as a Hugging Face model directory."""
        self._save_model(Path(directory))

    def _save_model(self, directory: Path) -> None:
        state = type(self).full_state_dict.__wrapped__(self)
        if self.world.is_driver:
            directory.mkdir(parents=True, exist_ok=True)
            unwrapped = self.model.get_base_model() if self.settings.lora is not None else self.model
            unwrapped.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(str(directory))

    # --- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, root: str | Path, step: int, cursor: Mapping[str, Any] | None = None,
                        extra: Mapping[str, Any] | None = None, keep_last: int = 0,
                        files: Mapping[str, bytes] | None = None) -> ckpt.CheckpointInfo | None:
        """Write a checkpoint of everything needed to continue exactly (see
        `leap.learning.checkpoint`); `cursor` is the caller's data position, `extra` any
        JSON-able state, `files` more of the caller's state as named files (rank 0), sealed
        with the rest. Returns its info on rank 0."""
        root = Path(root)
        temp = ckpt.new_temp_dir(root, step) if self.world.is_driver else None
        self._write_checkpoint(str(temp), step, dict(cursor or {}), dict(extra or {}))
        if not self.world.is_driver:
            return None
        for name, data in (files or {}).items():
            (temp / name).write_bytes(data)  # type: ignore[operator]
        info = ckpt.finalize(temp, step)  # type: ignore[arg-type]
        ckpt.clean_leftovers(root)
        ckpt.prune(root, keep_last, keep_steps=(step,))
        return info

    @collective
    def _write_checkpoint(self, temp: str, step: int, cursor: dict[str, Any], extra: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        path = Path(temp)
        self._save_model(path / "model")
        if self.world.distributed:
            optimizer_state = get_optimizer_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            optimizer_state = named_optimizer_state(self.model, self.optimizer)
        if self.settings.lora is not None:  # the adapter itself, for an exact resume (model/ is merged)
            from safetensors.torch import save_file

            save_file(lora_.adapter_state(self.model), str(path / ADAPTER_FILE))
        (path / "rng").mkdir(parents=True, exist_ok=True)
        self.world.barrier()  # the directory exists for every rank
        torch.save(rng_state(), path / "rng" / f"rank-{self.world.rank:05d}.pt")
        if self.world.is_driver:
            torch.save(optimizer_state, path / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
            state = {"format": ckpt.FORMAT_VERSION, "step": step, "updates": self.updates, "cursor": cursor,
                     "extra": extra, "world_size": self.world.size, "model_path": self.settings.model_path}
            (path / ckpt.STATE).write_text(json.dumps(state, indent=1, sort_keys=True))
        self.world.barrier()  # every rank's files are written before rank 0 seals the directory

    @collective
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler, RNG states and the update counter from a
        checkpoint directory; returns its state.json (step, cursor, extra) on every rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        path = Path(path)
        if ckpt.describe(path) is None:
            raise ValueError(f"{path} is not a complete checkpoint")
        state = ckpt.read_state(path)
        driver = self.world.is_driver
        if self.settings.lora is not None:  # the base is model_path's, frozen: the adapter is the state
            from safetensors.torch import load_file

            lora_.load_adapter_state(self.model, load_file(str(path / ADAPTER_FILE)))
        lora = self.settings.lora is not None
        model_state = load_model(path / "model", "cpu", trainable=False).state_dict() if driver and not lora else {}
        optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False) if driver else {}
        if self.world.distributed:
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, model_state, options=options)
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)
        else:
            if not lora:
                self.model.load_state_dict(model_state)
            load_named_optimizer_state(self.model, self.optimizer, optimizer_state)
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=False))
        rng_file = path / "rng" / f"rank-{self.world.rank:05d}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        else:  # the world grew since the checkpoint: a fresh, still deterministic stream
            seed_everything(self.settings.seed + 7919 * int(state["step"]) + self.world.rank)
        self.updates = int(state["updates"])
        return state


def follow(factory: Callable[..., Learner] | None = None) -> None:
    """The loop of a follower rank: build each learner rank 0 creates, replay its calls, and
    return when rank 0 sends "exit" (`leap.learning.distributed.release_followers`)."""
    world = current_world()
    if world.is_driver:
        raise RuntimeError("follow() runs on ranks other than 0")
    factory = factory or Learner
    while True:
        message = world.broadcast(None)
        if message[0] == "exit":
            return
        if message[0] != "create":
            raise RuntimeError(f"follower expected a create or exit command, got {message[0]!r}")
        learner = factory(message[1], world=world, follower=True)
        learner.follow()


# --- helpers ----------------------------------------------------------------------------------


def weights_finite(params: SequenceOf[torch.Tensor]) -> bool:
    """Whether every (local shard of a) parameter is finite: one fused reduction per device,
    about the cost of reading the weights once, small next to the update that wrote them."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    local = [p.detach() for p in local if p.numel()]
    if not local:
        return True
    norms = torch._foreach_norm(local)  # NaN or inf in a tensor makes its norm NaN or inf
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def pad_token_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off: the first pass over a batch must reproduce the old logprobs exactly
    (ratio 1), and RL on sampled tokens gains nothing from it."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if hasattr(model, "config") and hasattr(model.config, "attention_dropout"):
        model.config.attention_dropout = 0.0


def named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name (robust to parameter order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = optimizer.state_dict()
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {names[id(ordered[i])]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[id(ordered[i])] for i in g["params"]]} for g in state["param_groups"]],
    }


def load_named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, named: dict[str, Any]) -> None:
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    index_of = {names[id(p)]: i for i, p in enumerate(ordered)}
    state = {
        "state": {index_of[name]: value for name, value in named["state"].items()},
        "param_groups": [{**g, "params": [index_of[n] for n in g["params"]]} for g in named["param_groups"]],
    }
    optimizer.load_state_dict(state)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
