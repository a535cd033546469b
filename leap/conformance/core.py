"""The machinery of the conformance suites: a check, its outcome, and the calls checks make.

A `Suite` is the list of checks of one contract. `run_suite` runs the checks every service
owes (health, reflection, each RPC of the v1 contract answers) and then the suite's own,
one at a time and in order, on one channel. A check is a function of a `Context` that
returns a short reason when the implementation keeps the contract, raises `CheckFailed`
when it does not and `CheckSkipped` when the check does not apply; an unexpected RPC error
or a malformed answer fails the check with the status code first in the reason.

Checks never change a service's state: they read, they send requests the contract makes
invalid (so a conforming service changes nothing), and they use the contract's dry runs.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from leap.clients import STUBS
from leap.runtime.errors import violated_fields

PROBE_SECONDS = 30.0  # an RPC probed with an empty request must answer (or stream) within this


class Outcome(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    check: str
    outcome: Outcome
    why: str
    rpc: str = ""  # the RPC the check is about; empty for health and reflection


class CheckFailed(Exception):
    """The implementation does not keep the contract; the message says how."""


class CheckSkipped(Exception):
    """The check does not apply to this implementation; the message says why."""


class Unreachable(Exception):
    """Nothing answers at the address."""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    rpc: str
    body: Callable[[Context], str]


class Suite:
    """The checks of one service's contract, in the order they run."""

    def __init__(self, service: str, descriptor: ServiceDescriptor, optional: tuple[str, ...] = ()):
        self.service = service
        self.descriptor = descriptor
        self.checks: list[Check] = []
        # RPCs an implementation may leave out (UNIMPLEMENTED): additions to v1 whose callers
        # fall back to an older RPC, such as the policy's weight transports beside the stream.
        self.optional = frozenset(optional)

    @property
    def full_name(self) -> str:
        return self.descriptor.full_name

    def add(self, name: str, rpc: str, body: Callable[[Context], str]) -> None:
        if rpc and rpc not in self.descriptor.methods_by_name:
            raise ValueError(f"{self.full_name} has no RPC {rpc}")
        self.checks.append(Check(name, rpc, body))

    def add_lookup(self, rpc: str, request_class: type, field: str, noun: str, **extra: Any) -> None:
        """The lookup rule of the contract conventions, as two checks: an unknown `noun` is
        NOT_FOUND, and a request without `field` is INVALID_ARGUMENT naming it. `extra`
        fields go into both requests."""
        def unknown(ctx: Context) -> str:
            return ctx.refused(rpc, request_class(**{field: ctx.tag}, **extra), grpc.StatusCode.NOT_FOUND)

        def missing(ctx: Context) -> str:
            return ctx.refused(rpc, request_class(**extra), grpc.StatusCode.INVALID_ARGUMENT, field)

        self.add(f"{rpc} of an unknown {noun} is NOT_FOUND", rpc, unknown)
        self.add(f"{rpc} without {field} is INVALID_ARGUMENT", rpc, missing)

    def add_paging_rules(self, rpc: str, request_class: type) -> None:
        """The paging rule of the contract conventions, as two checks: a negative page_size and
        a page_token the service did not issue are INVALID_ARGUMENT naming the field."""
        def negative_size(ctx: Context) -> str:
            return ctx.refused(rpc, request_class(page_size=-1), grpc.StatusCode.INVALID_ARGUMENT, "page_size")

        def foreign_token(ctx: Context) -> str:
            request = request_class(page_token=f"%%{ctx.tag}%%")
            return ctx.refused(rpc, request, grpc.StatusCode.INVALID_ARGUMENT, "page_token")

        self.add(f"{rpc} with a negative page_size is INVALID_ARGUMENT", rpc, negative_size)
        self.add(f"{rpc} with a page_token it did not issue is INVALID_ARGUMENT", rpc, foreign_token)

    def check(self, name: str, rpc: str = "") -> Callable:
        """Decorator form of `add`."""
        def register(body: Callable[[Context], str]) -> Callable[[Context], str]:
            self.add(name, rpc, body)
            return body

        return register


def describe(error: grpc.RpcError) -> str:
    """"CODE: details", the form every failure caused by an RPC error takes."""
    details = error.details() or ""
    return f"{error.code().name}: {details}" if details else error.code().name


def names_field(named: str, field: str) -> bool:
    """Whether the BadRequest path `named` is `field` or a path inside it (`candidate.source`
    is inside `candidate`)."""
    return named == field or named.startswith((f"{field}.", f"{field}["))


class Context:
    """What a check works with: the contract's stub on the channel under test, call helpers,
    a tag unique to this run (for ids that must not exist), and discoveries shared by checks."""

    def __init__(self, suite: Suite, channel: grpc.Channel, deadline: float, options: dict[str, Any]):
        self.suite = suite
        self.channel = channel
        self.deadline = deadline
        self.options = options
        self.stub = STUBS[suite.service](channel)
        self.tag = f"leap-conformance-{uuid.uuid4().hex[:12]}"
        self._found: dict[str, Any] = {}

    def method(self, rpc: str) -> MethodDescriptor:
        return self.suite.descriptor.methods_by_name[rpc]

    def call(self, rpc: str, request: Any, *, limit: int | None = None, timeout: float | None = None) -> Any:
        """Call `rpc`. Client streams take an iterable of messages; server streams return the
        list of responses, at most `limit` of them (the stream is cancelled after that)."""
        method = self.method(rpc)
        function = getattr(self.stub, rpc)
        timeout = timeout or self.deadline
        if method.client_streaming:
            request = iter(request)
        if not method.server_streaming:
            return function(request, timeout=timeout)
        stream = function(request, timeout=timeout)
        responses = []
        try:
            for response in stream:
                responses.append(response)
                if limit is not None and len(responses) >= limit:
                    break
        finally:
            stream.cancel()  # a no-op on a finished stream
        return responses

    def refused(self, rpc: str, request: Any, code: grpc.StatusCode, *fields: str) -> str:
        """The reason a check passes when `rpc` fails with `code` and a BadRequest naming each
        of `fields`; raises CheckFailed otherwise."""
        try:
            self.call(rpc, request)
        except grpc.RpcError as err:
            if err.code() != code:
                raise CheckFailed(f"{describe(err)} ({code.name} expected)") from None
            named = violated_fields(err)
            missing = [f for f in fields if not any(names_field(n, f) for n in named)]
            if missing:
                raise CheckFailed(f"{code.name}, but its BadRequest names {named or 'no field'}, "
                                  f"not {', '.join(missing)}") from None
            return code.name + (f" naming {', '.join(fields)}" if fields else "")
        raise CheckFailed(f"answered OK ({code.name} expected)")

    def found(self, key: str, discover: Callable[[Context], Any]) -> Any:
        """`discover(self)` once per run (a model name, a task with examples), shared by checks;
        a discovery that failed fails every check that needs it, with the same reason."""
        if key not in self._found:
            try:
                self._found[key] = discover(self)
            except (CheckFailed, CheckSkipped, grpc.RpcError) as err:
                self._found[key] = err
        value = self._found[key]
        if isinstance(value, BaseException):
            raise value
        return value


# The checks every service owes, whatever its contract ----------------------------------


def health_serving(ctx: Context) -> str:
    stub = health_pb2_grpc.HealthStub(ctx.channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=ctx.suite.full_name), timeout=ctx.deadline)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise CheckFailed(f"{status} (SERVING expected)")
    return status


def reflected_service(ctx: Context):
    """The service as the server's reflection describes it."""
    def discover(ctx: Context):
        database = ProtoReflectionDescriptorDatabase(ctx.channel)
        listed = database.get_services()
        if ctx.suite.full_name not in listed:
            raise CheckFailed(f"reflection lists {', '.join(listed) or 'nothing'}")
        return DescriptorPool(database).FindServiceByName(ctx.suite.full_name)

    return ctx.found("reflection", discover)


def reflection_lists_service(ctx: Context) -> str:
    reflected_service(ctx)
    return "listed"


def reflection_matches_contract(ctx: Context) -> str:
    theirs = reflected_service(ctx).methods_by_name
    problems = []
    for ours in ctx.suite.descriptor.methods:
        other = theirs.get(ours.name)
        if other is None:
            if ours.name not in ctx.suite.optional:
                problems.append(f"{ours.name} missing")
        elif signature(other) != signature(ours):
            problems.append(f"{ours.name} is {signature(other)}, the contract says {signature(ours)}")
    if problems:
        raise CheckFailed("; ".join(problems))
    return f"{len(ctx.suite.descriptor.methods)} RPCs with the contract's request and response types"


def signature(method: MethodDescriptor) -> str:
    request = ("stream " if method.client_streaming else "") + method.input_type.full_name
    response = ("stream " if method.server_streaming else "") + method.output_type.full_name
    return f"({request}) -> ({response})"


# An RPC that crashed on an empty request (INTERNAL, UNKNOWN) or is absent (UNIMPLEMENTED)
# fails; any other answer shows it exists and handles bad input. Every RPC that changes
# state has a required field, so an empty request is invalid there and changes nothing.
NOT_ANSWERED = {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.UNKNOWN}


def rpc_answers(rpc: str) -> Callable[[Context], str]:
    def probe(ctx: Context) -> str:
        method = ctx.method(rpc)
        empty = message_factory.GetMessageClass(method.input_type)()
        request = [] if method.client_streaming else empty
        try:
            ctx.call(rpc, request, limit=1, timeout=min(ctx.deadline, PROBE_SECONDS))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED and rpc in ctx.suite.optional:
                raise CheckSkipped(f"optional, not implemented: callers fall back ({describe(err)})") from None
            if err.code() in NOT_ANSWERED:
                raise CheckFailed(describe(err)) from None
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "still working on an empty request at the deadline"
            return f"{err.code().name} to an empty request"
        return "OK to an empty request"

    return probe


def standard_checks(suite: Suite) -> list[Check]:
    name = suite.full_name
    return [
        Check(f"health answers SERVING for {name}", "", health_serving),
        Check(f"reflection lists {name}", "", reflection_lists_service),
        Check("reflection describes every RPC of the v1 contract", "", reflection_matches_contract),
        *(Check(f"{m.name} answers", m.name, rpc_answers(m.name)) for m in suite.descriptor.methods),
    ]


def run_check(check: Check, ctx: Context) -> CheckResult:
    try:
        why = check.body(ctx)
    except CheckSkipped as skip:
        return CheckResult(check.name, Outcome.SKIP, str(skip), check.rpc)
    except CheckFailed as failure:
        return CheckResult(check.name, Outcome.FAIL, str(failure), check.rpc)
    except grpc.RpcError as err:
        return CheckResult(check.name, Outcome.FAIL, describe(err), check.rpc)
    except Exception as err:  # a malformed answer broke the check's own reading of it
        return CheckResult(check.name, Outcome.FAIL, f"malformed answer: {type(err).__name__}: {err}", check.rpc)
    return CheckResult(check.name, Outcome.PASS, why, check.rpc)


def ensure_answers(channel: grpc.Channel, address: str, timeout: float) -> None:
    """Raise Unreachable unless something answers at the address (any health answer counts,
    even UNIMPLEMENTED: then the health check fails as a check, not as an unreachable address)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=True)
    except grpc.RpcError as err:
        if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise Unreachable(f"{address} does not answer within {timeout:g} s ({describe(err)})") from None


def run_suite(suite: Suite, channel: grpc.Channel, *, deadline: float, options: dict[str, Any]) -> list[CheckResult]:
    ctx = Context(suite, channel, deadline, options)
    return [run_check(check, ctx) for check in [*standard_checks(suite), *suite.checks]]


def failures(results: Iterable[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.outcome is Outcome.FAIL]
