"""The evaluation stage of a candidate, as the pure reward algorithms see it.

The numbers are those of `leap.common.v1.Stage` (a test checks that they agree), so the
servicer converts by value; the order is the contract's: a larger value got further.
"""

from __future__ import annotations

import enum


class Stage(enum.IntEnum):
    """The first stage a candidate failed, or PASSED."""

    FORMAT = 1
    COMPILE = 2
    RUN = 3
    CORRECT = 4
    PASSED = 5

    @property
    def label(self) -> str:
        return self.name.lower()


STAGES = tuple(Stage)  # in order, FORMAT first


def parse_stage(text: str) -> Stage:
    """'compile', 'COMPILE' or 'STAGE_COMPILE' -> Stage.COMPILE (for config files and flags)."""
    name = text.strip().upper().removeprefix("STAGE_")
    try:
        return Stage[name]
    except KeyError:
        choices = ", ".join(stage.label for stage in Stage)
        raise ValueError(f"unknown stage {text!r}; choose one of: {choices}") from None
