"""The server interceptor every call passes through: auth, request ids, JSON call logs, and
the mapping of exceptions to statuses.

- `ServiceError` (see errors.py) becomes its status with rich details;
- `NotImplementedError` becomes UNIMPLEMENTED (an RPC whose issue has not landed yet);
- any other exception becomes INTERNAL with only the request id: the traceback goes to the
  service's log, never to the client, and the server keeps serving.
"""

from __future__ import annotations

import hmac
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from leap.runtime.errors import ServiceError
from leap.runtime.logging import get_logger

REQUEST_ID_KEY = "x-request-id"
# Set by gRPC clients on a retried attempt (the retry policy of leap.clients retries
# UNAVAILABLE), so the log shows which replica finally served a retried call.
PREVIOUS_ATTEMPTS_KEY = "grpc-previous-rpc-attempts"

log = get_logger("leap.calls")


class CallInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth_token: str = "", exempt_prefixes: tuple[str, ...] = ()):
        self.expected_auth = f"Bearer {auth_token}" if auth_token else ""
        self.exempt_prefixes = exempt_prefixes
        # True until the service's on_start is done (models loaded, caches warm): calls other
        # than health checks are then UNAVAILABLE, which clients retry, instead of reaching a
        # servicer that is not ready (a restarted policy would answer NOT_FOUND for its model).
        self.starting = True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        exempt = method.startswith(self.exempt_prefixes)  # health probes: no auth, no start gate, debug level only
        needs_auth = bool(self.expected_auth) and not exempt
        authorized = not needs_auth or hmac.compare_digest(metadata.get("authorization", ""), self.expected_auth)
        request_id = metadata.get(REQUEST_ID_KEY) or uuid.uuid4().hex
        previous = metadata.get(PREVIOUS_ATTEMPTS_KEY, "")
        attempt = 1 + int(previous) if previous.isdigit() else 1
        starting = self.starting and not exempt
        call = _Call(method, request_id, authorized, exempt, attempt, starting)
        return _wrap(handler, call)


class _Call:
    """Per-call bookkeeping: runs the behavior and logs how it ended."""

    def __init__(self, method: str, request_id: str, authorized: bool, quiet: bool, attempt: int = 1,
                 starting: bool = False):
        self.method = method
        self.request_id = request_id
        self.authorized = authorized
        self.quiet = quiet
        self.attempt = attempt
        self.starting = starting

    async def guard(self, context: grpc.aio.ServicerContext, body: Callable[[], Any]) -> AsyncIterator[Any]:
        """Run body (which yields responses) with auth, error mapping and logging."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        with structlog.contextvars.bound_contextvars(request_id=self.request_id, method=self.method):
            try:
                if not self.authorized:
                    code = grpc.StatusCode.UNAUTHENTICATED
                    await context.abort(code, "missing or wrong bearer token in the 'authorization' metadata")
                if self.starting:
                    code = grpc.StatusCode.UNAVAILABLE
                    await context.abort(code, "the service is starting (its health check is not SERVING yet); retry")
                async for item in body():
                    yield item
            except ServiceError as err:
                code = err.code
                await context.abort_with_status(err.to_status())
            except NotImplementedError:
                code = grpc.StatusCode.UNIMPLEMENTED
                name = self.method.rsplit("/", 1)[-1]
                await context.abort(code, f"{name} is not implemented by this service yet")
            except grpc.aio.AbortError:
                code = _code_of(context, code)
                raise
            except BaseException as err:
                if isinstance(err, (GeneratorExit, KeyboardInterrupt, SystemExit)) or _is_cancel(err):
                    code = grpc.StatusCode.CANCELLED
                    raise
                code = grpc.StatusCode.INTERNAL
                log.exception("unhandled error in handler")
                await context.abort(code, f"internal error (request id {self.request_id})")
            finally:
                level = log.debug if self.quiet else log.info
                retried = {"attempt": self.attempt} if self.attempt > 1 else {}
                level("call", code=code.name, latency_ms=round((time.perf_counter() - start) * 1000, 3), **retried)


def _is_cancel(err: BaseException) -> bool:
    import asyncio

    return isinstance(err, asyncio.CancelledError)


def _code_of(context: grpc.aio.ServicerContext, fallback: grpc.StatusCode) -> grpc.StatusCode:
    try:
        code = context.code()
    except Exception:  # older grpc versions lack code() on aio contexts
        return fallback
    if isinstance(code, grpc.StatusCode):
        return code
    for candidate in grpc.StatusCode:
        if candidate.value[0] == code:
            return candidate
    return fallback


async def _results(behavior: Callable[..., Any], request: Any, context: Any) -> AsyncIterator[Any]:
    """Yield whatever a behavior produces: a value, an awaitable, or a (async) generator."""
    result = behavior(request, context)
    if inspect.isasyncgen(result):
        async for item in result:
            yield item
        return
    if inspect.isawaitable(result):
        result = await result
    if inspect.isgenerator(result):
        for item in result:
            yield item
        return
    yield result


def _wrap(handler: grpc.RpcMethodHandler, call: _Call) -> grpc.RpcMethodHandler:
    if handler.response_streaming:
        behavior = handler.unary_stream or handler.stream_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in call.guard(context, lambda: _results(behavior, request, context)):
                if item is not None:  # a coroutine that used context.write() returns None
                    yield item

        factory = grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        return factory(streaming, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)

    behavior = handler.unary_unary or handler.stream_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = None
        async for item in call.guard(context, lambda: _results(behavior, request, context)):
            response = item
        return response

    factory = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return factory(unary, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)
