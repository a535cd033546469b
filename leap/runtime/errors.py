"""gRPC errors with rich details (google.rpc.Status), raised by handlers.

A handler raises `ServiceError` (usually through one of the helpers below); the runtime's
interceptor turns it into the status the client sees, with `BadRequest`, `ResourceInfo`,
`RetryInfo` or `ErrorInfo` details in the standard `grpc-status-details-bin` trailer that
every gRPC language can decode. A candidate kernel that fails is never an error: it is a
verdict.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "leap.dev"


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
        packed = []
        for detail in self.details:
            wrapper = any_pb2.Any()
            wrapper.Pack(detail)
            packed.append(wrapper)
        proto = status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)
        return rpc_status.to_status(proto)


def invalid_argument(field: str, description: str) -> ServiceError:
    """INVALID_ARGUMENT naming one field, for example ("sampling.n", "must be at least 1")."""
    return Violations().add(field, description).error()


class Violations:
    """Collects every bad field of a request, so the client learns all of them at once.

        v = Violations()
        if not request.model:
            v.add("model", "is required")
        v.raise_if_any()
    """

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, field: str, description: str) -> Violations:
        self.items.append((field, description))
        return self

    def check(self, ok: bool, field: str, description: str) -> Violations:
        if not ok:
            self.add(field, description)
        return self

    def error(self) -> ServiceError:
        message = "; ".join(f"{field}: {description}" for field, description in self.items)
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
                for field, description in self.items
            ]
        )
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {message}", [bad_request])

    def raise_if_any(self) -> None:
        if self.items:
            raise self.error()


def not_found(resource_type: str, name: str, description: str = "") -> ServiceError:
    """NOT_FOUND for a missing task, model or run, with ResourceInfo."""
    info = error_details_pb2.ResourceInfo(resource_type=resource_type, resource_name=name, description=description)
    text = f"{resource_type} {name!r} not found" + (f": {description}" if description else "")
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


def error_reasons(error: grpc.RpcError) -> list[str]:
    """Client side: the `ErrorInfo` reasons of a failed call (empty when it has none)."""
    return [detail.reason for detail in details_of(error) if isinstance(detail, error_details_pb2.ErrorInfo)]
