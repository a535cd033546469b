"""Isolation and limits, over a real SandboxService: an infinite loop, a fork bomb, a memory
hog, a huge file, a segfault and an abort are each contained (a verdict at RUN with the
right flag), the service stays healthy, and no process is left behind. Candidates run as
an unprivileged uid of their own (the tests run as root here and in CI) and without
network. The static check is switched off in these tests so the runtime defences are what
is tested (it would reject most of these candidates first, see test_sandbox_checks.py)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.sandbox_helpers import (AS_ROOT, Check, RELU_LOOP, Stage, candidate, describe, flags, processes_in,
                                   processes_of_uids, relu, running_sandbox)

UID_BASE = int(os.environ.get("LEAP_TEST_SANDBOX_UID", "61000"))  # where the uid range starts (see sandbox_helpers)
WORKERS = 2
NO_STATIC = {"disabled_checks": [Check.CHECK_STATIC], "timing": False}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    with running_sandbox(tmp_path_factory.mktemp("isolation"), workers=WORKERS, sandbox_uid=UID_BASE,
                         memory_limit_bytes=2 << 30, file_size_limit_bytes=8 << 20, process_limit=48) as running:
        yield running


def assert_healthy_and_clean(sandbox):
    health = health_pb2_grpc.HealthStub(sandbox.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 5
    while (left := processes_in(sandbox.work_dir / "jobs")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"leftover processes: {left}"
    if AS_ROOT:
        assert not processes_of_uids(sandbox.servicer.uids)
    ok = sandbox.evaluate("relu", relu(RELU_LOOP), timing=False)  # later verdicts are unaffected
    assert ok.stage == Stage.STAGE_PASSED, describe(ok)


def test_infinite_loop_is_killed_at_the_wall_clock_limit(sandbox):
    started = time.monotonic()
    verdict = sandbox.evaluate("relu", relu("    volatile int64_t k = 0;\n    while (true) { k++; }"),
                               stage_timeout_seconds=2, **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and flags(verdict) & {"TIMEOUT", "CPU_LIMIT"}, describe(verdict)
    assert time.monotonic() - started < 30
    assert_healthy_and_clean(sandbox)


@pytest.mark.skipif(not AS_ROOT, reason="RLIMIT_NPROC needs candidates on a uid of their own (run as root)")
def test_fork_bomb_hits_the_process_limit_and_leaves_nothing(sandbox):
    verdict = sandbox.evaluate("relu", relu("    for (;;) { fork(); }", prelude="#include <unistd.h>\n"),
                               stage_timeout_seconds=2, **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and {"TIMEOUT", "PROCESS_LIMIT"} <= flags(verdict), describe(verdict)
    assert_healthy_and_clean(sandbox)


@pytest.mark.skipif(not AS_ROOT, reason="RLIMIT_NPROC needs candidates on a uid of their own (run as root)")
def test_a_fork_bomb_does_not_reach_the_candidates_beside_it(sandbox):
    bomb = candidate("relu", relu("    for (;;) { fork(); }", prelude="#include <unistd.h>\n"), label="bomb")
    others = [candidate("relu", relu(RELU_LOOP + "\n// beside"), label=str(i)) for i in range(3)]
    verdicts = sandbox.batch([bomb, *others], stage_timeout_seconds=6, **NO_STATIC)
    assert verdicts[0].stage == Stage.STAGE_RUN and "TIMEOUT" in flags(verdicts[0]), describe(verdicts[0])
    assert all(v.stage == Stage.STAGE_PASSED for v in verdicts[1:]), [describe(v) for v in verdicts[1:]]
    assert_healthy_and_clean(sandbox)


def test_escaped_background_process_is_killed_too(sandbox):
    # A child in a session of its own escapes the process group; the sweep still finds it.
    body = ("    if (fork() == 0) { setsid(); if (fork() == 0) { for (;;) pause(); } _exit(0); }\n" + RELU_LOOP)
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <unistd.h>\n"), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)
    assert_healthy_and_clean(sandbox)


def test_memory_hog_hits_the_address_space_limit(sandbox):
    body = "    float* volatile big = new float[(size_t)3 << 28];\n    big[0] = 1.0f;\n" + RELU_LOOP
    verdict = sandbox.evaluate("relu", relu(body), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and {"MEMORY_LIMIT", "CRASHED"} <= flags(verdict), describe(verdict)
    assert "bad_alloc" in verdict.runtime_error
    assert_healthy_and_clean(sandbox)


def test_huge_file_hits_the_file_size_limit(sandbox):
    body = ('    FILE* f = fopen("big.bin", "wb");\n    static char block[1 << 20];\n'
            "    for (int k = 0; k < 64; k++) fwrite(block, 1, sizeof block, f);\n    fclose(f);\n" + RELU_LOOP)
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <stdio.h>\n"), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and "FILE_SIZE_LIMIT" in flags(verdict), describe(verdict)
    assert_healthy_and_clean(sandbox)


@pytest.mark.parametrize("body, signal_name", [
    ("    volatile float* p = nullptr;\n    p[0] = 1.0f;", "SIGSEGV"),
    ("    abort();", "SIGABRT"),
    ("    y[-(int64_t)1 << 40] = 0.0f;", "SIGSEGV"),
])
def test_crashes_are_verdicts_with_the_signal(sandbox, body, signal_name):
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <stdlib.h>\n"), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and "CRASHED" in flags(verdict), describe(verdict)
    assert signal_name in verdict.runtime_error and signal_name in verdict.message
    assert_healthy_and_clean(sandbox)


def test_exit_before_returning_is_a_runtime_error(sandbox):
    verdict = sandbox.evaluate("relu", relu("    exit(0);", prelude="#include <stdlib.h>\n"), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and "exited with status 0" in verdict.runtime_error, describe(verdict)


def test_a_crash_while_compiling_is_contained_too(sandbox):
    # A template recursion bomb: the compiler gives up (or hits its limits); the service carries on.
    code = ("#include <stdint.h>\ntemplate <int N> struct F { enum { v = F<N - 1>::v + F<N - 2>::v }; };\n"
            'extern "C" void relu(const float* x, float* y, int64_t n) { y[0] = F<100000>::v; }\n')
    verdict = sandbox.evaluate("relu", code, stage_timeout_seconds=10, **NO_STATIC)
    assert verdict.stage == Stage.STAGE_COMPILE, describe(verdict)
    assert_healthy_and_clean(sandbox)


@pytest.mark.skipif(not AS_ROOT, reason="candidates drop to their own uid only when the service runs as root")
def test_candidates_run_as_an_unprivileged_uid_and_cannot_read_private_files(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("42")
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)
    # Correct output only when the file cannot be opened and the process is not root.
    body = (f'    FILE* f = fopen("{secret}", "r");\n    bool bad = f != nullptr || getuid() == 0;\n'
            "    for (int64_t i = 0; i < n; i++) {\n        y[i] = bad ? -1.0f : (x[i] > 0.0f ? x[i] : 0.0f);\n    }")
    verdict = sandbox.evaluate("relu", relu(body, prelude="#include <stdio.h>\n#include <unistd.h>\n"), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)


def connect_candidate(port: int) -> str:
    """A relu that is right only when it could not connect to 127.0.0.1:port."""
    prelude = "#include <sys/socket.h>\n#include <netinet/in.h>\n#include <arpa/inet.h>\n#include <unistd.h>\n"
    body = ("    int s = socket(AF_INET, SOCK_STREAM, 0);\n    struct sockaddr_in a = {};\n    a.sin_family = AF_INET;\n"
            f"    a.sin_port = htons({port});\n    a.sin_addr.s_addr = htonl(0x7f000001);\n"
            "    bool reached = s >= 0 && connect(s, (struct sockaddr*)&a, sizeof a) == 0;\n"
            "    for (int64_t i = 0; i < n; i++) {\n        y[i] = reached ? -1.0f : (x[i] > 0.0f ? x[i] : 0.0f);\n    }")
    return relu(body, prelude=prelude)


class Listener:
    """A loopback TCP server that records whether anything connected."""

    def __init__(self):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(4)
        self.socket.settimeout(0.5)
        self.port = self.socket.getsockname()[1]
        self.connected = threading.Event()
        self.thread = threading.Thread(target=self._accept)

    def _accept(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not self.stopped:
            try:
                self.socket.accept()
                self.connected.set()
                return
            except OSError:
                continue

    def __enter__(self) -> "Listener":
        self.stopped = False
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped = True
        self.thread.join()
        self.socket.close()


def test_candidates_have_no_network(sandbox):
    with Listener() as listener:
        verdict = sandbox.evaluate("relu", connect_candidate(listener.port), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)  # the connect failed inside the candidate
    assert not listener.connected.is_set()
