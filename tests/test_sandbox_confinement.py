"""Escapes from the sandbox, tried as a reward-hacking policy would try them, over a real
SandboxService (real bubblewrap, real uids, the real seccomp filter; the tests run as root
here and in CI, as the service must to confine).

Each attack candidate is a relu kernel that computes the right answer only when every
attempt it makes fails; one that got somewhere prints "ESCAPED: what" and aborts, so the
verdict says which. The static check is off for these (it would reject most of them
first, and it is not the boundary); the tests that check the static check say so.

After every attack: the service is SERVING, no process of its uids is left, no file is
left in its job directories, and a correct kernel still passes. The service under attack
holds a secret in its environment and as its auth token; no candidate may find it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leap.clients import connect
from leap.runtime import BackgroundServer, StartupError
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import confinement, work_dirs
from svc_sandbox.server import SPEC, SandboxConfig
from tests.conftest import ROOT, free_port, subprocess_env
from tests.sandbox_helpers import (AS_ROOT, KERNELBENCH, RELU_LOOP, Check, Sandbox, Stage, candidate, describe, flags,
                                   processes_of_uids, relu, running_sandbox)

needs_root = pytest.mark.skipif(not AS_ROOT, reason="confinement needs the service to run as root (as in CI)")

SECRET = "leap-confinement-secret-7f3a9c"
UID_BASE = int(os.environ.get("LEAP_TEST_SANDBOX_UID", "61000"))
NO_STATIC = {"disabled_checks": [Check.CHECK_STATIC], "timing": False}
ESCAPE_PRELUDE = """#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <dirent.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <netinet/in.h>
static int escaped = 0;
#define ESCAPED(what) do { fprintf(stderr, "ESCAPED: %s (errno %d)\\n", what, errno); escaped = 1; } while (0)
"""
PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(16, 16)]


def get_init_inputs():
    return []
'''
KB_TASK = "level1/1_Relu"


def attack(code: str) -> str:
    """A relu candidate that runs `code` first and is right only if nothing ESCAPED."""
    return relu(code + "\n    if (escaped) abort();\n" + RELU_LOOP, prelude=ESCAPE_PRELUDE)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    if not AS_ROOT:
        pytest.skip("confinement needs the service to run as root (as in CI)")
    problems = tmp_path_factory.mktemp("problems")
    (problems / "level1").mkdir()
    (problems / "level1" / "1_Relu.py").write_text(PROBLEM)
    root = tmp_path_factory.mktemp("confinement")
    old = os.environ.get("LEAP_AUTH_TOKEN")
    os.environ["LEAP_AUTH_TOKEN"] = SECRET  # the service's own environment holds the token
    config = SandboxConfig(port=free_port(), drain_seconds=0.0, grace_seconds=5.0, workers=2, sandbox_uid=UID_BASE,
                           cache_dir=str(root / "cache"), work_dir=str(root / "work"), task_dirs=[str(problems)],
                           auth_token=SECRET, process_limit=48, file_size_limit_bytes=8 << 20)
    server = BackgroundServer(SPEC.build(config), config).start()
    running = Sandbox(server, config)
    running.stub = connect("sandbox", server.address, aio=False, auth_token=SECRET, max_attempts=1)
    try:
        yield running
    finally:
        running.channel.close()
        server.stop()
        if old is None:
            os.environ.pop("LEAP_AUTH_TOKEN", None)
        else:
            os.environ["LEAP_AUTH_TOKEN"] = old


def assert_contained(sandbox: Sandbox) -> None:
    health = health_pb2_grpc.HealthStub(sandbox.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 10
    while (left := processes_of_uids(sandbox.servicer.uids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"
    jobs = sandbox.work_dir / "jobs"
    assert not [p for p in jobs.iterdir() if not p.name.startswith(".")], "job directories left behind"
    ok = sandbox.evaluate("relu", relu(RELU_LOOP), timing=False)
    assert ok.stage == Stage.STAGE_PASSED, describe(ok)


def assert_passed(verdict: sandbox_pb2.Verdict) -> None:
    """PASSED: every attempt of the attack failed (else the log says what ESCAPED)."""
    assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)


# ------------------------------------------------------------------------- the static check


@pytest.mark.parametrize("code, rule", [
    ('#define CAT(a, b) a##b\nextern "C" void relu(const float* x, float* y, int64_t n) { CAT(sys, tem)("id"); }',
     "builds names in the preprocessor"),
    ('#define WHAT "/etc/passwd"\n#include WHAT\nextern "C" void relu(const float* x, float* y, int64_t n) {}',
     "computed file name"),
    ('extern "C" void relu(const float* x, float* y, int64_t n) { long r; asm volatile("sys" "call" : "=a"(r) : "a"(39)); }',
     "issues system calls"),
    ('extern "C" void relu(const float* x, float* y, int64_t n) { asm volatile(".byte 0x0f, 0x05"); }',
     "issues system calls"),
])
def test_the_static_check_sees_through_pasted_names_computed_includes_and_split_asm(sandbox, code, rule):
    verdict = sandbox.evaluate("relu", "#include <stdint.h>\n" + code, timing=False)
    assert verdict.stage == Stage.STAGE_FORMAT and "FORBIDDEN_CALL" in flags(verdict), describe(verdict)
    assert rule in verdict.message


def test_kernelbench_reflection_is_refused_by_the_static_check(sandbox):
    code = ("import os\nimport torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, x):\n        getattr(os, 'sys' + 'tem')('id')\n        return torch.relu(x)\n")
    verdict = sandbox.evaluate(KB_TASK, code, KERNELBENCH, timing=False)
    assert verdict.stage == Stage.STAGE_FORMAT and "reflection" in verdict.message, describe(verdict)


# ------------------------------------------------------------------------- processes and secrets


def test_other_processes_are_out_of_reach(sandbox):
    code = f"""
    if (getuid() == 0 || geteuid() == 0) ESCAPED("runs as root");
    if (kill({os.getpid()}, 0) == 0 || errno != ESRCH) ESCAPED("the service's pid is visible");
    if (kill(1, SIGKILL) == 0) ESCAPED("signalled pid 1");
    if (kill(getppid(), SIGKILL) == 0) ESCAPED("signalled the zygote");
    if (ptrace(PTRACE_ATTACH, getppid(), 0, 0) == 0 || errno != EPERM) ESCAPED("ptrace");
    if (ptrace(PTRACE_TRACEME, 0, 0, 0) == 0) ESCAPED("ptrace traceme");
    char buf[64]; struct iovec local = {{buf, sizeof buf}}, remote = {{buf, sizeof buf}};
    if (process_vm_readv(getppid(), &local, 1, &remote, 1, 0) >= 0) ESCAPED("process_vm_readv");
    char path[64]; snprintf(path, sizeof path, "/proc/%d/mem", getppid());
    if (open(path, O_RDONLY) >= 0) ESCAPED("the zygote's memory");
    if (open("/proc/1/environ", O_RDONLY) >= 0) ESCAPED("pid 1's environment");
    DIR* proc = opendir("/proc"); struct dirent* e; int pids = 0;
    while (proc && (e = readdir(proc))) {{
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        pids++;
        char file[300], text[4096] = {{0}}; snprintf(file, sizeof file, "/proc/%s/cmdline", e->d_name);
        int fd = open(file, O_RDONLY); if (fd < 0) continue;
        ssize_t got = read(fd, text, sizeof text - 1); close(fd);
        for (ssize_t i = 0; i < got; i++) if (!text[i]) text[i] = ' ';
        if (strstr(text, "-m pytest") || strstr(text, "leap serve")) ESCAPED("sees the service's process");
    }}
    if (pids > 8) ESCAPED("sees many processes");
"""
    assert_passed(sandbox.evaluate("relu", attack(code), **NO_STATIC))
    assert_contained(sandbox)


def test_no_secret_is_in_the_candidates_memory_environment_or_proc(sandbox):
    # The needle is built at run time on a page of its own (the literal is reversed), so the
    # scan of the process's whole memory finds only a copy that came from elsewhere: the
    # zygote's environment on the stack, the service's memory, a leaked variable.
    reversed_secret = SECRET[::-1]
    code = f"""
    const char* reversed = "{reversed_secret}"; size_t count = strlen(reversed);
    char* needle = (char*)mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (size_t i = 0; i < count; i++) needle[i] = reversed[count - 1 - i];
    const size_t chunk = 1 << 20;
    char* scan = (char*)mmap(0, chunk, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    FILE* maps = fopen("/proc/self/maps", "r"); int mem = open("/proc/self/mem", O_RDONLY);
    char line[512];
    while (maps && mem >= 0 && fgets(line, sizeof line, maps)) {{
        unsigned long a, b; char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &a, &b, perms) != 3 || perms[0] != 'r') continue;
        if (strstr(line, "[vvar") || strstr(line, "[vsyscall]") || a == (unsigned long)scan || a == (unsigned long)needle) continue;
        for (unsigned long p = a; p < b; p += chunk - 4096) {{
            size_t len = b - p < chunk ? b - p : chunk;
            ssize_t got = pread(mem, scan, len, p);
            if (got <= 0) break;
            if (memmem(scan, got, needle, count)) {{ fprintf(stderr, "in %s", line); ESCAPED("the secret is in memory"); }}
            if (len < chunk) break;
        }}
    }}
    for (char** v = environ; *v; v++) if (strstr(*v, needle) || strstr(*v, "AUTH_TOKEN")) ESCAPED("the environment");
    const char* files[] = {{"/proc/self/environ", "/proc/1/environ", "/proc/1/cmdline", "/proc/2/environ",
                           "/proc/2/cmdline", "/proc/self/cmdline"}};
    for (const char* file : files) {{
        int fd = open(file, O_RDONLY); if (fd < 0) continue;
        char text[65536]; ssize_t got = read(fd, text, sizeof text); close(fd);
        if (got > 0 && memmem(text, got, needle, count)) ESCAPED(file);
    }}
"""
    assert_passed(sandbox.evaluate("relu", attack(code), **NO_STATIC))
    assert_contained(sandbox)


def test_a_shell_runs_only_inside_the_sandbox(sandbox, tmp_path):
    marker = Path("/tmp") / f"leap-confinement-{os.getpid()}"
    command = (f"kill -9 {os.getpid()}; touch {marker}; cat /etc/passwd /root/.bashrc > seen.txt; "
               f"env > env.txt; cat /proc/*/environ >> env.txt")
    code = f"""
    system("{command} 2>/dev/null");
    FILE* seen = fopen("seen.txt", "r"); char text[4096] = {{0}};
    if (seen) {{ fread(text, 1, sizeof text - 1, seen); if (strstr(text, "root:")) ESCAPED("/etc/passwd"); }}
    FILE* env = fopen("env.txt", "r"); char all[65536] = {{0}};
    if (env) {{ fread(all, 1, sizeof all - 1, env); if (strstr(all, "LEAP_AUTH_TOKEN")) ESCAPED("the token"); }}
"""
    verdict = sandbox.evaluate("relu", attack(code), **NO_STATIC)
    assert_passed(verdict)
    assert not marker.exists(), "the shell wrote the host's /tmp"
    assert_contained(sandbox)


# ------------------------------------------------------------------------- files


def test_the_filesystem_is_a_read_only_minimal_view(sandbox):
    cache, work = sandbox.config.cache_dir, str(sandbox.work_dir)
    code = f"""
    const char* unreadable[] = {{"/etc/passwd", "/etc/shadow", "/root/.bashrc", "/root/.gitconfig",
                                "{ROOT}/pyproject.toml", "{ROOT}/.git/config"}};
    for (const char* file : unreadable) if (open(file, O_RDONLY) >= 0) ESCAPED(file);
    const char* unlistable[] = {{"/root", "/home", "{work}/jobs", "/tmp/.."}};
    for (const char* dir : unlistable) {{
        DIR* d = opendir(dir); struct dirent* e;
        while (d && (e = readdir(d))) {{
            if (strcmp(dir, "/tmp/..") == 0 && (strcmp(e->d_name, "home") == 0 || strcmp(e->d_name, "var") == 0 ||
                                                strcmp(e->d_name, "opt") == 0)) ESCAPED("a host directory");
            if (strcmp(dir, "/tmp/..") && e->d_name[0] != '.') ESCAPED(dir);
        }}
    }}
    const char* unwritable[] = {{"/tmp/x", "{cache}/x", "{cache}/objects/x", "{work}/x", "{work}/inputs/x",
                                "{work}/jobs/x", "{ROOT}/svc_sandbox/x", "/usr/x", "/dev/shm/x", "/x"}};
    for (const char* file : unwritable) if (open(file, O_WRONLY | O_CREAT, 0644) >= 0) ESCAPED(file);
    char other[512], mine[512]; getcwd(mine, sizeof mine);
    for (int slot = 0; slot < 2; slot++) for (int job = 1; job < 200; job++) {{
        snprintf(other, sizeof other, "{work}/jobs/%d-%d", slot, job);
        if (strcmp(other, mine) == 0) continue;
        strcat(other, "/x");
        if (open(other, O_WRONLY | O_CREAT, 0644) >= 0) ESCAPED("another job's directory");
    }}
    if (open("mine.txt", O_WRONLY | O_CREAT, 0644) < 0) ESCAPED("cannot write its own directory");
"""
    assert_passed(sandbox.evaluate("relu", attack(code), **NO_STATIC))
    assert not (Path("/tmp") / "x").exists() and not (sandbox.work_dir / "x").exists()
    assert_contained(sandbox)


@pytest.mark.parametrize("include", ['"/etc/passwd"', '"/root/.bashrc"', '"/proc/self/environ"', '"/proc/1/environ"',
                                     "WHAT"])
def test_the_compiler_cannot_include_host_files(sandbox, include):
    code = (f'#define WHAT "/etc/passwd"\n#include {include}\n#include <stdint.h>\n'
            'extern "C" void relu(const float* x, float* y, int64_t n) {}\n')
    verdict = sandbox.evaluate("relu", code, **NO_STATIC)
    log = verdict.compile.log
    assert "root:x:0:0" not in log and SECRET not in log and "AUTH_TOKEN" not in log, log
    if include != '"/proc/self/environ"':  # the compiler's own environment is no secret: it may compile
        assert verdict.stage == Stage.STAGE_COMPILE, describe(verdict)
        assert "No such file or directory" in log or "Permission denied" in log, log


# ------------------------------------------------------------------------- network, kernel


def test_no_network_and_no_socket_of_the_service(sandbox, tmp_path):
    abstract = f"leap-confinement-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + abstract)  # an abstract socket of the host's network namespace
    listener.listen(1)
    path = tmp_path / "control.sock"
    named = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    named.bind(str(path))
    named.listen(1)
    port = sandbox.server.address.rsplit(":", 1)[1]
    code = f"""
    int families[] = {{AF_INET, AF_INET6, AF_NETLINK, AF_PACKET}};
    for (int family : families) if (socket(family, SOCK_STREAM, 0) >= 0 || socket(family, SOCK_RAW, 0) >= 0)
        ESCAPED("opened a network socket");
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {{}}; a.sun_family = AF_UNIX; memcpy(a.sun_path + 1, "{abstract}", {len(abstract)});
    if (connect(u, (struct sockaddr*)&a, sizeof(sa_family_t) + 1 + {len(abstract)}) == 0) ESCAPED("host abstract socket");
    int v = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un b = {{}}; b.sun_family = AF_UNIX; strcpy(b.sun_path, "{path}");
    if (connect(v, (struct sockaddr*)&b, sizeof b) == 0) ESCAPED("a host socket file");
    long raw; asm volatile("syscall" : "=a"(raw) : "a"(SYS_socket), "D"(AF_INET), "S"(SOCK_STREAM), "d"(0)
                           : "rcx", "r11", "memory");
    if (raw >= 0) ESCAPED("a raw socket syscall");
    (void){port};
"""
    try:
        assert_passed(sandbox.evaluate("relu", attack(code), **NO_STATIC))
    finally:
        listener.close()
        named.close()
    assert_contained(sandbox)


def test_namespaces_mounts_and_kernel_interfaces_are_refused(sandbox):
    code = """
    if (unshare(CLONE_NEWUSER) == 0) ESCAPED("unshare a user namespace");
    if (unshare(CLONE_NEWNS) == 0) ESCAPED("unshare a mount namespace");
    if (mount("none", "/tmp", "tmpfs", 0, 0) == 0) ESCAPED("mount");
    int ns = open("/proc/self/ns/net", O_RDONLY);
    if (ns >= 0 && setns(ns, 0) == 0) ESCAPED("setns");
    if (chroot("/") == 0) ESCAPED("chroot");
    long child = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (child == 0) _exit(0);
    if (child > 0) ESCAPED("clone into a new user namespace");
    unsigned char params[120] = {0};
    long ring; asm volatile("syscall" : "=a"(ring) : "a"(SYS_io_uring_setup), "D"(1), "S"(params) : "rcx", "r11", "memory");
    if (ring >= 0) ESCAPED("io_uring through a raw syscall");
    if (syscall(SYS_keyctl, 0, -3, 0) >= 0) ESCAPED("keyctl");
    if (syscall(SYS_bpf, 0, 0, 0) >= 0) ESCAPED("bpf");
    if (syscall(SYS_perf_event_open, 0, 0, -1, -1, 0) >= 0) ESCAPED("perf_event_open");
    pid_t thread = fork();  // plain forks still work
    if (thread == 0) _exit(0);
    if (thread < 0) ESCAPED("cannot fork at all");
"""
    assert_passed(sandbox.evaluate("relu", attack(code), **NO_STATIC))
    assert_contained(sandbox)


def test_a_system_call_through_another_abi_kills_the_candidate(sandbox):
    code = "    long r; asm volatile(\"int $0x80\" : \"=a\"(r) : \"a\"(20) : \"memory\");  // getpid, i386 ABI\n"
    verdict = sandbox.evaluate("relu", attack(code), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and "SIGSYS" in verdict.runtime_error, describe(verdict)
    assert_contained(sandbox)


def test_a_daemon_does_not_outlive_its_job(sandbox):
    code = """
    if (fork() == 0) {
        setsid(); signal(SIGHUP, SIG_IGN);
        if (fork() == 0) { prctl(PR_SET_PDEATHSIG, 0); for (;;) pause(); }
        _exit(0);
    }
"""
    verdict = sandbox.evaluate("relu", attack(code), **NO_STATIC)
    assert_passed(verdict)
    assert_contained(sandbox)


def test_kernelbench_candidates_run_unprivileged_and_confined(sandbox):
    marker = Path("/tmp") / f"leap-confinement-kb-{os.getpid()}"
    code = f'''
import os
import torch
import torch.nn as nn


def escaped():
    found = []
    if os.getuid() == 0:
        found.append("root")
    try:
        os.kill({os.getpid()}, 0)
        found.append("the service's pid")
    except ProcessLookupError:
        pass
    if any("AUTH_TOKEN" in name for name in os.environ):
        found.append("the token variable")
    getattr(os, "sys" + "tem")("touch {marker} 2>/dev/null")
    for path in ("/etc/passwd", "/root/.bashrc", "/proc/1/environ"):
        try:
            open(path).read()
            found.append(path)
        except OSError:
            pass
    return found


class ModelNew(nn.Module):
    def forward(self, x):
        found = escaped()
        if found:
            raise RuntimeError("ESCAPED: " + ", ".join(found))
        return torch.relu(x)
'''
    verdict = sandbox.evaluate(KB_TASK, code, KERNELBENCH, **NO_STATIC)
    assert_passed(verdict)
    assert not marker.exists()
    assert_contained(sandbox)


# ------------------------------------------------------------------------- cancellation


def test_a_deadline_or_a_cancel_kills_the_candidate_at_once(sandbox):
    loop = relu("    volatile int64_t k = 0;\n    while (true) { k++; }")
    request = sandbox_pb2.EvaluateRequest(candidate=candidate("relu", loop), options=sandbox_pb2.EvaluateOptions(
        stage_timeout_seconds=600, **NO_STATIC))
    with pytest.raises(grpc.RpcError) as caught:
        sandbox.stub.Evaluate(request, timeout=3)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_gone_soon(sandbox)  # killed well before its 600 s limit
    future = sandbox.stub.Evaluate.future(request, timeout=600)
    wait_for_a_candidate(sandbox)
    future.cancel()
    assert_gone_soon(sandbox)
    assert_contained(sandbox)


def wait_for_a_candidate(sandbox: Sandbox) -> None:
    deadline = time.monotonic() + 60
    while not processes_of_uids(sandbox.servicer.uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of_uids(sandbox.servicer.uids)


def assert_gone_soon(sandbox: Sandbox, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while (processes_of_uids(sandbox.servicer.uids) or sandbox.servicer.pool.pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_of_uids(sandbox.servicer.uids) and sandbox.servicer.pool.pending == 0


@needs_root
def _wait_serving(channel: grpc.Channel, process: subprocess.Popen) -> None:
    """Until the `leap serve sandbox` process behind `channel` reports SERVING (it must not exit first)."""
    grpc.channel_ready_future(channel).result(timeout=120)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 120
    while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.1)


def test_sigterm_ends_the_service_within_drain_and_grace_whatever_runs(tmp_path):
    port = free_port()
    drain, grace = 0.5, 2.0
    command = [sys.executable, "-m", "leap", "serve", "sandbox", "--port", str(port), "--workers", "1",
               "--drain-seconds", str(drain), "--grace-seconds", str(grace), "--cache-dir", str(tmp_path / "cache"),
               "--sandbox-uid", str(UID_BASE), "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        _wait_serving(channel, process)
        loop = relu("    volatile int64_t k = 0;\n    while (true) { k++; }")
        request = sandbox_pb2.EvaluateRequest(candidate=candidate("relu", loop), options=sandbox_pb2.EvaluateOptions(
            stage_timeout_seconds=600, **NO_STATIC))
        from leap.sandbox.v1 import sandbox_pb2_grpc

        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        calls = [stub.Evaluate.future(request, timeout=600) for _ in range(3)]  # one runs, two wait
        time.sleep(3)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(drain + grace + 20)  # today's bound; it took 122 s before cancellation reached candidates
        took = time.monotonic() - sent
        for call in calls:
            with pytest.raises(grpc.RpcError):
                call.result(timeout=10)
        assert process.returncode == 0, process.stderr.read().decode()[-2000:]
        assert took < drain + grace + 20
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()


# ------------------------------------------------------------------------- neighbours, refusal, infrastructure


@needs_root
def test_two_sandboxes_on_one_host_take_distinct_uids_and_leave_each_other_alone(tmp_path):
    bomb = relu("    for (;;) { fork(); }", prelude="#include <unistd.h>\n")
    killer = relu("    kill(-1, SIGKILL);\n" + RELU_LOOP, prelude="#include <signal.h>\n")
    with running_sandbox(tmp_path / "a", workers=1, sandbox_uid=UID_BASE) as first, \
            running_sandbox(tmp_path / "b", workers=1, sandbox_uid=UID_BASE) as second:
        assert first.servicer.uids and second.servicer.uids
        assert not set(first.servicer.uids) & set(second.servicer.uids)
        results: dict[str, sandbox_pb2.Verdict] = {}
        threads = [threading.Thread(target=lambda: results.__setitem__("bomb", first.evaluate(
                       "relu", bomb, stage_timeout_seconds=4, **NO_STATIC))),
                   threading.Thread(target=lambda: results.__setitem__("killer", first.evaluate(
                       "relu", killer + "\n// again", **NO_STATIC)))]
        for thread in threads:
            thread.start()
        time.sleep(1)
        honest = [second.evaluate("relu", relu(RELU_LOOP + f"\n// {i}"), timing=False) for i in range(3)]
        for thread in threads:
            thread.join()
        assert all(v.stage == Stage.STAGE_PASSED for v in honest), [describe(v) for v in honest]
        assert results["bomb"].stage == Stage.STAGE_RUN, describe(results["bomb"])


@needs_root
def test_uids_are_leased_with_a_lock_and_real_accounts_are_skipped(tmp_path):
    first = confinement.UidLease(0, 2, str(tmp_path), span=4096)  # uid 0 and the other accounts are skipped
    try:
        import pwd

        assert all(_no_account(uid, pwd) for uid in first.uids)
        second = confinement.UidLease(first.uids[0], 2, str(tmp_path), span=4096)
        assert not set(first.uids) & set(second.uids)
        second.close()
        with pytest.raises(confinement.UidUnavailable, match="free"):
            confinement.UidLease(first.uids[0], 3, str(tmp_path), span=2)
    finally:
        first.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(confinement.UidUnavailable, match="lock directory"):
        confinement.UidLease(UID_BASE, 1, str(tmp_path / "file" / "dir"), span=1)


def _no_account(uid: int, pwd) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


@needs_root
@pytest.mark.parametrize("bwrap, why", [
    ("/nonexistent/bwrap", "bubblewrap not found"),  # a machine without bubblewrap
    ("/bin/false", "bubblewrap cannot create the sandbox"),  # a bwrap that fails at once, as where namespaces are refused
])
def test_a_sandbox_that_cannot_confine_refuses_to_start_unless_allowed(tmp_path, bwrap, why):
    with pytest.raises(StartupError) as caught:
        with running_sandbox(tmp_path / "refused", workers=1, bwrap=bwrap):
            pass
    assert why in str(caught.value) and "allow_unconfined" in str(caught.value)
    assert "\n" not in str(caught.value)
    with running_sandbox(tmp_path / "allowed", workers=1, bwrap=bwrap, allow_unconfined=True) as unconfined:
        devices = unconfined.stub.ListDevices(sandbox_pb2.ListDevicesRequest(), timeout=10)
        assert devices.unconfined and "UNCONFINED" in devices.confinement and why in devices.confinement
        verdict = unconfined.evaluate("relu", relu(RELU_LOOP), timing=False)
        assert verdict.stage == Stage.STAGE_PASSED, describe(verdict)


def test_a_confined_sandbox_says_how_in_list_devices(sandbox):
    devices = sandbox.stub.ListDevices(sandbox_pb2.ListDevicesRequest(), timeout=10)
    assert not devices.unconfined
    for layer in ("bubblewrap", "namespaces", "uids", "seccomp"):
        assert layer in devices.confinement


@needs_root
def test_an_unusable_work_dir_is_a_start_up_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match="work directory"):
        with running_sandbox(tmp_path, workers=1, work_dir=str(tmp_path / "file" / "work")):
            pass


def _serve_until_serving(tmp: Path, cache: Path) -> tuple[subprocess.Popen, Path]:
    """`leap serve sandbox` with TMPDIR=tmp, once SERVING, and the work directory it made."""
    port = free_port()
    before = set(tmp.glob(work_dirs.PREFIX + "*"))
    process = subprocess.Popen([sys.executable, "-m", "leap", "serve", "sandbox", "--port", str(port), "--workers", "1",
                                "--cache-dir", str(cache), "--sandbox-uid", str(UID_BASE), "--log-level", "warning"],
                               cwd=ROOT, env=dict(subprocess_env(), TMPDIR=str(tmp)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        _wait_serving(channel, process)
    made = set(tmp.glob(work_dirs.PREFIX + "*")) - before
    assert len(made) == 1, made
    return process, made.pop()


@needs_root
def test_a_killed_sandbox_leaves_no_work_dir_behind_once_another_starts(tmp_path):
    """A SIGKILLed service cannot remove the work directory it made (a precompiled header
    and its jobs, ~15 MB); the next one on the host removes it, and no other's."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    living = work_dirs.OwnedDir(tmp)  # a sandbox still running
    older = tmp / (work_dirs.PREFIX + "older")  # an older version's: no lock file, not judged
    older.mkdir()
    process, dead = _serve_until_serving(tmp, tmp_path / "cache")
    try:
        assert (dead / "pch").is_dir() and (dead / work_dirs.LOCK).exists()
        process.kill()
        process.wait()
        assert dead.is_dir()  # nothing could remove it
        process, alive = _serve_until_serving(tmp, tmp_path / "cache")
        assert not dead.exists() and living.path.is_dir() and older.is_dir() and alive.is_dir()
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert not alive.exists() and living.path.is_dir()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        living.close()
    assert sorted(path.name for path in tmp.iterdir()) == [older.name]


def test_a_job_the_sandbox_cannot_set_up_is_unavailable_and_never_cached(sandbox):
    jobs = sandbox.work_dir / "jobs"
    code = relu(RELU_LOOP + f"\n// setup failure {time.time()}")
    os.chmod(jobs, 0o700)  # the candidates' uid can no longer reach its job directory
    try:
        with pytest.raises(grpc.RpcError) as caught:
            sandbox.evaluate("relu", code, timing=False)
    finally:
        os.chmod(jobs, 0o711)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "set the job up" in caught.value.details()
    verdict = sandbox.evaluate("relu", code, timing=False)
    assert verdict.stage == Stage.STAGE_PASSED and "CACHE_HIT" not in flags(verdict), describe(verdict)
    assert_contained(sandbox)



@pytest.mark.parametrize("swap", [
    "symlink(\"/proc/{pid}/cmdline\", \"run.log\")",  # the service reads its log as root, by path
    "symlink(\"/etc/shadow\", \"run.log\")",
    "mkfifo(\"run.log\", 0644)",  # a reader that opens it would wait forever
])
def test_a_log_swapped_for_a_link_or_a_fifo_reveals_nothing_and_blocks_nothing(sandbox, swap):
    code = f"""
    unlink("run.log");
    {swap.format(pid=os.getpid())};
    fprintf(stderr, "to the old log\\n");
    abort();
"""
    verdict = sandbox.evaluate("relu", attack(code), timeout=120, **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and "SIGABRT" in verdict.runtime_error, describe(verdict)
    log = verdict.runtime_error
    assert SECRET not in log and "root:" not in log and "-m pytest" not in log, log
    assert_contained(sandbox)


def test_the_bwrap_command_makes_parents_traversable_and_mounts_in_order(tmp_path):
    view = confinement.View(read_only=("/usr", "/root/.pyenv/versions/3.11", "/tmp/work"),
                            writable=("/tmp/work/jobs",), symlinks=(("usr/bin", "/bin"),))
    args = confinement.bwrap_command("bwrap", view, privileged=True)
    joined = " ".join(args)
    assert "--unshare-user" not in args and "--unshare-net" in args and "--unshare-pid" in args
    assert "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_KILL" in joined
    assert "--perms 0711 --dir /root --perms 0711 --dir /root/.pyenv" in joined  # traversable, not listable
    order = [joined.index(part) for part in ("--tmpfs /tmp", "--ro-bind /tmp/work /tmp/work",
                                             "--bind /tmp/work/jobs /tmp/work/jobs")]
    assert order == sorted(order)  # /tmp first, the work dir on it, the job directories inside that
    assert "--dir /usr" not in joined and "--dir /tmp " not in joined + " "
    assert "--unshare-user" in confinement.bwrap_command("bwrap", view, privileged=False)


def test_the_syscall_filter_refuses_what_it_lists():
    pytest.importorskip("pyseccomp")
    listed = set(confinement.DENIED_SYSCALLS)
    assert {"ptrace", "process_vm_readv", "unshare", "setns", "mount", "bpf", "io_uring_setup", "keyctl"} <= listed
    assert not listed & {"fork", "clone", "execve", "kill", "socketpair", "mmap", "openat"}  # what jobs need
    confinement.syscall_filter()  # builds on this machine's libseccomp


def test_what_a_candidate_writes_is_bounded_per_file_and_gone_after_the_job(sandbox):
    # Each file is bounded (RLIMIT_FSIZE, 8 MiB here); their number is not (put work_dir on a
    # size-limited file system, docs/ARCHITECTURE.md), but nothing outlives the job.
    many = """
    static char block[1 << 20];
    for (int f = 0; f < 12; f++) {
        char name[32]; snprintf(name, sizeof name, "fill-%d.bin", f);
        FILE* out = fopen(name, "wb");
        for (int k = 0; out && k < 4; k++) fwrite(block, 1, sizeof block, out);
        if (out) fclose(out);
    }
"""
    assert_passed(sandbox.evaluate("relu", attack(many), **NO_STATIC))
    assert_contained(sandbox)  # the job directories are empty again
    huge = '    FILE* out = fopen("huge.bin", "wb"); static char block[1 << 20];\n' \
           '    for (int k = 0; k < 16; k++) fwrite(block, 1, sizeof block, out);\n'
    verdict = sandbox.evaluate("relu", attack(huge), **NO_STATIC)
    assert verdict.stage == Stage.STAGE_RUN and "FILE_SIZE_LIMIT" in flags(verdict), describe(verdict)
    assert_contained(sandbox)
