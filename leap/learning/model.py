"""Loading the model being trained, and the per-token logprobs the learner computes.

`token_logprobs` is the learner's definition of a logprob and must match the sampler's
(`Completion.logprobs` of the policy service): log_softmax(logits / temperature) of the
sampled token, in float32. Top-k and top-p truncation are not applied: their gradient is not
defined, and the gap to the sampler's numbers (which include them) is logged rather than
hidden.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from leap.runtime.errors import cut


def resolve_device(requested: str = "auto", local_rank: int | None = None) -> torch.device:
    """"auto" is cuda (this process's local rank's GPU) when one is present, else cpu."""
    if requested and requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        rank = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on GPU (fp32 master weights and optimizer state), plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_model_dir(path: str | os.PathLike) -> str | None:
    """Why `path` is not a loadable Hugging Face model directory, or None when it is."""
    directory = Path(path)
    if not str(path):
        return "is required"
    shown = cut(str(path))
    try:
        if not directory.is_dir():
            return f"{shown!r} is not a directory"
        if not (directory / "config.json").is_file():
            return f"{shown!r} has no config.json (not a Hugging Face model directory)"
        if not any(directory.glob("*.safetensors")) and not any(directory.glob("*.bin")):
            return f"{shown!r} has no weights (*.safetensors)"
    except (OSError, ValueError) as err:  # a name over NAME_MAX, a NUL byte: the OS refuses it
        return f"{shown!r} cannot be a directory here: {err.strerror if isinstance(err, OSError) else err}"
    return None


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu", *, trainable: bool = True,
               gradient_checkpointing: bool = False) -> torch.nn.Module:
    """A causal LM from a local directory, in float32 (master weights), on `device`.

    Nothing is downloaded: `path` must be a local directory.
    """
    from transformers import AutoModelForCausalLM

    problem = check_model_dir(path)
    if problem:
        raise FileNotFoundError(f"model directory {problem}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, *, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position logprobs [N, L] (position t: log p(input_ids[t] | input_ids[:t]); position 0
    is 0), and the policy's entropy at each position when `with_entropy` (no gradient).

    Differentiable when called with gradients enabled. Inputs must be right-padded.
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive (greedy decoding has no logprobs to learn from)")
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    logits = outputs.logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    normalizer = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, targets).squeeze(-1) - normalizer
    zeros = torch.zeros_like(picked[:, :1])
    logprobs = torch.cat([zeros, picked], dim=1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            ent = normalizer - (probs * logits).sum(-1)
            entropy = torch.cat([zeros.detach(), ent], dim=1)
    return logprobs, entropy
