"""Token sequences as a learner sees them, and how they are cut into micro-batches and shards.

A `Sequence` is one whole dialogue as token ids (prompt, the model's turns, feedback turns),
a loss mask that keeps only the tokens the model generated, and named values a loss needs:
per token (aligned with `token_ids`, for example the sampler's logprobs or per-turn
advantages) or per sequence (a float, for example one advantage).

Logprob convention used everywhere in this package: position t holds
log p(token_ids[t] | token_ids[:t]); position 0 has no context and is never in the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence as SequenceOf

import torch


@dataclasses.dataclass
class Sequence:
    """One training sequence."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 where token_ids[t] is the model's own output, else 0
    values: dict[str, list[float] | float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.token_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.token_ids)} tokens")
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError("position 0 has no context and cannot be in the loss mask")
        for name, value in self.values.items():
            if isinstance(value, (list, tuple)) and len(value) != len(self.token_ids):
                raise ValueError(f"value {name!r} has {len(value)} entries for {len(self.token_ids)} tokens")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def loss_tokens(self) -> int:
        return int(sum(1 for m in self.loss_mask if m))


@dataclasses.dataclass
class Batch:
    """Right-padded tensors of some sequences (see `collate`)."""

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long, 1 on real tokens
    loss_mask: torch.Tensor  # [N, L] float, 1 on the model's own tokens
    values: dict[str, torch.Tensor]  # per-token values [N, L] (0 on padding), per-sequence [N]
    lengths: list[int]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
            {k: v.to(device) for k, v in self.values.items()}, self.lengths,
        )

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def collate(sequences: SequenceOf[Sequence], pad_token_id: int = 0) -> Batch:
    """Pad sequences on the right into one Batch. Every sequence must carry the same value names."""
    if not sequences:
        raise ValueError("collate needs at least one sequence")
    width = max(len(s) for s in sequences)
    n = len(sequences)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    names = list(sequences[0].values)
    values: dict[str, torch.Tensor] = {}
    for name in names:
        per_token = isinstance(sequences[0].values[name], (list, tuple))
        values[name] = torch.zeros((n, width) if per_token else (n,), dtype=torch.float32)
    for i, seq in enumerate(sequences):
        length = len(seq)
        input_ids[i, :length] = torch.tensor(seq.token_ids, dtype=torch.long)
        attention[i, :length] = 1
        loss_mask[i, :length] = torch.tensor(seq.loss_mask, dtype=torch.float32)
        if set(seq.values) != set(names):
            raise ValueError(f"sequence {i} carries values {sorted(seq.values)}, sequence 0 {sorted(names)}")
        for name in names:
            value = seq.values[name]
            if values[name].dim() == 2:
                if not isinstance(value, (list, tuple)):
                    raise ValueError(f"value {name!r} is per token in sequence 0 but not in sequence {i}")
                values[name][i, :length] = torch.tensor(value, dtype=torch.float32)
            else:
                values[name][i] = float(value)  # type: ignore[arg-type]
    return Batch(input_ids, attention, loss_mask, values, [len(s) for s in sequences])


def micro_batches(lengths: SequenceOf[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose padded size (count x longest) stays
    within `token_budget`; a sequence longer than the budget gets a micro-batch of its own.

    Sequences are sorted by length first so padding is small; the grouping depends only on
    the lengths, so the same sequences always give the same micro-batches (the learner's
    old-logprob pass and its training passes then compute identical numbers).
    """
    if token_budget < 1:
        raise ValueError("token_budget must be at least 1")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        candidate_longest = max(longest, lengths[index])
        if current and candidate_longest * (len(current) + 1) > token_budget:
            groups.append(current)
            current, candidate_longest = [], lengths[index]
        current.append(index)
        longest = candidate_longest
    if current:
        groups.append(current)
    return groups


def shard(lengths: SequenceOf[int], world_size: int) -> list[list[int]]:
    """Split sequence indices over `world_size` ranks, balancing tokens (longest first onto the
    lightest rank). Deterministic; a rank may get nothing when there are fewer sequences than
    ranks."""
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        parts[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(part) for part in parts]


def with_values(sequences: SequenceOf[Sequence], **values: SequenceOf[list[float] | float]) -> list[Sequence]:
    """Copies of `sequences` with more named values (one entry per sequence for each name)."""
    out = []
    for i, seq in enumerate(sequences):
        extra: Mapping[str, list[float] | float] = {name: column[i] for name, column in values.items()}
        out.append(Sequence(seq.token_ids, seq.loss_mask, {**seq.values, **extra}))
    return out
