"""One learner over many processes (GPUs, nodes) with the code path of one process.

Launch with `torchrun` (or `accelerate launch`, which sets the same variables): every
process reads RANK / WORLD_SIZE / LOCAL_RANK, joins one process group (NCCL on GPUs, gloo on
CPU) and shards the model with FSDP2 (`torch.distributed.fsdp.fully_shard`). Rank 0 is the
*driver*: it runs the service, the rollout loop and every decision; the other ranks are
*followers* that do what rank 0's learner does, in lockstep:

    rank 0:   learner = Learner(settings)          # broadcasts ("create", settings)
              learner.train_step(batch, loss)      # broadcasts ("call", "train_step", ...)
              learner.close()                      # broadcasts ("close",)
    rank > 0: follow()                             # builds the same Learner and replays calls

(`follow` lives beside the learner in `leap.learning.learner`: this module knows nothing
of what the ranks run, so the learner imports it and never the other way round.)

Commands travel with `broadcast_object_list`, so their arguments (sequences, loss objects)
must be picklable. With one process nothing is broadcast and nothing is initialized.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process stands among the learner's processes."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    # Collectives. With one process each is the identity, so callers never branch.

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_driver else None
        dist.gather_object(obj, out, dst=0)
        return out

    def max(self, value: int) -> int:
        if not self.distributed:
            return value
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value)
        return max(values)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


_joined: World | None = None  # the world this process joined, once: a left group is never joined again


def current_world() -> World:
    """The world of this process, joining the process group when launched with several.

    The group is joined once per process: asked again after `leave_process_group`, this
    returns the same World without joining anew (a second `init_process_group` over the
    launcher's store meets the first one's stale keys and can wait forever)."""
    global _joined
    if _joined is not None:
        return _joined
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        # Long timeout: followers wait in a broadcast while the driver generates rollouts.
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=6))
    _joined = World(rank=rank, size=size, local_rank=local_rank)
    return _joined


def shard_model(model: torch.nn.Module, mixed_precision: bool = False) -> torch.nn.Module:
    """FSDP2 over each decoder layer, then the root (embeddings, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (model.model.layers for Llama/Qwen)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, torch.nn.ModuleList):
            return list(node)
    return []


def release_followers(world: World) -> None:
    """Tell follower ranks to leave `leap.learning.learner.follow()` (rank 0, at shutdown),
    then leave the process group."""
    if world.distributed and world.is_driver:
        world.broadcast(("exit",))
    leave_process_group()


def leave_process_group() -> None:
    """Destroy this process's group before the interpreter exits: left to the interpreter's
    teardown, gloo's threads can outlive their owner and the process dies with SIGABRT
    ("terminate called without an active exception") after its work succeeded, which
    torchrun reports as a failed launch."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """End a rank of a distributed learner, its work done, without the interpreter's teardown.

    Even with its group destroyed (`leave_process_group`), a rank's torch.distributed
    objects (gloo's worker threads, the store's connection, the group the FSDP model still
    holds) are freed by the interpreter's teardown in an order it does not promise; on a busy
    machine one of their threads can still be running, and the process dies with SIGABRT
    ("terminate called without an active exception") after it served and saved everything,
    which torchrun reports as a failed launch. Nothing is left to do at that point (the run
    registry and checkpoints are committed when they are written), so the logs and standard
    streams are flushed and the process ends with `os._exit`."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)
