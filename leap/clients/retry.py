"""Patience with a service that went away: a learner's calls retried with backoff for a
bounded time, then one clear error naming the service, instead of a silent hang.

The channel of `leap.clients` already retries UNAVAILABLE a few times within a second or
two; that covers a dropped connection, not a service being restarted. A run wraps each call
in `with_retries`, which keeps trying for `Patience.seconds`:

    result = await with_retries(lambda: sandbox.GetTask(request), "sandbox", target, patience)

UNAVAILABLE is retried with exponential backoff; RESOURCE_EXHAUSTED is retried after the
delay its `google.rpc.RetryInfo` asks for (a full queue). Anything else is not retried: it is
raised as `ServiceRefused`, still a `grpc.aio.AioRpcError` (code, details and rich details as
received) that also knows which service refused what, so a run can fail with a sentence
(`ServiceRefused.sentence`) instead of an error's repr.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.rpc import error_details_pb2

from leap.runtime.errors import details_of

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Patience:
    """How long to keep retrying a service, and how the waits between tries grow."""

    seconds: float = 60.0
    first_delay: float = 0.5
    max_delay: float = 8.0


class ServiceRefused(grpc.aio.AioRpcError):
    """A service answered a call with an error that retrying cannot fix (bad input, a missing
    resource, a failed precondition): the error itself, plus who refused what."""

    def __init__(self, service: str, target: str, action: str, cause: grpc.aio.AioRpcError):
        super().__init__(cause.code(), cause.initial_metadata(), cause.trailing_metadata(), cause.details(),
                         cause.debug_error_string())
        self.service = service
        self.target = target
        self.action = action

    @property
    def sentence(self) -> str:
        """For example "the sandbox service at 127.0.0.1:50052 refused the evaluation
        (INVALID_ARGUMENT: invalid request: candidates[3].source: ...)"."""
        return f"the {self.service} service at {self.target} refused {self.action} ({self.code().name}: {self.details()})"

    def __str__(self) -> str:
        return self.sentence


def refusal(error: grpc.RpcError) -> str:
    """The sentence of any RPC error (a `ServiceRefused` names its service and action)."""
    if isinstance(error, ServiceRefused):
        return error.sentence
    code = error.code().name if hasattr(error, "code") else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else str(error)
    return f"a call to another service failed ({code}: {details})"


class ServiceUnavailable(Exception):
    """A service kept failing past the caller's patience."""

    def __init__(self, service: str, target: str, seconds: float, cause: grpc.RpcError):
        code = cause.code().name if hasattr(cause, "code") else "UNKNOWN"
        details = cause.details() if hasattr(cause, "details") else str(cause)
        super().__init__(f"the {service} service at {target} did not answer for {seconds:.0f} s ({code}: {details})")
        self.service = service
        self.target = target


def retry_delay(error: grpc.RpcError, backoff: float) -> float | None:
    """Seconds to wait before trying `error`'s call again, or None when it is not worth retrying."""
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return backoff
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        for detail in details_of(error):
            if isinstance(detail, error_details_pb2.RetryInfo):
                return detail.retry_delay.ToTimedelta().total_seconds()
    return None


async def with_retries(call: Callable[[], Awaitable[T]], service: str, target: str, patience: Patience,
                       action: str = "the call") -> T:
    """`await call()`, tried again on UNAVAILABLE (backoff) and RESOURCE_EXHAUSTED (its
    RetryInfo delay) until `patience.seconds` have passed; then `ServiceUnavailable`. Any
    other error is `ServiceRefused` (what `action` was, for example "the evaluation")."""
    deadline = time.monotonic() + patience.seconds
    backoff = patience.first_delay
    while True:
        try:
            return await call()
        except grpc.RpcError as error:
            delay = retry_delay(error, backoff)
            if delay is None:
                if isinstance(error, grpc.aio.AioRpcError) and not isinstance(error, ServiceRefused):
                    raise ServiceRefused(service, target, action, error) from error
                raise
            if time.monotonic() + delay > deadline:
                raise ServiceUnavailable(service, target, patience.seconds, error) from error
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, patience.max_delay)
