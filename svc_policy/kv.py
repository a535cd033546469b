"""The key/value cache of a running batch for the hf backend's continuous batching.

Sequences join and leave the batch between decode steps. Every row keeps its real tokens
right-aligned: the last column of the cache is every row's newest token, and a row shorter
than the batch is padded on the left (masked out by the attention mask, positions given
explicitly). A decode step appends one column for all rows; a row that finishes is dropped;
columns that only hold padding are dropped with it.

Tensors are views of preallocated buffers that grow geometrically, so a decode step writes
one column in place instead of concatenating the whole cache (what transformers'
DynamicLayer does).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model.forward` takes its KV cache under: transformers renamed
    `past_key_values` to `cache` in 5.2x, and both versions are in use."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class GrowableLayer(DynamicLayer):
    """One layer's keys and values, [B, H, L, D] views of buffers with spare columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        batch, heads, length, dim = keys.shape
        self._kbuf = keys.new_zeros((batch, heads, max(capacity, length), dim))
        self._vbuf = values.new_zeros((batch, values.shape[1], max(capacity, length), values.shape[-1]))
        self._kbuf[:, :, :length] = keys
        self._vbuf[:, :, :length] = values
        self.length = length
        self.device = keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._kbuf[:, :, : self.length]
        self.values = self._vbuf[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._kbuf.shape[2])
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self.length + new > self._kbuf.shape[2]:
            self._grow(self.length + new)
        self._kbuf[:, :, self.length : self.length + new] = key_states
        self._vbuf[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._expose()
        return self.keys, self.values


def supports_batch_cache(layer_kinds: Sequence[str]) -> bool:
    """Whether every attention layer is full attention (sliding windows and recurrent states
    cannot be re-aligned by padding)."""
    return all(kind == "full_attention" for kind in layer_kinds)


class BatchCache:
    """The cache of the running batch plus each row's real length."""

    def __init__(self) -> None:
        self.layers: list[GrowableLayer] = []
        self.lengths: list[int] = []  # real tokens per row

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return self.layers[0].length if self.layers else 0

    def cache(self) -> Cache:
        """A transformers Cache over the batch's layers, for one forward pass."""
        return Cache(layers=list(self.layers))

    def attention_mask(self, extra: int = 0) -> torch.Tensor:
        """[B, columns + extra] with 1 over each row's real tokens (and the `extra` new ones)."""
        device = self.layers[0].device
        width = self.columns + extra
        lengths = torch.tensor(self.lengths, device=device)[:, None] + extra
        return (torch.arange(width, device=device)[None, :] >= width - lengths).long()

    def add(self, per_layer: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int, copies: int, spare: int) -> None:
        """Append `copies` rows that share one prefilled prompt of `length` tokens; `per_layer`
        holds its keys and values [1, H, length, D]; `spare` columns are reserved."""
        width = max(self.columns, length)
        merged: list[GrowableLayer] = []
        for index, (keys, values) in enumerate(per_layer):
            new_k = keys.expand(copies, -1, -1, -1)
            new_v = values.expand(copies, -1, -1, -1)
            if self.layers:
                old = self.layers[index]
                k = torch.cat([_left_pad(old.keys, width), _left_pad(new_k, width)], dim=0)
                v = torch.cat([_left_pad(old.values, width), _left_pad(new_v, width)], dim=0)
            else:
                k, v = _left_pad(new_k, width), _left_pad(new_v, width)
            merged.append(GrowableLayer(k, v, width + spare))
        self.layers = merged
        self.lengths += [length] * copies

    def advance(self) -> None:
        """Count the column the last forward pass appended for every row."""
        self.lengths = [n + 1 for n in self.lengths]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order); drop columns that became padding for all."""
        if len(rows) == self.rows:
            return
        if not rows:
            self.layers, self.lengths = [], []
            return
        self.lengths = [self.lengths[r] for r in rows]
        start = self.columns - max(self.lengths)
        index = torch.tensor(list(rows), device=self.layers[0].device)
        spare = self.layers[0]._kbuf.shape[2] - self.columns
        self.layers = [
            GrowableLayer(layer.keys[index, :, start:], layer.values[index, :, start:], self.columns - start + spare)
            for layer in self.layers
        ]


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros((tensor.shape[0], tensor.shape[1], missing, tensor.shape[3]))
    return torch.cat([pad, tensor], dim=2)
