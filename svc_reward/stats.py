"""Totals since the service started: decisions by rule, evaluations saved, rewards."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from svc_reward.gate import GateResult, GateTotals

HISTOGRAM_BINS = 20  # over [-1, 1]: width 0.1


def reward_bin(reward: float, bins: int = HISTOGRAM_BINS) -> int:
    """The bin of a reward in [-1, 1]; the last bin holds 1.0. The small nudge puts a reward
    that lies on an edge up to rounding (k / (G - 1)) in the bin that edge opens."""
    index = int((reward + 1.0) * bins / 2.0 + 1e-9)
    return min(max(index, 0), bins - 1)


def histogram_edges(bins: int = HISTOGRAM_BINS) -> list[float]:
    return [round(-1.0 + 2.0 * i / bins, 12) for i in range(bins + 1)]


@dataclasses.dataclass
class RewardStats:
    gated: GateTotals = dataclasses.field(default_factory=GateTotals)
    decisions_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    groups_ranked: int = 0
    trajectories_ranked: int = 0
    trajectories_by_method: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reward_counts: list[int] = dataclasses.field(default_factory=lambda: [0] * HISTOGRAM_BINS)

    def add_gate(self, result: GateResult) -> None:
        self.gated.add(result.totals)
        self.decisions_by_reason.update(decision.rule for decision in result.decisions)

    def add_rank(self, method: str, rewards_per_group: Iterable[list[float]], histogram: bool) -> None:
        for rewards in rewards_per_group:
            self.groups_ranked += 1
            self.trajectories_ranked += len(rewards)
            self.trajectories_by_method[method] += len(rewards)
            if histogram:
                for reward in rewards:
                    self.reward_counts[reward_bin(reward)] += 1
