"""The server interceptor every call passes through: auth, request ids, request checks, JSON
call logs, and the mapping of exceptions to statuses.

Each call, in order:
1. auth: with an `auth_token`, exactly one `authorization: Bearer <token>` header (the
   scheme in any case, RFC 6750) or UNAUTHENTICATED; health checks are exempt;
2. the start gate: UNAVAILABLE (clients retry it) until the service's `on_start` is done;
3. the request's size against its RPC's own limit (`MethodRules.limit_bytes`, from the
   service's `Registration.request_limits`), before it is parsed: RESOURCE_EXHAUSTED naming
   the limit. gRPC's server-wide `max_message_bytes` stays the ceiling;
4. parsing: handlers are registered with no deserializer, so the runtime parses the bytes
   here, after auth; bytes that are no message of the RPC's type are INVALID_ARGUMENT (not
   the UNKNOWN "Unexpected DecodeError" gRPC gives, logged without a request id);
5. every float of the message finite (`checks.non_finite_fields`): INVALID_ARGUMENT naming
   each NaN or infinite field.
Messages of a client stream (weights) get 3 to 5 one by one as the handler reads them.

Then the handler runs, and what it raises becomes a status:
- `ServiceError` (see errors.py) becomes its status with rich details, bounded in size;
- `NotImplementedError` becomes UNIMPLEMENTED (an RPC whose issue has not landed yet);
- any other exception becomes INTERNAL with only the request id: the traceback goes to the
  service's log, never to the client, and the server keeps serving.
Every call is logged as one JSON line with its request id, method, code and latency.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import dataclasses
import hmac
import inspect
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
import structlog

from leap.runtime.checks import has_floats, non_finite_fields
from leap.runtime.errors import ServiceError, Violations, error_info
from leap.runtime.logging import get_logger

REQUEST_ID_KEY = "x-request-id"
# Set by gRPC clients on a retried attempt (the retry policy of leap.clients retries
# UNAVAILABLE), so the log shows which replica finally served a retried call.
PREVIOUS_ATTEMPTS_KEY = "grpc-previous-rpc-attempts"
# A client's request id is used when it looks like one; anything else gets a fresh id (so a
# 20 KB header is not copied into every log line of the call).
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
# The limit of an RPC its service does not list (gRPC's own default receive limit).
DEFAULT_REQUEST_BYTES = 4 * 1024 * 1024

# A refused request at least this large has the C library hand its freed memory back to the
# OS soon after (see release_freed_memory).
RELEASE_ABOVE_BYTES = 1024 * 1024
# Unary requests larger than this are parsed and checked on a worker thread.
OFFLOAD_ABOVE_BYTES = 256 * 1024
# Every NaN or infinite float has, in its little-endian encoding, a byte >= 0x80 followed by
# 0x7F or 0xFF (the exponent's bits all set): request bytes without such a pair hold only
# finite floats, and their message is not walked at all (one scan in C).
MAYBE_NON_FINITE = re.compile(rb"[\x80-\xff][\x7f\xff]")

log = get_logger("leap.calls")
_release_pending = False


def release_freed_memory(delay: float = 0.2) -> None:
    """Soon (after the refused request's buffers are freed), return the C library's free
    memory to the OS with glibc's malloc_trim, on a worker thread; at most one pending. A
    service that keeps freed memory for reuse (the policy raises glibc's trim threshold for
    weight streams) would otherwise hold on to every oversized request a client sends.
    Does nothing where the C library is not glibc."""
    global _release_pending
    if _release_pending:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    _release_pending = True

    def trim() -> None:
        global _release_pending
        _release_pending = False
        try:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    loop.call_later(delay, lambda: loop.run_in_executor(None, trim))


@dataclasses.dataclass(frozen=True)
class MethodRules:
    """What the runtime checks of one RPC's request messages before its handler runs."""

    limit_bytes: int = DEFAULT_REQUEST_BYTES  # largest request message (each one of a client stream)
    finite_exempt: frozenset[str] = frozenset()  # full names of float fields that may be NaN or infinite


def bearer_problem(values: list[str], expected_token: str) -> str:
    """Why the `authorization` header values of a call do not carry `expected_token` (empty
    when they do): exactly one header, scheme `Bearer` in any case (RFC 6750), the token."""
    if not values:
        return "missing bearer token: send the 'authorization: Bearer <token>' metadata"
    if len(values) > 1:
        return f"{len(values)} 'authorization' metadata entries; send exactly one"
    scheme, _, token = values[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        return "the 'authorization' metadata must be 'Bearer <token>'"
    if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                               expected_token.encode("utf-8", "surrogateescape")):
        return "wrong bearer token in the 'authorization' metadata"
    return ""


class CallInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth_token: str = "", exempt_prefixes: tuple[str, ...] = (),
                 rules: Mapping[str, MethodRules] | None = None):
        self.auth_token = auth_token
        self.exempt_prefixes = exempt_prefixes
        self.rules = dict(rules or {})  # full method path ("/leap.x.v1.XService/Rpc") -> its rules
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
        pairs = [(k, v) for k, v in (details.invocation_metadata or ()) if isinstance(v, str)]
        metadata = dict(pairs)
        exempt = method.startswith(self.exempt_prefixes)  # health probes: no auth, no start gate, debug level only
        auth_problem = ""
        if self.auth_token and not exempt:
            auth_problem = bearer_problem([v for k, v in pairs if k == "authorization"], self.auth_token)
        given = metadata.get(REQUEST_ID_KEY, "")
        request_id = given if REQUEST_ID.match(given) else uuid.uuid4().hex
        previous = metadata.get(PREVIOUS_ATTEMPTS_KEY, "")
        attempt = 1 + int(previous) if previous.isdigit() and len(previous) < 6 else 1
        starting = self.starting and not exempt
        rules = self.rules.get(method) or MethodRules()
        call = _Call(method, request_id, auth_problem, exempt, attempt, starting, rules)
        return _wrap(handler, call)


class _Call:
    """Per-call bookkeeping: checks and parses the request, runs the behavior and logs how
    it ended."""

    def __init__(self, method: str, request_id: str, auth_problem: str, quiet: bool, attempt: int = 1,
                 starting: bool = False, rules: MethodRules = MethodRules()):
        self.method = method
        self.request_id = request_id
        self.auth_problem = auth_problem
        self.quiet = quiet
        self.attempt = attempt
        self.starting = starting
        self.rules = rules

    @property
    def rpc(self) -> str:
        return self.method.rsplit("/", 1)[-1]

    def parse(self, box: list, deserialize: Callable[[bytes], Any] | None, where: str = "request") -> Any:
        """The request message of the raw bytes in `box` (taken out of it), checked: size,
        parse, finite floats."""
        # The bytes travel in a box and are dropped before anything is raised: a traceback
        # keeps its frames (and so the request's bytes, up to max_message_bytes) alive until
        # the cyclic GC runs, and a client sending oversized requests would pile them up.
        raw = box.pop()
        if deserialize is None or not isinstance(raw, (bytes, bytearray, memoryview)):
            return raw
        size = len(raw)
        limit = self.rules.limit_bytes
        if size > limit:
            del raw
            if size > RELEASE_ABOVE_BYTES:
                release_freed_memory()
            raise error_info(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{where} of {size} bytes exceeds the {limit}-byte limit of {self.rpc} requests",
                             "REQUEST_TOO_LARGE", limit_bytes=str(limit), size_bytes=str(size), rpc=self.rpc)
        try:
            message = deserialize(bytes(raw))
        except Exception as err:  # DecodeError, invalid UTF-8 in a string, nesting too deep
            del raw
            kind = getattr(deserialize, "__self__", None)
            name = kind.DESCRIPTOR.full_name if hasattr(kind, "DESCRIPTOR") else "request"
            problem = f"is not a valid {name} message ({type(err).__name__}: {err})"
            raise Violations().add(where, problem).error() from None
        maybe_non_finite = hasattr(message, "DESCRIPTOR") and has_floats(message.DESCRIPTOR) and \
            MAYBE_NON_FINITE.search(raw) is not None
        del raw
        if maybe_non_finite:
            prefix = "" if where == "request" else f"{where}."
            bad = list(non_finite_fields(message, self.rules.finite_exempt, prefix))
            if bad:
                violations = Violations()
                for path in bad:
                    violations.add(path, "must be a finite number (NaN and infinity are refused)")
                violations.raise_if_any()
        return message

    async def parse_unary(self, box: list, deserialize: Callable[[bytes], Any] | None) -> Any:
        """`parse`, on a worker thread for a large request (so parsing and walking megabytes
        never stall health checks and other calls on the event loop)."""
        size = len(box[0]) if isinstance(box[0], (bytes, bytearray, memoryview)) else 0
        if OFFLOAD_ABOVE_BYTES < size <= self.rules.limit_bytes:
            return await asyncio.to_thread(self.parse, box, deserialize)
        return self.parse(box, deserialize)

    async def parse_stream(self, raw_messages: AsyncIterator[Any],
                           deserialize: Callable[[bytes], Any] | None) -> AsyncIterator[Any]:
        index = 0
        async for raw in raw_messages:
            box = [raw]
            del raw
            yield self.parse(box, deserialize, f"messages[{index}]")
            index += 1

    async def guard(self, context: grpc.aio.ServicerContext, body: Callable[[], Any]) -> AsyncIterator[Any]:
        """Run body (which yields responses) with auth, error mapping and logging."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        with structlog.contextvars.bound_contextvars(request_id=self.request_id, method=self.method):
            try:
                if self.auth_problem:
                    code = grpc.StatusCode.UNAUTHENTICATED
                    await context.abort(code, self.auth_problem)
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
                await context.abort(code, f"{self.rpc} is not implemented by this service yet")
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


async def _results(behavior: Callable[..., Any], request: Awaitable[Any], context: Any) -> AsyncIterator[Any]:
    """Yield whatever a behavior produces from the awaited request: a value, an awaitable, or
    a (async) generator."""
    result = behavior(await request, context)
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
    """The handler with the call's checks around it. It is registered without a request
    deserializer: gRPC hands over the raw bytes, which `call.parse` checks and parses inside
    `guard`, after auth (a client stream's messages one by one as the behavior reads them)."""
    deserialize = handler.request_deserializer

    async def request_of(box: list) -> Any:  # the raw request travels in a box, so no frame keeps it (see parse)
        if handler.request_streaming:
            return call.parse_stream(box.pop(), deserialize)
        return await call.parse_unary(box, deserialize)

    if handler.response_streaming:
        behavior = handler.unary_stream or handler.stream_stream

        async def streaming(raw: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            box = [raw]
            del raw
            async for item in call.guard(context, lambda: _results(behavior, request_of(box), context)):
                if item is not None:  # a coroutine that used context.write() returns None
                    yield item

        factory = grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        return factory(streaming, request_deserializer=None, response_serializer=handler.response_serializer)

    behavior = handler.unary_unary or handler.stream_unary

    async def unary(raw: Any, context: grpc.aio.ServicerContext) -> Any:
        box = [raw]
        del raw
        response = None
        async for item in call.guard(context, lambda: _results(behavior, request_of(box), context)):
            response = item
        return response

    factory = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return factory(unary, request_deserializer=None, response_serializer=handler.response_serializer)
