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


def non_finite_fields(message: Message, exempt: frozenset[str] = frozenset(), prefix: str = "") -> Iterator[str]:
    """The paths of every NaN or infinite float of `message` (recursively), in field order."""
    if not has_floats(message.DESCRIPTOR):
        return
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if field.full_name in exempt:
            continue
        if field.type in FLOAT_TYPES:
            if field.is_repeated:
                if not all(map(math.isfinite, value)):
                    yield from (f"{path}[{i}]" for i, x in enumerate(value) if not math.isfinite(x))
            elif not math.isfinite(value):
                yield path
        elif field.type == FieldDescriptor.TYPE_MESSAGE and has_floats(field.message_type):
            if field.message_type.GetOptions().map_entry:
                entry = field.message_type.fields_by_name["value"]
                for key in sorted(value):
                    item = value[key]
                    if entry.type in FLOAT_TYPES:
                        if not math.isfinite(item):
                            yield f"{path}[{key!r}]"
                    elif entry.type == FieldDescriptor.TYPE_MESSAGE:
                        yield from non_finite_fields(item, exempt, f"{path}[{key!r}].")
            elif field.is_repeated:
                for i, item in enumerate(value):
                    yield from non_finite_fields(item, exempt, f"{path}[{i}].")
            else:
                yield from non_finite_fields(value, exempt, f"{path}.")
