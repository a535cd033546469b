"""Checks the runtime applies to every request message before a handler sees it.

`non_finite_fields` walks a parsed message by reflection and names every float or double
that is NaN or infinite (`sampling.temperature`, `groups[2].trajectories[0].turns[1].speedup`,
`weights["lr"]`). No field of a LEAP contract means anything by NaN or infinity, and a
non-finite number that slips through poisons what it touches (an infinite learning rate
trains a model into NaN), so the runtime refuses them all in one place; a field that does
take infinity is named in its service's `Registration.finite_exempt` (full proto names,
`leap.x.v1.Message.field`). Ranges (`learning_rate > 0`) stay each service's own checks.

Only the set fields are visited (`ListFields`), and messages whose type cannot hold a float
anywhere below it are skipped, so a weight chunk or a list of token ids costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

FLOAT_TYPES = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
_HAS_FLOATS: dict[str, bool] = {}


def has_floats(descriptor: Descriptor) -> bool:
    """Whether a message of this type can hold a float or double anywhere (recursively)."""
    known = _HAS_FLOATS.get(descriptor.full_name)
    if known is not None:
        return known
    _HAS_FLOATS[descriptor.full_name] = False  # a recursive type (Struct) is resolved by its other fields
    found = any(f.type in FLOAT_TYPES or (f.type == FieldDescriptor.TYPE_MESSAGE and has_floats(f.message_type))
                for f in descriptor.fields)
    _HAS_FLOATS[descriptor.full_name] = found
    return found


class _Plan:
    """Where the floats of a message type are: its float fields, and its message fields whose
    types hold floats (with their own plans), exempt fields left out."""

    def __init__(self, descriptor: Descriptor, exempt: frozenset[str]):
        self.scalars: list[str] = []
        self.repeated_scalars: list[str] = []
        self.messages: list[tuple[str, bool, _Plan]] = []  # (field, repeated, plan)
        self.maps: list[tuple[str, bool, _Plan | None]] = []  # (field, value is a message, plan)
        for field in descriptor.fields:
            if field.full_name in exempt:
                continue
            if field.type in FLOAT_TYPES:
                (self.repeated_scalars if field.is_repeated else self.scalars).append(field.name)
            elif field.type == FieldDescriptor.TYPE_MESSAGE and has_floats(field.message_type):
                if field.message_type.GetOptions().map_entry:
                    value = field.message_type.fields_by_name["value"]
                    if value.full_name in exempt:
                        continue
                    if value.type in FLOAT_TYPES:
                        self.maps.append((field.name, False, None))
                    else:
                        self.maps.append((field.name, True, plan_of(value.message_type, exempt)))
                else:
                    self.messages.append((field.name, field.is_repeated, plan_of(field.message_type, exempt)))


_PLANS: dict[tuple[str, frozenset[str]], _Plan] = {}


def plan_of(descriptor: Descriptor, exempt: frozenset[str]) -> _Plan:
    key = (descriptor.full_name, exempt)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _Plan.__new__(_Plan)  # placeholder first: a recursive type refers to itself
        plan.__init__(descriptor, exempt)
    return plan


class _Level:
    """Messages at one place of the tree, checked together (one getattr per message and field
    instead of a Python generator per message), with how to name each one's path."""

    def __init__(self, messages: list, parent: _Level | None = None, owners: list[int] | None = None,
                 field: str = "", keys: list | None = None, is_map: bool = False):
        self.messages = messages
        self.parent = parent
        self.owners = owners  # index of each message's owner in the parent level
        self.field = field
        self.keys = keys  # each message's index (repeated) or key (map); None: a singular field
        self.is_map = is_map

    def path(self, index: int) -> str:
        if self.parent is None:
            return ""
        assert self.owners is not None
        where = "" if self.keys is None else (f"[{self.keys[index]!r}]" if self.is_map else f"[{self.keys[index]}]")
        return f"{self.parent.path(self.owners[index])}{self.field}{where}."


def _scan(level: _Level, plan: _Plan) -> Iterator[str]:
    messages = level.messages
    isfinite = math.isfinite
    for name in plan.scalars:
        values = [getattr(m, name) for m in messages]
        if not all(map(isfinite, values)):
            yield from (f"{level.path(i)}{name}" for i, v in enumerate(values) if not isfinite(v))
    for name in plan.repeated_scalars:
        for i, m in enumerate(messages):
            values = getattr(m, name)
            if values and not all(map(isfinite, values)):
                yield from (f"{level.path(i)}{name}[{j}]" for j, v in enumerate(values) if not isfinite(v))
    for name, repeated, child in plan.messages:
        if repeated:
            children, owners, keys = [], [], []
            for i, m in enumerate(messages):
                items = getattr(m, name)
                if items:
                    children.extend(items)
                    owners.extend([i] * len(items))
                    keys.extend(range(len(items)))
            if children:
                yield from _scan(_Level(children, level, owners, name, keys), child)
        else:
            owners = [i for i, m in enumerate(messages) if m.HasField(name)]
            if owners:
                yield from _scan(_Level([getattr(messages[i], name) for i in owners], level, owners, name), child)
    for name, is_message, child in plan.maps:
        for i, m in enumerate(messages):
            entries = getattr(m, name)
            if not entries:
                continue
            keys = sorted(entries)
            if is_message:
                assert child is not None
                yield from _scan(_Level([entries[k] for k in keys], level, [i] * len(keys), name, keys, True), child)
            else:
                yield from (f"{level.path(i)}{name}[{k!r}]" for k in keys if not isfinite(entries[k]))


def non_finite_fields(message: Message, exempt: frozenset[str] = frozenset(), prefix: str = "") -> Iterator[str]:
    """The paths of every NaN or infinite float of `message` (recursively): by field, then by
    position. The messages at one depth are visited together, so a batch of 300,000 turns
    costs about a tenth of a second, not seconds on the event loop."""
    if not has_floats(message.DESCRIPTOR):
        return
    yield from (f"{prefix}{path}" for path in _scan(_Level([message]), plan_of(message.DESCRIPTOR, exempt)))
