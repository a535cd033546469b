"""gRPC errors with rich details (google.rpc.Status), raised by handlers.

A handler raises `ServiceError` (usually through one of the helpers below); the runtime's
interceptor turns it into the status the client sees, with `BadRequest`, `ResourceInfo`,
`RetryInfo` or `ErrorInfo` details in the standard `grpc-status-details-bin` trailer that
every gRPC language can decode. A candidate kernel that fails is never an error: it is a
verdict.

Every status is bounded, whatever a handler put in it, so that it always reaches the client:
a status travels in the trailers, and a client drops trailers over its metadata limit (8 KiB
by default in every gRPC language) with `RESOURCE_EXHAUSTED "received metadata size exceeds
limit"` instead of the error. So echoed values are cut (`cut`: 120 characters, then the
original length), field paths and descriptions are shortened in the middle, at most 20
violations are listed (then one `...` entry: "and N more"), and `to_status` shrinks whatever
is left until the status costs at most `MAX_STATUS_WIRE_BYTES` (4 KiB) on the wire.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "leap.dev"

MAX_VALUE_CHARS = 120  # an echoed value (a name, an id, a path) in a message or detail
MAX_FIELD_CHARS = 200  # a field path
MAX_DESCRIPTION_CHARS = 400  # a violation's description, or any other string of a detail
MAX_VIOLATIONS = 20  # field violations listed; the rest are counted in one "..." entry
MAX_MESSAGE_WIRE_BYTES = 768  # the status message as sent (percent-encoded grpc-message)
# grpc-message plus grpc-status-details-bin (base64 of the Status, which repeats the message):
# half of the 8 KiB a default client accepts, leaving room for every other trailer.
MAX_STATUS_WIRE_BYTES = 4096
MORE_FIELD = "..."  # the field of the violation that counts the ones left out
_MORE = re.compile(r"^and (\d+) more")
_ESCAPED = re.compile(rb"[^\x20-\x24\x26-\x7e]")  # what grpc-message percent-encodes


def cut(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """An echoed value for a message: itself when short, else its first `limit` characters,
    an ellipsis and its length (`'aaaa...' (20000 chars)`); not a string: its repr."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def shorten(text: str, limit: int) -> str:
    """`text` in at most about `limit` characters: the head and the tail kept, the middle
    replaced by how much was cut (a description's explanation is usually at its end)."""
    if len(text) <= limit:
        return text
    marker = f"...[{len(text) - limit} chars cut]..."
    keep = max(limit - len(marker), 2)
    head = keep * 2 // 3
    return f"{text[:head]}{marker}{text[len(text) - (keep - head):]}"


def message_wire_bytes(message: str) -> int:
    """Bytes of `message` in a grpc-message trailer: UTF-8, percent-encoding every byte
    outside printable ASCII and '%' itself (three bytes each)."""
    raw = message.encode("utf-8", "replace")
    return len(raw) + 2 * len(_ESCAPED.findall(raw))


def status_wire_bytes(status: status_pb2.Status) -> int:
    """What `status` costs in the trailers: its message plus its base64-encoded self."""
    return message_wire_bytes(status.message) + len(base64.b64encode(status.SerializeToString()))


def _fit_message(message: str, budget: int = MAX_MESSAGE_WIRE_BYTES) -> str:
    if len(message) <= budget and message_wire_bytes(message) <= budget:
        return message
    limit = min(len(message), budget + 1)  # a character is at least one byte on the wire
    while limit > 16:
        limit = limit * 3 // 4
        candidate = shorten(message, limit)
        if message_wire_bytes(candidate) <= budget:
            return candidate
    return message.encode("ascii", "replace")[:16].decode()


def _cut_strings(message: Message, limit: int) -> None:
    """Shorten every string of `message` (recursively) to about `limit` characters."""
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_STRING:
            if field.is_repeated:
                value[:] = [shorten(v, limit) for v in value]
            else:
                setattr(message, field.name, shorten(value, limit))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_STRING:
                    for key in list(value):
                        value[key] = shorten(value[key], limit)
            elif field.is_repeated:
                for item in value:
                    _cut_strings(item, limit)
            else:
                _cut_strings(value, limit)


def _halve_repeated(message: Message) -> bool:
    """Halve every repeated field and map of `message` (recursively) that has more than one
    entry; False when none had."""
    changed = False
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            if len(value) > 1:
                for key in sorted(value)[(len(value) + 1) // 2:]:
                    del value[key]
                changed = True
        elif field.is_repeated:
            if len(value) > 1:
                del value[(len(value) + 1) // 2:]
                changed = True
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    changed = _halve_repeated(item) or changed
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            changed = _halve_repeated(value) or changed
    return changed


def _more_entry(count: int) -> error_details_pb2.BadRequest.FieldViolation:
    return error_details_pb2.BadRequest.FieldViolation(
        field=MORE_FIELD, description=f"and {count} more violation{'s' if count != 1 else ''} not listed")


def _drop_violations(bad_request: error_details_pb2.BadRequest, keep: int) -> bool:
    """Keep the first `keep` real violations, counting the rest in one "..." entry; False
    when there was nothing to drop."""
    listed = [v for v in bad_request.field_violations if v.field != MORE_FIELD]
    more = sum(int(m.group(1)) for v in bad_request.field_violations
               if v.field == MORE_FIELD and (m := _MORE.match(v.description)))
    if len(listed) <= keep:
        return False
    more += len(listed) - keep
    del bad_request.field_violations[:]
    bad_request.field_violations.extend([*listed[:keep], _more_entry(more)])
    return True


def bounded_status(code: grpc.StatusCode, message: str, details: Iterable[Message] = ()) -> status_pb2.Status:
    """The google.rpc.Status of an error, bounded whatever it holds: strings shortened, at most
    MAX_VIOLATIONS violations, and shrunk (fewer violations, shorter strings, at last no
    details) until it costs at most MAX_STATUS_WIRE_BYTES on the wire. The steps, each only
    while still too large: list fewer violations, halve the strings (down to 40 characters),
    halve the other repeated fields and maps, drop the details."""
    copies = []
    for detail in details:
        copy = type(detail)()
        copy.CopyFrom(detail)
        copies.append(copy)
    text = _fit_message(message)
    limit = MAX_DESCRIPTION_CHARS
    for copy in copies:
        if isinstance(copy, error_details_pb2.BadRequest):
            _drop_violations(copy, MAX_VIOLATIONS)
        _cut_strings(copy, limit)

    def build() -> status_pb2.Status:
        packed = []
        for copy in copies:
            wrapper = any_pb2.Any()
            wrapper.Pack(copy)
            packed.append(wrapper)
        return status_pb2.Status(code=code.value[0], message=text, details=packed)

    status = build()
    while status_wire_bytes(status) > MAX_STATUS_WIRE_BYTES:
        requests = [c for c in copies if isinstance(c, error_details_pb2.BadRequest)]
        listed = max((sum(v.field != MORE_FIELD for v in r.field_violations) for r in requests), default=0)
        if listed > 1:
            for r in requests:
                _drop_violations(r, max(1, listed // 2))
        elif limit > 40:
            limit //= 2
            for copy in copies:
                _cut_strings(copy, limit)
        elif any([_halve_repeated(copy) for copy in copies]):
            pass
        elif copies:
            copies = []
        else:
            text = _fit_message(text, MAX_MESSAGE_WIRE_BYTES // 4)
            status = build()
            break
        status = build()
    return status


class StartupError(Exception):
    """A service cannot start as configured (one line, for the operator: what is missing and
    which setting changes it). `leap serve` prints it and exits non-zero."""


class ServiceError(Exception):
    """An error meant for the client: a status code, a message and rich details."""

    def __init__(self, code: grpc.StatusCode, message: str, details: Iterable[Message] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = list(details)

    def to_status(self) -> grpc.Status:
        """The status the client gets, bounded (see `bounded_status`)."""
        return rpc_status.to_status(bounded_status(self.code, self.message, self.details))


def invalid_argument(field: str, description: str) -> ServiceError:
    """INVALID_ARGUMENT naming one field, for example ("sampling.n", "must be at least 1")."""
    return Violations().add(field, description).error()


def _fitting(text: str, wire_bytes: int) -> str:
    """`text`, shortened (`shorten`) until its grpc-message encoding takes at most `wire_bytes`
    (each non-ASCII byte costs three), or to MAX_VALUE_CHARS characters."""
    chars = wire_bytes
    part = shorten(text, chars)
    while message_wire_bytes(part) > wire_bytes and chars > MAX_VALUE_CHARS:
        chars = max(MAX_VALUE_CHARS, chars * 2 // 3)
        part = shorten(text, chars)
    return part


class Violations:
    """Collects every bad field of a request, so the client learns all of them at once.

        v = Violations()
        if not request.model:
            v.add("model", "is required")
        v.raise_if_any()

    Field paths and descriptions are shortened as they are added (an echoed value belongs in
    `cut(...)`); the error lists the first MAX_VIOLATIONS and counts the rest.
    """

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, field: str, description: str) -> Violations:
        self.items.append((shorten(field, MAX_FIELD_CHARS), shorten(description, MAX_DESCRIPTION_CHARS)))
        return self

    def check(self, ok: bool, field: str, description: str) -> Violations:
        if not ok:
            self.add(field, description)
        return self

    def error(self) -> ServiceError:
        listed = self.items[:MAX_VIOLATIONS]
        violations = [error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                      for field, description in listed]
        if len(self.items) > len(listed):
            violations.append(_more_entry(len(self.items) - len(listed)))
        # The message names as many violations as fit (then only their fields, then a count):
        # a person reading a log line learns what was wrong; a program reads the BadRequest.
        # A lone violation is given whole where it fits (most errors name one field, and its
        # explanation is at the end); several share the room at MAX_VALUE_CHARS each.
        budget = MAX_MESSAGE_WIRE_BYTES - 80  # room for the prefix and the count
        used = 0
        parts: list[str] = []
        for field, description in self.items:
            part = (_fitting(f"{field}: {description}", budget * 3 // 5) if len(self.items) == 1
                    else shorten(f"{field}: {description}", MAX_VALUE_CHARS))
            if parts and used + message_wire_bytes(part) + 2 > budget * 3 // 5:  # the rest for names
                break
            parts.append(part)
            used += message_wire_bytes(part) + 2
        names: list[str] = []
        for field, _ in self.items[len(parts):]:
            name = shorten(field, MAX_VALUE_CHARS // 2)
            if used + message_wire_bytes(name) + 2 > budget:
                break
            names.append(name)
            used += message_wire_bytes(name) + 2
        rest = len(self.items) - len(parts) - len(names)
        message = "; ".join(parts) + (f"; also {', '.join(names)}" if names else "") + \
            (f"; and {rest} more (see the BadRequest details)" if rest else "")
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {message}",
                            [error_details_pb2.BadRequest(field_violations=violations)])

    def raise_if_any(self) -> None:
        if self.items:
            raise self.error()


def not_found(resource_type: str, name: str, description: str = "") -> ServiceError:
    """NOT_FOUND for a missing task, model or run, with ResourceInfo (the name cut)."""
    info = error_details_pb2.ResourceInfo(resource_type=resource_type, resource_name=cut(name), description=description)
    text = f"{resource_type} {cut(name)!r} not found" + (f": {description}" if description else "")
    return ServiceError(grpc.StatusCode.NOT_FOUND, text, [info])


def resource_exhausted(message: str, retry_after_seconds: float) -> ServiceError:
    """RESOURCE_EXHAUSTED for a full queue, with a RetryInfo hint."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_seconds * 1e9))
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, [error_details_pb2.RetryInfo(retry_delay=delay)])


def failed_precondition(message: str, reason: str) -> ServiceError:
    """FAILED_PRECONDITION (for example: stop a run that already ended), with ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message, [info])


def error_info(code: grpc.StatusCode, message: str, reason: str, **metadata: str) -> ServiceError:
    """Any status with an ErrorInfo reason (UPPER_SNAKE_CASE) and metadata."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)
    return ServiceError(code, message, [info])


def details_of(error: grpc.RpcError) -> list[Message]:
    """Client side: the unpacked rich details of a failed call (empty when it has none)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    if status is None:
        return []
    known = [
        error_details_pb2.BadRequest,
        error_details_pb2.ResourceInfo,
        error_details_pb2.RetryInfo,
        error_details_pb2.ErrorInfo,
    ]
    unpacked: list[Message] = []
    for wrapper in status.details:
        for cls in known:
            if wrapper.Is(cls.DESCRIPTOR):
                message = cls()
                wrapper.Unpack(message)
                unpacked.append(message)
    return unpacked


def violated_fields(error: grpc.RpcError) -> list[str]:
    """Client side: the fields a failed call's `BadRequest` names (empty when it has none)."""
    return [violation.field for detail in details_of(error) if isinstance(detail, error_details_pb2.BadRequest)
            for violation in detail.field_violations]


def explain(error: grpc.RpcError) -> str:
    """Client side: what a person reads of a failed call: each field violation of its
    `BadRequest` in full ("config.steps: is required ..."; the status message shortens each
    one to fit the trailer), else the status message."""
    violations = [f"{v.field}: {v.description}" for detail in details_of(error)
                  if isinstance(detail, error_details_pb2.BadRequest) for v in detail.field_violations]
    return "; ".join(violations) if violations else (error.details() or "")


def call_failure(error: BaseException) -> str | None:
    """Client side: one line for a failed call of any stub, blocking or aio ("INVALID_ARGUMENT
    from the service: config.steps: ..."); None for anything that is not a call's status."""
    if not isinstance(error, grpc.RpcError) or not callable(getattr(error, "code", None)):
        return None
    return f"{error.code().name} from the service: {explain(error)}"


def error_reasons(error: grpc.RpcError) -> list[str]:
    """Client side: the `ErrorInfo` reasons of a failed call (empty when it has none)."""
    return [detail.reason for detail in details_of(error) if isinstance(detail, error_details_pb2.ErrorInfo)]
