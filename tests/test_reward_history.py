"""The reward service's task history as an SQLite database: idempotent Gate calls (a replay
counts once), bounded task ids, tasks and keys, the one-time import of an older service's
JSON file, and a real `leap serve reward` killed with SIGKILL in the middle of a stream of
recording calls: after the restart every answered call is recorded exactly once, the
database is intact and no temporary file is left."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading

import grpc
import pytest

from leap.reward.v1 import reward_pb2 as pb
from leap.runtime.errors import error_reasons, violated_fields
from svc_reward.history import HistoryStore, TaskRecord
from tests.conftest import leap_serve
from tests.test_reward_service import RUN, gate_group, start, stub_for


def keyed(key: str, *groups: pb.GateGroup, **config) -> pb.GateRequest:
    return pb.GateRequest(groups=groups, idempotency_key=key, config=pb.GateConfig(**config))


def history_of(stub) -> dict[str, pb.TaskHistory]:
    return {h.task_id: h for h in stub.GetTaskHistory(pb.GetTaskHistoryRequest(), timeout=10).histories}


def test_a_replayed_key_answers_the_first_decisions_and_records_nothing(tmp_path):
    server = start(tmp_path, never_solved_after=16)
    try:
        stub = stub_for(server.address)
        request = keyed("run-1/step-3/group-0", gate_group("hard", 8))
        first = stub.Gate(request, timeout=10)
        again = stub.Gate(request, timeout=10)
        assert not first.replayed and again.replayed
        assert list(again.decisions) == list(first.decisions) and again.summary == first.summary
        assert history_of(stub)["hard"].groups == 1 and history_of(stub)["hard"].attempts == 8
        assert stub.GetStats(pb.GetStatsRequest(), timeout=10).groups_gated == 1  # a replay is not a new decision
        # Unkeyed, the same group counts again: the second all-failing group reaches 16 attempts.
        second = stub.Gate(pb.GateRequest(groups=[gate_group("hard", 8)]), timeout=10)
        assert (second.decisions[0].rule, second.decisions[0].history.groups) == ("catastrophic:history", 2)
        # The same key with other groups is refused, and records nothing.
        with pytest.raises(grpc.RpcError) as caught:
            stub.Gate(keyed("run-1/step-3/group-0", gate_group("hard", 2)), timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reasons(caught.value) == ["IDEMPOTENCY_KEY_REUSED"] and "run-1/step-3/group-0" in caught.value.details()
        assert history_of(stub)["hard"].groups == 2
        # A dry run ignores the key.
        dry = stub.Gate(pb.GateRequest(groups=[gate_group("hard", 2)], idempotency_key="run-1/step-3/group-0",
                                       dry_run=True), timeout=10)
        assert not dry.replayed and dry.decisions[0].history.groups == 3 and history_of(stub)["hard"].groups == 2
    finally:
        server.stop()


def test_task_ids_keys_and_tasks_are_bounded_with_the_field_named(tmp_path):
    server = start(tmp_path, max_history_tasks=3, max_task_id_bytes=64)
    try:
        stub = stub_for(server.address)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Gate(pb.GateRequest(groups=[gate_group("x" * 65, 2)], idempotency_key="k" * 257), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(caught.value) == ["groups[0].task_id", "idempotency_key"]
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetTaskHistory(pb.GetTaskHistoryRequest(task_ids=["é" * 40]), timeout=10)  # 80 bytes
        assert violated_fields(caught.value) == ["task_ids[0]"]
        stub.Gate(pb.GateRequest(groups=[gate_group("a", 2), gate_group("b", 2)]), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:  # two new tasks where one place is left: nothing recorded
            stub.Gate(pb.GateRequest(groups=[gate_group("a", 2), gate_group("c", 2), gate_group("d", 2)]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_reasons(caught.value) == ["HISTORY_FULL"] and "max_history_tasks 3" in caught.value.details()
        assert {k: h.groups for k, h in history_of(stub).items()} == {"a": 1, "b": 1}
        stub.Gate(pb.GateRequest(groups=[gate_group("a", 2), gate_group("c", 2)]), timeout=10)  # known tasks still record
        assert stub.Gate(pb.GateRequest(groups=[gate_group("e", 2)], dry_run=True), timeout=10).decisions  # dry runs too
        assert {k: h.groups for k, h in history_of(stub).items()} == {"a": 2, "b": 1, "c": 1}
    finally:
        server.stop()


def test_stored_keys_are_bounded_oldest_first_and_expire(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3", max_keys=3, key_ttl_seconds=100.0)

    def call(key: str, now: float):
        return store.record_call(["t"], lambda known: ({"t": TaskRecord("t", 0.5, 2, 1, 1, now)}, key.encode(), None),
                                 key, b"same", now)

    for i in range(5):
        assert not call(f"k{i}", now=1000.0 + i).replayed
    assert store.key_count() == 3
    assert call("k4", 1010.0).replayed and call("k2", 1010.0).replayed
    assert not call("k0", 1010.0).replayed  # dropped as the oldest: it records again
    assert not call("k9", 1200.0).replayed and store.key_count() == 1  # the others expired (ttl 100 s)
    store.close()


def test_an_older_services_json_history_is_imported_once_and_its_leftovers_removed(tmp_path):
    folder = tmp_path / "reward"
    folder.mkdir()
    legacy = folder / "task_history.json"
    tasks = [{"task_id": "relu", "ema_pass_rate": 0.25, "attempts": 16, "solves": 4, "groups": 2, "update_time": 1.0}]
    legacy.write_text(json.dumps({"version": 1, "tasks": tasks}))
    leftover = folder / ".task_history.json.abc123.tmp"
    leftover.write_bytes(b"x" * 1000)
    server = start(tmp_path, history_path=str(folder / "task_history.sqlite3"))
    try:
        relu = history_of(stub_for(server.address))["relu"]
        assert (relu.attempts, relu.solves, relu.groups, relu.ema_pass_rate) == (16, 4, 2, 0.25)
    finally:
        server.stop()
    assert not legacy.exists() and not leftover.exists() and (folder / "task_history.json.migrated").is_file()
    # The setting of an older service (a .json path) names the same database.
    server = start(tmp_path, history_path=str(legacy))
    try:
        assert history_of(stub_for(server.address))["relu"].groups == 2
    finally:
        server.stop()


def test_a_recording_call_that_cannot_write_records_nothing_and_says_so(tmp_path):
    path = tmp_path / "history.sqlite3"
    server = start(tmp_path, history_path=str(path), history_lock_timeout_seconds=0.2)
    holder = sqlite3.connect(str(path), isolation_level=None)
    try:
        stub = stub_for(server.address)
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the database
        with pytest.raises(grpc.RpcError) as caught:
            stub.Gate(keyed("k", gate_group("t", 6)), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_reasons(caught.value) == ["HISTORY_NOT_WRITTEN"] and "nothing was recorded" in caught.value.details()
        holder.execute("ROLLBACK")
        assert history_of(stub) == {} and stub.GetStats(pb.GetStatsRequest(), timeout=10).groups_gated == 0
        assert not stub.Gate(keyed("k", gate_group("t", 6)), timeout=10).replayed  # the retry records it
        assert history_of(stub)["t"].groups == 1
    finally:
        holder.close()
        server.stop()


def test_a_reward_service_killed_during_a_stream_of_writes_keeps_every_answered_call_once(tmp_path):
    folder = tmp_path / "reward"
    path = folder / "task_history.sqlite3"
    answered: dict[str, pb.GateResponse] = {}
    sent: list[str] = []
    with leap_serve("reward", "--history-path", str(path), "--drain-seconds", "0") as (address, process):
        stub = stub_for(address)

        def writer() -> None:
            for i in range(100_000):
                key = f"stream/{i}"
                sent.append(key)
                try:
                    answered[key] = stub.Gate(keyed(key, gate_group(f"task-{i % 7}", i % 5, stage=RUN),
                                                    gate_group("shared", 3)), timeout=10)
                except grpc.RpcError:
                    return  # the service died under this call

        thread = threading.Thread(target=writer)
        thread.start()
        while len(answered) < 200:
            thread.join(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        thread.join(30)
    assert len(answered) >= 200 and sent[-1] not in answered
    with leap_serve("reward", "--history-path", str(path), "--drain-seconds", "0") as (address, _):
        stub = stub_for(address)
        history = history_of(stub)
        recorded = history["shared"].groups
        # Every answered call is on disk; the one in flight may or may not be.
        assert len(answered) <= recorded <= len(sent)
        assert sum(h.groups for k, h in history.items() if k != "shared") == recorded
        assert all(h.attempts == 8 * h.groups for h in history.values())
        # Replaying every key sent: the answered ones come back as they were answered, and
        # nothing is counted again.
        for key in sent[:recorded]:
            i = int(key.split("/")[1])
            reply = stub.Gate(keyed(key, gate_group(f"task-{i % 7}", i % 5, stage=RUN), gate_group("shared", 3)),
                              timeout=10)
            assert reply.replayed
            if key in answered:
                assert list(reply.decisions) == list(answered[key].decisions)
        assert history_of(stub) == history
    with sqlite3.connect(str(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert {p.name for p in folder.iterdir()} <= {path.name, path.name + "-wal", path.name + "-shm"}


def test_a_refused_call_becomes_a_sentence_naming_the_service_and_what_it_refused(tmp_path):
    import asyncio

    from leap.clients import connect
    from leap.clients.retry import Patience, ServiceRefused, with_retries

    server = start(tmp_path)

    async def refused() -> ServiceRefused:
        stub = connect("reward", server.address)
        try:
            await with_retries(lambda: stub.Gate(pb.GateRequest()), "reward", server.address, Patience(seconds=5),
                               "the gate")
        except ServiceRefused as err:
            return err
        finally:
            await stub.channel.close()
        raise AssertionError("the empty Gate request was accepted")

    try:
        err = asyncio.run(refused())
    finally:
        server.stop()
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(err) == ["groups"]  # the rich details survive
    assert str(err) == (f"the reward service at {server.address} refused the gate (INVALID_ARGUMENT: invalid request: "
                        "groups: at least one group is required)")


def test_the_trainers_gate_keys_count_a_replayed_step_once_and_decide_a_changed_one_as_a_dry_run(tmp_path):
    import asyncio

    from leap.clients.retry import Patience
    from leap.trainer.v1 import trainer_pb2
    from svc_trainer.job import GroupGate, Services

    server = start(tmp_path)
    addresses = trainer_pb2.ServiceAddresses(policy="127.0.0.1:1", sandbox="127.0.0.1:1", reward=server.address)

    async def gate_step(step: int, failures: int, mode=pb.GATE_MODE_STATIC) -> tuple[pb.GateDecision, GroupGate]:
        services = Services(addresses, Patience(seconds=5))
        try:
            gate = GroupGate(services, pb.GateConfig(mode=mode), 1, run_id="run-a", step=step)
            return await gate.decide(0, gate_group("t", failures)), gate
        finally:
            await services.close()

    try:
        first, _ = asyncio.run(gate_step(1, 6))
        replayed, gate = asyncio.run(gate_step(1, 6))  # the step played again after a kill: the same rollouts
        assert replayed == first and len(gate.summaries) == 1  # its summary still counts in this attempt's step
        changed, gate = asyncio.run(gate_step(1, 2))  # played again on other weights: other rollouts
        assert changed.decision == pb.DECISION_SIMPLE and changed.history.groups == 2  # a dry run's view
        assert asyncio.run(gate_step(2, 6))[0].history.groups == 2  # the next step records
        adaptive, _ = asyncio.run(gate_step(3, 4, pb.GATE_MODE_ADAPTIVE))  # one key for the step's whole call
        assert asyncio.run(gate_step(3, 4, pb.GATE_MODE_ADAPTIVE))[0] == adaptive
        stub = stub_for(server.address)
        assert history_of(stub)["t"].groups == 3  # steps 1, 2 and 3, once each
        assert stub.GetStats(pb.GetStatsRequest(), timeout=10).groups_gated == 3
    finally:
        server.stop()
