"""Sandbox replicas behind one target, as compose runs them with `--scale sandbox=N`: the
trainer's client (`leap.clients.connect`, the very function the trainer uses: round_robin
over every address, retries on UNAVAILABLE) spreads evaluations over two real `leap serve
sandbox` processes and loses none when one of them dies.

In compose the trainer dials `dns:///sandbox:50052` and Docker's DNS answers with one
address per replica. Loopback has no DNS server that answers with two addresses, so the
tests name both in an `ipv4:127.0.0.1:P1,127.0.0.1:P2` target. Either target resolves to an
address list that gRPC hands to the same round_robin policy under the same service config
(retry policy included), so the balancing and failover compose relies on are what is
tested here; Docker's DNS itself is not.

Which replica served a call is read from each replica's JSON call log (one `call` line per
call, with method, status code and, for a retried call, its attempt number); no new RPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from leap.cli import main
from leap.clients import connect
from leap.commands.health import check as health_check
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_trainer.preflight import reachable
from tests.conftest import leap_serve, wait_for
from tests.sandbox_helpers import CPU, RELU_LOOP, candidate, relu

EVALUATE = "/leap.sandbox.v1.SandboxService/Evaluate"
RELU = relu(RELU_LOOP)


class Replica:
    def __init__(self, address: str, process, log_path: Path):
        self.address = address
        self.process = process
        self.log_path = log_path

    def served(self) -> list[dict]:
        """The Evaluate calls this replica answered with a verdict, from its call log."""
        lines = (json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{"))
        return [entry for entry in lines
                if entry.get("event") == "call" and entry.get("method") == EVALUATE and entry.get("code") == "OK"]

    def signal_group(self, number: int) -> None:
        os.killpg(self.process.pid, number)  # leap_serve starts each in its own session


@pytest.fixture
def replicas(tmp_path) -> list[Replica]:
    """Two sandbox processes sharing one compile cache (safe between replicas), as compose's
    replicas share the compile-cache volume."""
    with contextlib.ExitStack() as stack:
        started = []
        for name in ("a", "b"):
            log_path = tmp_path / f"sandbox-{name}.log"
            address, process = stack.enter_context(leap_serve(
                "sandbox", "--workers", "1", "--cache-dir", str(tmp_path / "cache"), "--drain-seconds", "0",
                log_path=log_path))
            started.append(Replica(address, process, log_path))
        yield started


def target_of(replicas: list[Replica]) -> str:
    return "ipv4:" + ",".join(r.address for r in replicas)


def request(label: str) -> sandbox_pb2.EvaluateRequest:
    options = sandbox_pb2.EvaluateOptions(timing=False)
    return sandbox_pb2.EvaluateRequest(candidate=candidate("relu", RELU, CPU, label), options=options)


async def evaluate_all(stub, labels: list[str]) -> dict[str, int]:
    """Evaluate one candidate per label at once; the stage of each verdict, by label."""
    replies = await asyncio.gather(*(stub.Evaluate(request(label)) for label in labels))
    return {reply.verdict.candidate_id: reply.verdict.stage for reply in replies}


def all_passed(labels: list[str]) -> dict[str, int]:
    return {label: common_pb2.STAGE_PASSED for label in labels}


def test_round_robin_spreads_evaluations_over_both_replicas(replicas):
    async def scenario() -> dict[str, int]:
        sandbox = connect("sandbox", target_of(replicas))
        try:  # one at a time: each call is a fresh round_robin pick
            return {label: (await sandbox.Evaluate(request(label))).verdict.stage
                    for label in (f"call-{i}" for i in range(16))}
        finally:
            await sandbox.channel.close()

    stages = asyncio.run(scenario())
    assert stages == all_passed([f"call-{i}" for i in range(16)])
    served = [len(r.served()) for r in replicas]
    assert all(count > 0 for count in served), f"calls per replica: {served}"
    assert sum(served) == 16  # each call served exactly once


def test_a_killed_replica_loses_no_evaluation(replicas):
    """Replica A is frozen (SIGSTOP: its connection stays open, so round_robin keeps sending
    it calls, which hang), then killed while those calls wait: they fail UNAVAILABLE before
    any answer and the retry policy sends them to B. Every call comes back with its verdict,
    and B served each of them exactly once."""
    first, second = replicas
    labels = [f"call-{i}" for i in range(8)]

    async def scenario() -> tuple[dict[str, int], int]:
        sandbox = connect("sandbox", target_of(replicas))
        try:
            await evaluate_all(sandbox, [f"warm-{i}" for i in range(4)])  # both connections READY
            first.signal_group(signal.SIGSTOP)
            served_by_b_before = len(second.served())
            pending = asyncio.ensure_future(evaluate_all(sandbox, labels))
            await asyncio.to_thread(wait_for, lambda: len(second.served()) > served_by_b_before, 60,
                                    "the live replica to serve a call")
            first.signal_group(signal.SIGKILL)
            return await pending, served_by_b_before
        finally:
            await sandbox.channel.close()

    stages, served_by_b_before = asyncio.run(scenario())
    assert stages == all_passed(labels)
    assert len(second.served()) == served_by_b_before + len(labels)
    retried = [entry for entry in second.served() if entry.get("attempt", 1) > 1]
    assert retried, "no call that had gone to the frozen replica was retried on the other"


def test_health_and_the_trainer_preflight_accept_a_multi_address_target(replicas, capsys):
    target = target_of(replicas)
    assert health_check(target) == "SERVING"
    assert main(["health", target]) == 0 and "SERVING" in capsys.readouterr().out
    assert asyncio.run(reachable(target, 5.0)) is None
    replicas[0].signal_group(signal.SIGKILL)
    replicas[0].process.wait()
    assert health_check(target) == "SERVING"  # the next address answers
    assert asyncio.run(reachable(target, 5.0)) is None
