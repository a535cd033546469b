"""Totals since the service started: decisions by rule, evaluations saved, rewards."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from svc_reward.gate import GateResult

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
    groups_gated: int = 0
    simple: int = 0
    catastrophic: int = 0
    expanded: int = 0
    over_budget: int = 0
    evaluations_saved: int = 0
    decisions_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    groups_ranked: int = 0
    trajectories_ranked: int = 0
    trajectories_by_method: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reward_counts: list[int] = dataclasses.field(default_factory=lambda: [0] * HISTOGRAM_BINS)

    @property
    def expanded_share(self) -> float:
        return self.expanded / self.groups_gated if self.groups_gated else 0.0

    def add_gate(self, result: GateResult) -> None:
        totals = result.totals
        self.groups_gated += totals.groups
        self.simple += totals.simple
        self.catastrophic += totals.catastrophic
        self.expanded += totals.expanded
        self.over_budget += totals.over_budget
        self.evaluations_saved += totals.evaluations_saved
        self.decisions_by_reason.update(decision.rule for decision in result.decisions)

    def add_rank(self, method: str, rewards_per_group: Iterable[list[float]], histogram: bool) -> None:
        for rewards in rewards_per_group:
            self.groups_ranked += 1
            self.trajectories_ranked += len(rewards)
            self.trajectories_by_method[method] += len(rewards)
            if histogram:
                for reward in rewards:
                    self.reward_counts[reward_bin(reward)] += 1
