"""The trainer service on two processes: `torchrun --nproc-per-node 2 -m leap serve trainer`
on the gloo backend (CPU), the way several GPUs run it with NCCL. Rank 0 serves and drives
the run; rank 1 follows its learner in lockstep (FSDP), and both stop when rank 0 shuts
down."""

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
def torchrun_trainer(flags: list[str], log: Path):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "leap", "serve", "trainer", "--port", str(port), *flags]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while check(address, timeout=1.0) != "SERVING":
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer under torchrun never served"
            time.sleep(0.2)
        yield address, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


def test_a_run_trains_on_two_ranks_and_both_stop_with_rank_0(tiny_model_dir, tmp_path):
    with contextlib.ExitStack() as stack:
        policy, _ = stack.enter_context(leap_serve("policy", "--models", f"policy={tiny_model_dir}"))
        sandbox, _ = stack.enter_context(leap_serve("sandbox", "--workers", "2", "--cache-dir", str(tmp_path / "cache")))
        reward, _ = stack.enter_context(leap_serve("reward", "--history-path", ""))
        services = trainer_pb2.ServiceAddresses(policy=policy, sandbox=sandbox, reward=reward)
        log = tmp_path / "torchrun.log"
        with torchrun_trainer(trainer_flags(tmp_path / "runs", services), log) as (address, process):
            trainer = connect("trainer", address, aio=False)
            config = small_config(tiny_model_dir, tasks_per_step=1, group_size=4)
            run = trainer.StartRun(trainer_pb2.StartRunRequest(request_id=uuid.uuid4().hex, config=config)).run
            list(trainer.StreamMetrics(trainer_pb2.StreamMetricsRequest(run_id=run.run_id), timeout=600))
            done = trainer.GetRun(trainer_pb2.GetRunRequest(run_id=run.run_id)).run
            trainer.channel.close()
            assert done.state == SUCCEEDED, done.error
            state = json.loads((Path(done.output_dir) / "checkpoints" / "step-00000001" / "state.json").read_text())
            assert state["world_size"] == 2  # the learner spanned both processes
            assert (Path(done.output_dir) / "checkpoints" / "step-00000001" / "rng" / "rank-00001.pt").is_file()
            os.kill(rank_zero(process.pid), signal.SIGTERM)  # only rank 0 is told: it releases rank 1
            assert process.wait(60) == 0, log.read_text()[-3000:]  # both ranks ended cleanly
