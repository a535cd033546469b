"""Process isolation: every compile and every run of a candidate is a child process with its
own working directory, session and process group, resource limits, no network and (when the
service runs as root) its own unprivileged user; it is killed whole when it overruns.

Children are forked by a *zygote*: one small, single-threaded Python process per worker slot,
started once with NumPy (and, when first needed, PyTorch) already imported, so a run costs
a fork instead of an interpreter start. The zygote never runs candidate code itself; it
enters a new network namespace once at start (so every child it forks has no network), and
it is the subreaper of its children, so nothing a candidate leaves behind escapes the
final sweep. Forking from the multi-threaded gRPC process is never done.

    service thread ──SEQPACKET──> zygote (slot k) ──fork──> child: limits, setuid, exec or harness
                 <──────────── SOCK_STREAM frames (run jobs) ──────────┘

Each slot runs as its own uid (`sandbox_uid + k`), so RLIMIT_NPROC counts one candidate's
processes only, candidates of different slots cannot signal each other, and "kill every
process of this uid" is an exact way to leave nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from svc_sandbox.wire import WireError, recv_packet, send_packet

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
JOB_FD = 3  # where a run job's socket lands in the child
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP}
MEMORY_MARKERS = ("std::bad_alloc", "MemoryError", "Cannot allocate memory", "out of memory", "DefaultCPUAllocator")
PROCESS_MARKERS = ("Resource temporarily unavailable", "BlockingIOError", "can't start new thread")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits of one child process (0 means none)."""

    wall_seconds: float
    cpu_seconds: float = 0.0  # RLIMIT_CPU: SIGXCPU at the limit, SIGKILL one second later
    memory_bytes: int = 0  # RLIMIT_AS
    file_bytes: int = 0  # RLIMIT_FSIZE: SIGXFSZ on a larger write
    processes: int = 0  # RLIMIT_NPROC (threads count), per uid
    open_files: int = 256  # RLIMIT_NOFILE

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExitInfo:
    """How a child ended."""

    returncode: int | None = None  # exit status, None when ended by a signal
    signal: int | None = None
    timed_out: bool = False
    killed: bool = False  # killed on request (cancellation, or a phase deadline of the caller)
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    max_rss_bytes: int = 0
    processes_at_kill: int = 0
    log: str = ""  # the child's stdout and stderr (filled by the caller that knows the limit)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.killed

    def describe(self) -> str:
        if self.timed_out:
            return f"timed out after {self.wall_seconds:.1f} s and was killed"
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exited with status {self.returncode}"


# --------------------------------------------------------------------------------------
# Inside the zygote and its children.


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    _libc().prctl(option, value, 0, 0, 0)


def enter_network_namespace() -> tuple[bool, str]:
    """Move the calling process into a new network namespace (loopback only, down).
    Returns (done, why not)."""
    libc = _libc()
    if libc.unshare(CLONE_NEWNET) == 0:
        return True, ""
    first = os.strerror(ctypes.get_errno())
    if os.geteuid() != 0:  # unprivileged: a user namespace gives the capability for it
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            with contextlib.suppress(OSError):
                Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
            Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
            return True, ""
        return False, f"unshare(CLONE_NEWNET) failed: {first}; with a user namespace: {os.strerror(ctypes.get_errno())}"
    return False, f"unshare(CLONE_NEWNET) failed: {first}"


def _set_limits(limits: dict[str, Any]) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.get("cpu_seconds"):
        soft = max(1, int(limits["cpu_seconds"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    if limits.get("memory_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (int(limits["memory_bytes"]),) * 2)
    if limits.get("file_bytes"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["file_bytes"]),) * 2)
    if limits.get("open_files"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(limits["open_files"]),) * 2)
    if limits.get("processes"):
        resource.setrlimit(resource.RLIMIT_NPROC, (int(limits["processes"]),) * 2)


def enter_sandbox(job: dict[str, Any], identity: dict[str, Any], job_fd: int | None) -> None:
    """In a freshly forked child: become a contained, unprivileged process in `job["cwd"]`."""
    os.setsid()
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ; exec keeps ignored signals
    os.chdir(job["cwd"])
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if job_fd is not None:
        os.dup2(job_fd, JOB_FD)
        os.set_inheritable(JOB_FD, True)
    os.closerange(JOB_FD + 1 if job_fd is not None else JOB_FD, 65536)
    _set_limits(job["limits"])
    if identity.get("uid") is not None:
        os.setgroups([])
        os.setgid(identity["gid"])
        os.setuid(identity["uid"])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.environ.clear()
    os.environ.update(job.get("env", {}))


def python_unreadable(identity: dict[str, Any]) -> str:
    """Which part of this Python installation the candidates' uid cannot read ("" when it can
    read all of it). Lazy imports and load_inline's headers need it; a pyenv under /root is
    the usual reason it cannot."""
    import sysconfig

    if identity.get("uid") is None:
        return ""
    paths = sysconfig.get_paths()
    wanted = [paths[k] for k in ("stdlib", "platstdlib", "include", "purelib") if os.path.isdir(paths.get(k, ""))]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(identity["gid"])
            os.setuid(identity["uid"])
            bad = [p for p in wanted if not os.access(p, os.R_OK | os.X_OK)]
            os.write(write, "\n".join(bad).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        bad = pipe.read().decode()
    os.waitpid(pid, 0)
    return bad.replace("\n", ", ")


def _count_processes(uid: int | None, pgid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if uid is not None:
                if os.stat(entry.path).st_uid == uid:
                    count += 1
            elif os.getpgid(int(entry.name)) == pgid:
                count += 1
        except OSError:
            continue
    return count


def _kill_everything(pgid: int, identity: dict[str, Any], patience: float = 10.0) -> None:
    """Kill the job's process group, then everything that may have escaped it, and reap it
    all (orphans reparent to this zygote, the subreaper). As the job's own uid, kill(-1)
    reaches exactly its processes; it is repeated until none is left, because a process
    that was forking while the signal went out can leave a child behind. Without a uid of
    its own, the orphans of this zygote are killed instead."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + patience
    uid = identity.get("uid")
    while True:
        _reap()
        left = _count_processes(uid, pgid) if uid is not None else len(_children_of(os.getpid(), zombies=True))
        if left == 0 or time.monotonic() > deadline:
            return
        if uid is not None:
            reaper = os.fork()
            if reaper == 0:
                try:
                    os.setgid(identity["gid"])
                    os.setuid(uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(reaper, 0)
        else:
            for pid in _children_of(os.getpid()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)


def _children_of(pid: int, zombies: bool = False) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) == pid and (zombies or fields[0] != "Z"):
                found.append(int(entry.name))
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _supervise(ctl: socket.socket, pid: int, job: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """Wait for the child, killing it at its deadline or on request; then sweep."""
    started = time.monotonic()
    deadline = started + float(job["limits"]["wall_seconds"])
    pidfd = os.pidfd_open(pid)
    timed_out = killed = False
    processes = 0
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([pidfd, ctl], [], [], remaining)
            if pidfd in ready:
                break
            if ctl in ready:
                try:
                    message, _ = recv_packet(ctl, timeout=5)
                except WireError:  # the service is gone: end the job, then this zygote
                    _kill_everything(pid, identity)
                    os._exit(0)
                if message.get("op") == "kill":
                    killed = True
                    break
        if timed_out or killed:
            processes = _count_processes(identity.get("uid"), pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
    finally:
        os.close(pidfd)
    _kill_everything(pid, identity)  # whatever the job left behind, daemons included
    return {
        "returncode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "timed_out": timed_out, "killed": killed, "wall_seconds": time.monotonic() - started,
        "cpu_seconds": usage.ru_utime + usage.ru_stime, "max_rss_bytes": usage.ru_maxrss * 1024,
        "processes_at_kill": processes,
    }


def zygote_main(ctl_fd: int) -> None:
    """The zygote's loop: one job at a time, forever (until the service closes the socket)."""
    config = json.loads(os.environ.pop("LEAP_SANDBOX_ZYGOTE", "{}"))
    # No PR_SET_PDEATHSIG here: it fires when the parent *thread* ends, and the service starts
    # zygotes from short-lived threads. The zygote ends when its control socket closes instead.
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    ctl = socket.socket(fileno=ctl_fd)
    netns, reason = (False, "network isolation is off in the config")
    if config.get("network_isolation", True):
        netns, reason = enter_network_namespace()
    identity = {"uid": config.get("uid"), "gid": config.get("gid")}
    unreadable = python_unreadable(identity)
    import numpy  # noqa: F401  (preloaded for every run child)

    from svc_sandbox import harness

    send_packet(ctl, {"ready": True, "pid": os.getpid(), "netns": netns, "netns_reason": reason,
                      "python_unreadable": unreadable})
    while True:
        try:
            message, fds = recv_packet(ctl)
        except WireError:
            return
        op = message.get("op")
        if op == "preload":
            errors = {}
            for module in message.get("modules", []):
                try:
                    __import__(module)
                except Exception as err:  # reported, not fatal: the job will say why it cannot run
                    errors[module] = f"{type(err).__name__}: {err}"
            send_packet(ctl, {"preloaded": True, "errors": errors})
            continue
        if op == "kill":  # for a job that already ended: nothing to do
            continue
        if op == "session":  # a measured session: timer.py forks its processes and keeps the clock
            from svc_sandbox import timer

            timer.serve(ctl, message, fds, identity)
            continue
        if op not in ("exec", "run"):
            send_packet(ctl, {"error": f"unknown op {op!r}"})
            continue
        job = message["job"]
        job_fd = fds[0] if fds else None
        job_identity = identity if job.get("drop_privileges", True) else {"uid": None, "gid": None}
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                ctl.close()
                enter_sandbox(job, job_identity, job_fd)
                if op == "exec":
                    os.execve(job["argv"][0], job["argv"], os.environ)
                else:
                    code = harness.main(socket.socket(fileno=JOB_FD), job["spec"])
            except BaseException as err:  # noqa: BLE001 - anything here is the child's failure
                with contextlib.suppress(Exception):
                    os.write(2, f"sandbox: {type(err).__name__}: {err}\n".encode())
                code = 127 if op == "exec" else 70
            finally:
                os._exit(code)
        if job_fd is not None:
            os.close(job_fd)
        send_packet(ctl, {"pid": pid})
        send_packet(ctl, {"exit": _supervise(ctl, pid, job, job_identity)})


# --------------------------------------------------------------------------------------
# In the service: one Zygote per worker slot.


class SandboxUnavailable(RuntimeError):
    """The zygote could not be started or died; the job did not run."""


class Zygote:
    """The service's handle on one zygote process. Not thread-safe: one worker uses it."""

    def __init__(self, slot: int, uid: int | None, network_isolation: bool, log: Any, threads: int = 1):
        self.slot = slot
        self.threads = threads
        self.uid = uid
        self.network_isolation = network_isolation
        self.log = log
        self.process: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.netns = False
        self.netns_reason = ""
        self.python_unreadable = ""  # parts of the Python install the slot's uid cannot read
        self.preloaded: set[str] = set()

    def start(self, timeout: float = 120.0) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"uid": self.uid, "gid": self.uid, "network_isolation": self.network_isolation}
        threads = str(self.threads)  # NumPy's BLAS sizes its pool at import: the reference gets what a candidate gets
        env = dict(os.environ, LEAP_SANDBOX_ZYGOTE=json.dumps(config), OMP_NUM_THREADS=threads,
                   OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.process = subprocess.Popen([sys.executable, "-m", "svc_sandbox.zygote", str(child.fileno())],
                                        pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        child.close()
        self.ctl = parent
        self.preloaded = set()
        try:
            hello, _ = recv_packet(parent, timeout=timeout)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} did not start: {err}") from None
        self.netns, self.netns_reason = bool(hello.get("netns")), str(hello.get("netns_reason", ""))
        self.python_unreadable = str(hello.get("python_unreadable", ""))

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ensure(self) -> None:
        if not self.alive:
            if self.process is not None:
                self.log.warning("sandbox worker restarted", slot=self.slot, returncode=self.process.returncode)
                self.close()
            self.start()

    def preload(self, *modules: str) -> dict[str, str]:
        """Import modules in the zygote so children inherit them (PyTorch for kernelbench)."""
        wanted = [m for m in modules if m not in self.preloaded]
        if not wanted:
            return {}
        self.ensure()
        assert self.ctl is not None
        send_packet(self.ctl, {"op": "preload", "modules": wanted})
        reply, _ = recv_packet(self.ctl, timeout=300)
        self.preloaded.update(m for m in wanted if m not in reply.get("errors", {}))
        return dict(reply.get("errors", {}))

    def _submit(self, op: str, job: dict[str, Any], fds: list[int]) -> int:
        self.ensure()
        assert self.ctl is not None
        try:
            send_packet(self.ctl, {"op": op, "job": job}, fds)
            reply, _ = recv_packet(self.ctl, timeout=60)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        if "pid" not in reply:
            raise SandboxUnavailable(f"sandbox worker {self.slot}: {reply.get('error', reply)}")
        return int(reply["pid"])

    def _wait(self, grace: float) -> ExitInfo:
        assert self.ctl is not None
        try:
            reply, _ = recv_packet(self.ctl, timeout=grace)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        return ExitInfo(**reply["exit"])

    def kill(self) -> None:
        """Ask the zygote to kill the running job (it answers through _wait)."""
        if self.ctl is not None:
            with contextlib.suppress(WireError, OSError):
                send_packet(self.ctl, {"op": "kill"})

    def exec(self, argv: list[str], cwd: str, env: dict[str, str], limits: Limits, log: str) -> ExitInfo:
        """Run a program (a compiler) in the sandbox and wait for it."""
        self._submit("exec", {"argv": argv, "cwd": cwd, "env": env, "limits": limits.as_dict(), "log": log}, [])
        return self._wait(limits.wall_seconds + 60)

    @contextlib.contextmanager
    def run(self, spec: dict[str, Any], cwd: str, env: dict[str, str], limits: Limits, log: str,
            drop_privileges: bool = True):
        """Start the harness on `spec` in the sandbox; yield a RunHandle to talk to it.
        `drop_privileges=False` keeps the service's user (see Evaluator.kernelbench_uid)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._submit("run", {"spec": spec, "cwd": cwd, "env": env, "limits": limits.as_dict(), "log": log,
                                 "drop_privileges": drop_privileges}, [theirs.fileno()])
        finally:
            theirs.close()
        handle = RunHandle(self, ours, limits)
        try:
            yield handle
        finally:
            handle.finish()

    @contextlib.contextmanager
    def session(self, candidate: dict[str, Any], reference: dict[str, Any] | None, memfds: list[int]):
        """Start a measured session (timer.py): the candidate's harness and, when given, a
        reference process, each a job like `run`'s ({"spec", "cwd", "env", "limits", "log",
        "drop_privileges"}), with the memfds of their regions (the candidate's first). Yields
        the timer.SessionLink that commands it; the session is ended on the way out."""
        from svc_sandbox.timer import SessionLink

        self.ensure()
        assert self.ctl is not None
        try:
            send_packet(self.ctl, {"op": "session", "candidate": candidate, "reference": reference}, memfds)
            reply, _ = recv_packet(self.ctl, timeout=60)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        if "pids" not in reply:
            raise SandboxUnavailable(f"sandbox worker {self.slot}: {reply.get('error', reply)}")
        link = SessionLink(self, reply["pids"])
        try:
            yield link
        finally:
            link.end()

    def close(self) -> None:
        if self.ctl is not None:
            with contextlib.suppress(OSError):
                self.ctl.close()
            self.ctl = None
        if self.process is not None:
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
            self.process = None


class RunHandle:
    """A running harness: `sock` carries its frames; `finish()` ends it and gives its ExitInfo."""

    def __init__(self, zygote: Zygote, sock: socket.socket, limits: Limits):
        self.zygote = zygote
        self.sock = sock
        self.limits = limits
        self.exit: ExitInfo | None = None

    def finish(self, kill: bool = False) -> ExitInfo:
        if self.exit is None:
            with contextlib.suppress(OSError):
                self.sock.close()  # the harness sees EOF and exits
            if kill:
                self.zygote.kill()
            self.exit = self.zygote._wait(self.limits.wall_seconds + 60)
        return self.exit

    def kill(self) -> ExitInfo:
        return self.finish(kill=True)


def classify(exit: ExitInfo, limits: Limits) -> tuple[str, set[str]]:
    """A one-line reason and the limit flags (names of VerdictFlag without the prefix) of an
    abnormal exit."""
    flags: set[str] = set()
    log = exit.log or ""
    if exit.timed_out:
        flags.add("TIMEOUT")
    if exit.signal == signal.SIGXCPU or (exit.signal == signal.SIGKILL and not exit.timed_out and not exit.killed
                                          and limits.cpu_seconds and exit.cpu_seconds >= limits.cpu_seconds - 0.05):
        flags.add("CPU_LIMIT")
    if exit.signal == signal.SIGXFSZ or "File too large" in log:
        flags.add("FILE_SIZE_LIMIT")
    if exit.signal in CRASH_SIGNALS:
        flags.add("CRASHED")
    if any(marker in log for marker in MEMORY_MARKERS):
        flags.add("MEMORY_LIMIT")
    if (limits.processes and exit.processes_at_kill >= limits.processes - 2) or any(m in log for m in PROCESS_MARKERS):
        flags.add("PROCESS_LIMIT")
    return exit.describe(), flags

