"""Sampling primitives: the sampling distribution, counter-based uniforms, inverse-CDF draws.

Pure functions on tensors, shared by the hf backend's decode loop and by tests.

The distribution a token is sampled from, for logits `z` over the vocabulary, with
temperature `T > 0`, top-k `k` and top-p `p`:

    q = softmax(z / T)                                   # temperature
    K = {the k tokens with the largest q}  (all when k = 0; ties at the k-th value kept)
    q_K = q restricted to K, renormalized                # top-k
    P = the smallest prefix of K, by decreasing q_K, whose mass reaches p (at least one token)
    pi = q restricted to P, renormalized                 # top-p

and the logprob returned for a sampled token `y` is `log pi(y) = log q(y) - log q(P)`. So
`Score(temperature=T)` (no truncation) returns `log q(y)`, equal to Generate's logprob when
k = 0 and p = 1, and otherwise smaller by `log q(P) <= 0`; `Score` with the same `top_k` and
`top_p` returns `log pi(y)` itself. Temperature 0 is greedy (argmax, lowest id on ties) and
reports `log softmax(z)(y)`, the untempered logprob, since the point mass would always say 0.

Randomness: sample j of prompt i of a request with seed s draws the uniform of its t-th
token from `uniform(s, i, j, t)`, a counter-based hash (SplitMix64), so a sample's tokens do
not depend on which other sequences share its batch, nor on the order they were scheduled.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The key of one sample's stream of uniforms."""
    key = _splitmix64(seed & MASK64)
    key = _splitmix64(key ^ (prompt_index & MASK64))
    return _splitmix64(key ^ ((sample_index * 0x632BE59BD9B4E019) & MASK64))


def uniform(key: int, step: int) -> float:
    """The step-th uniform in [0, 1) of a stream (53 random bits)."""
    return (_splitmix64(key ^ ((step * 0xD1B54A32D192ED03) & MASK64)) >> 11) * (1.0 / (1 << 53))


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [B, V] (float32, -inf outside the kept set) of the distribution each
    row samples from. `temperature`, `top_k`, `top_p` are [B]; a temperature of 0 (greedy)
    gives the untempered distribution (see the module docstring)."""
    logits = logits.float()
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits)
    scaled = logits / scale[:, None]
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        scaled = _truncate(scaled, top_k.to(scaled.device), top_p.to(scaled))
    return torch.log_softmax(scaled, dim=-1)


def _truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    # Top-k by value: the k-th largest logit is the threshold, so ties with it are kept.
    kth = ordered.gather(-1, (k - 1).clamp(min=0)[:, None])
    keep &= ordered >= kth
    ordered = ordered.masked_fill(~keep, float("-inf"))
    # Top-p on the renormalized top-k distribution: keep a token while the mass before it < p.
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= before < top_p[:, None]
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    return scaled.masked_fill(~mask, float("-inf"))


def draw(logprobs: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Token ids [B]: inverse-CDF draws of `uniforms` [B] (in vocabulary order), or argmax
    where `greedy`."""
    probs = logprobs.double().exp()
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms.to(cdf)[:, None] * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # A token outside the kept set has zero mass and cannot be hit, except at the top end where
    # rounding can push the target past the last kept token: fall back to the last kept one.
    last_kept = (probs > 0).long().cumsum(-1).argmax(-1)
    sampled = torch.minimum(sampled, last_kept)
    return torch.where(greedy, logprobs.argmax(-1), sampled)


def score_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """log pi(target) [N] for logits [N, V] under the sampling distribution of the given params
    (temperature 1, no truncation: the model's own log-softmax)."""
    rows = logits.shape[0]
    lp = sampling_logprobs(
        logits,
        torch.full((rows,), float(temperature), device=logits.device),
        torch.full((rows,), int(top_k), dtype=torch.long, device=logits.device),
        torch.full((rows,), float(top_p), device=logits.device),
    )
    return lp.gather(-1, targets[:, None].long()).squeeze(-1)
