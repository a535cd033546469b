"""Combining loss statistics over micro-batches, ranks and optimizer passes.

A loss reports, per micro-batch, means over its kept tokens plus `tokens` (their count) and
`loss` (its share of the batch loss). Keys ending in `_min` / `_max` are extremes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SUMMED = ("tokens", "loss")


def combine_stats(parts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """One statistics dict for a whole batch: token-weighted means, extremes of extremes, and
    sums of `tokens` and `loss`. Parts without tokens count only towards the sums."""
    combined: dict[str, float] = {}
    keys: list[str] = []
    for part in parts:
        keys += [k for k in part if k not in keys]
    weighted = [(part, float(part.get("tokens", 1.0))) for part in parts]
    for key in keys:
        present = [(float(part[key]), w) for part, w in weighted if key in part]
        informative = [(v, w) for v, w in present if w > 0]
        if key in SUMMED:
            combined[key] = sum(v for v, _ in present)
        elif not informative:
            continue
        elif key.endswith("_min"):
            combined[key] = min(v for v, _ in informative)
        elif key.endswith("_max"):
            combined[key] = max(v for v, _ in informative)
        else:
            total = sum(w for _, w in informative)
            combined[key] = sum(v * w for v, w in informative) / total
    return combined


def mean_of_passes(passes: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Statistics of several optimizer passes over one batch: means, except extremes (over
    every pass) and `tokens` (one pass's count)."""
    if not passes:
        return {}
    result: dict[str, float] = {}
    for key in passes[0]:
        values = [p[key] for p in passes if key in p]
        if key.endswith("_min"):
            result[key] = min(values)
        elif key.endswith("_max"):
            result[key] = max(values)
        elif key == "tokens":
            result[key] = values[0]
        else:
            result[key] = sum(values) / len(values)
    if len(passes) > 1:  # how far the last pass moved away from the sampler: the clipping regime
        for key in ("clip_frac", "ratio_mean", "approx_kl_old"):
            if key in passes[-1]:
                result[f"{key}_last_pass"] = passes[-1][key]
    return result
