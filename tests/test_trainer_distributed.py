"""The trainer service on two nodes, as a user launches it: one `torchrun --nnodes 2
--node-rank N --nproc-per-node 1 --master-addr HOST --master-port PORT -m leap serve trainer`
per node (here two launchers on loopback standing in for two machines, gloo on CPU; NCCL on
GPUs). Rank 0 (node 0) serves gRPC, drives the run and alone talks to the policy, sandbox and
reward services; rank 1 follows its learner in lockstep (FSDP) and needs only the
rendezvous. The weights reach the policy once per step, from rank 0, and both nodes stop
when rank 0 shuts down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from leap.clients import connect
from leap.commands.health import check
from leap.learning.registry import SUCCEEDED
from leap.trainer.v1 import trainer_pb2
from tests.conftest import ROOT, free_port, leap_serve, subprocess_env
from tests.test_trainer_e2e import small_config, trainer_flags

pytestmark = pytest.mark.slow


def rank_zero(launcher_pid: int) -> int:
    """The pid of the worker torchrun started with RANK=0."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"RANK=0" in environ:
            return int(pid)
    raise AssertionError(f"no rank 0 among torchrun's children {children}")


@contextlib.contextmanager
def two_node_trainer(flags: list[str], logs: Path):
    """Two torchrun launchers, node 0 and node 1, rendezvousing at node 0's address."""
    port, master = free_port(), free_port()
    launchers = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master),
                   "-m", "leap", "serve", "trainer", "--port", str(port), *flags]
        with open(logs / f"node-{node}.log", "wb") as out:
            launchers.append(subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while check(address, timeout=1.0) != "SERVING":
            for node, launcher in enumerate(launchers):
                assert launcher.poll() is None, (logs / f"node-{node}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer under torchrun never served"
            time.sleep(0.2)
        yield address, launchers
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGTERM)
                launcher.wait(60)


def pushes(policy_log: Path) -> list[dict]:
    """The weight updates the policy service applied, from its JSON log."""
    lines = [json.loads(line) for line in policy_log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "weights updated"]


def test_a_run_trains_on_two_nodes_pushes_once_per_step_and_both_stop_with_rank_0(tiny_model_dir, tmp_path):
    policy_log = tmp_path / "policy.log"
    with contextlib.ExitStack() as stack:
        policy, _ = stack.enter_context(leap_serve("policy", "--models", f"policy={tiny_model_dir}",
                                                   log_path=policy_log))
        sandbox, _ = stack.enter_context(leap_serve("sandbox", "--workers", "2", "--cache-dir", str(tmp_path / "cache")))
        reward, _ = stack.enter_context(leap_serve("reward", "--history-path", ""))
        services = trainer_pb2.ServiceAddresses(policy=policy, sandbox=sandbox, reward=reward)
        with two_node_trainer(trainer_flags(tmp_path / "runs", services), tmp_path) as (address, launchers):
            trainer = connect("trainer", address, aio=False)
            config = small_config(tiny_model_dir, tasks_per_step=1, group_size=4)
            run = trainer.StartRun(trainer_pb2.StartRunRequest(request_id=uuid.uuid4().hex, config=config)).run
            list(trainer.StreamMetrics(trainer_pb2.StreamMetricsRequest(run_id=run.run_id), timeout=600))
            done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
            trainer.channel.close()
            assert done.state == SUCCEEDED, done.error
            state = json.loads((Path(done.output_dir) / "checkpoints" / "step-00000001" / "state.json").read_text())
            assert state["world_size"] == 2  # the learner spanned both nodes
            assert (Path(done.output_dir) / "checkpoints" / "step-00000001" / "rng" / "rank-00001.pt").is_file()
            os.kill(rank_zero(launchers[0].pid), signal.SIGTERM)  # only rank 0 is told: it releases rank 1
            for node, launcher in enumerate(launchers):
                assert launcher.wait(60) == 0, (tmp_path / f"node-{node}.log").read_text()[-3000:]
    # One push when the run started (the learner's weights) and one for its step: not one per rank.
    applied = [p for p in pushes(policy_log) if p.get("model") == "policy"]
    assert [p["version"] for p in applied] == [1, 2], applied
