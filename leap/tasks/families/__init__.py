"""Task families: KernelBench-style tasks generated deterministically from (family, seed, index).

Each family module (`elementwise`, `rows`, `gemm`, `stencil`) defines NAME, ENTRY, SIZE (how many distinct
structures it has), HELDOUT (the pairs of pieces training never sees together) and
`build(number, rng) -> core.Blueprint`. This package maps an index to a structure through the
seed's permutation (`core.permute`), so one seed's tasks are distinct, and renders the
Blueprint into a Task proto (FULL view: reference, cpu and cuda solutions, broken variants).

    generate("elementwise", seed=0, index=7)        -> Task "fam.elementwise.s0.i7"
    generate_many("elementwise", seed=0, count=100) -> the first 100 tasks of seed 0
    task_from_id("fam.elementwise.s0.i7")           -> the same Task (KeyError when not a family id)

The sandbox serves the first COUNT tasks of a seed beside the built-in suite when its
`task_families` setting names them (`parse_served` reads that setting), or the first COUNT
of one difficulty tier (`NAME@TIER:COUNT`, `served_tasks`): the easiest tier of a large
family is a small share of it, so its first tasks hold almost none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import ModuleType

from leap.sandbox.v1 import sandbox_pb2
from leap.tasks.families import core, elementwise, gemm, rows, stencil

FAMILIES: dict[str, ModuleType] = {module.NAME: module for module in (elementwise, rows, gemm, stencil)}


def family(name: str) -> ModuleType:
    """The module of family `name`; ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def generate(name: str, seed: int, index: int) -> sandbox_pb2.Task:
    """Task `index` of `seed` in family `name` (IndexError past the family's size)."""
    module = family(name)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    number = core.permute(index, core._seed_key(name, seed), module.SIZE)
    blueprint = module.build(number, core.task_rng(name, seed, index))
    return core.render(name, seed, index, module.ENTRY, blueprint, core.split_of(blueprint.combos, module.HELDOUT))


def generate_many(name: str, seed: int, count: int, start: int = 0) -> list[sandbox_pb2.Task]:
    """Tasks start..start+count-1 of `seed` in family `name`."""
    return [generate(name, seed, index) for index in range(start, start + count)]


def task_from_id(text: str) -> sandbox_pb2.Task:
    """The task a family id names; KeyError when `text` is not one or its family is unknown."""
    parsed = core.parse_id(text)
    if parsed is None or parsed[0] not in FAMILIES:
        raise KeyError(text)
    try:
        return generate(*parsed)
    except IndexError:
        raise KeyError(text) from None


DEFAULT_SERVED = 1000  # tasks of a family a server serves when its setting gives no count
MAX_SERVED = 100_000  # most tasks of one family a server holds (about 3.5 KB each)


def tier_of(name: str, number: int) -> int:
    """The difficulty tier (1-3) of structure `number` of family `name`: the family's own
    `tier_of` where it has one (cheap), else the tier of the structure's task built with a
    fixed size generator (a tier never depends on sizes)."""
    module = family(name)
    if hasattr(module, "tier_of"):
        return module.tier_of(number)
    return module.build(number, core.task_rng(name, 0, 0)).tier


def tier_indices(name: str, seed: int, tier: int, count: int) -> list[int]:
    """The first `count` indices of `seed` in family `name` whose structure has tier `tier`
    (fewer when the family has fewer)."""
    module = family(name)
    key = core._seed_key(name, seed)
    found: list[int] = []
    for index in range(module.SIZE):
        if tier_of(name, core.permute(index, key, module.SIZE)) == tier:
            found.append(index)
            if len(found) == count:
                break
    return found


@dataclasses.dataclass(frozen=True)
class Served:
    """One entry of a server's `task_families` setting: the first `count` tasks of `family`,
    of tier `tier` only when it is not 0."""

    family: str
    count: int
    tier: int = 0


def served_tasks(entry: Served, seed: int) -> list[sandbox_pb2.Task]:
    """The tasks an entry of the setting names."""
    if not entry.tier:
        return generate_many(entry.family, seed, entry.count)
    return [generate(entry.family, seed, index) for index in tier_indices(entry.family, seed, entry.tier, entry.count)]


def parse_served(entries: Sequence[str]) -> list[Served]:
    """Each entry of a `NAME`, `NAME:COUNT`, `NAME@TIER` or `NAME@TIER:COUNT` list (a server's
    setting: the first COUNT tasks of the family, of tier TIER only when one is given;
    DEFAULT_SERVED when no count is given). ValueError naming the entry when a family is
    unknown, named twice, its tier is not 1, 2 or 3, or its count is not a whole number in
    1..min(MAX_SERVED, the family's size)."""
    served: dict[str, Served] = {}
    for entry in entries:
        head, sep, text = entry.strip().partition(":")
        name, at, tier_text = head.partition("@")
        module = family(name)
        tier = 0
        if at:
            if tier_text not in ("1", "2", "3"):
                raise ValueError(f"task family entry {entry!r}: the tier after @ must be 1, 2 or 3")
            tier = int(tier_text)
        if not sep:
            count = min(DEFAULT_SERVED, module.SIZE)
        elif text.isdigit() and 1 <= int(text) <= min(MAX_SERVED, module.SIZE):
            count = int(text)
        else:
            raise ValueError(f"task family entry {entry!r}: the count must be a whole number from 1 to "
                             f"{min(MAX_SERVED, module.SIZE)}")
        if name in served:
            raise ValueError(f"task family {name!r} is named twice")
        served[name] = Served(name, count, tier)
    return list(served.values())


__all__ = ["DEFAULT_SERVED", "FAMILIES", "MAX_SERVED", "Served", "family", "generate", "generate_many",
           "parse_served", "served_tasks", "task_from_id", "tier_indices", "tier_of"]
