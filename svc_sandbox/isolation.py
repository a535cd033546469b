"""Process isolation: every compile and every run of a candidate is a child process with its
own working directory, session and process group, resource limits and a syscall filter,
running as its slot's unprivileged uid inside the slot's confinement (confinement.py: a
bubblewrap sandbox with its own mount, pid and network namespaces over a read-only minimal
view); it is killed whole when it overruns or when its caller cancels.

Children are forked by a *zygote*: one small, single-threaded Python process per worker slot,
started once inside the slot's sandbox with NumPy (and, when first needed, PyTorch) already
imported, so a run costs a fork instead of an interpreter start. The zygote never runs
candidate code itself and never sees a secret: it is a fresh interpreter (exec, not a fork
of the service) with an environment built from nothing. It is the subreaper of its
children, and everything in its pid namespace is its slot's, so nothing a candidate leaves
behind escapes the final sweep. Forking from the multi-threaded gRPC process is never done.

    service thread ──SEQPACKET──> bwrap ─> zygote (slot k) ──fork──> child: setuid, limits, seccomp, exec or harness
                 <──────────── SOCK_STREAM frames (run jobs) ───────────────┘

Each slot runs as its own uid (leased by confinement.UidLease), so RLIMIT_NPROC counts one
candidate's processes only, candidates of different slots or services cannot signal each
other, and "kill every process of this uid" is an exact way to leave nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import fcntl
import json
import os
import resource
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from svc_sandbox.wire import WireError, recv_packet, send_packet

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
JOB_FD = 3  # where a run job's socket lands in the child
SETUP_FD = 4  # the child's report of a failed setup (closed on exec, or by the harness once set up)
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


def enter_sandbox(job: dict[str, Any], identity: dict[str, Any], job_fd: int | None, setup_fd: int,
                  syscall_filter: Any = None) -> None:
    """In a freshly forked child: become a contained, unprivileged process in `job["cwd"]`.
    The uid is dropped first, so the job directory and its log are opened as the candidate
    (the zygote keeps no capability that bypasses file permissions); the syscall filter is
    loaded last, after PR_SET_NO_NEW_PRIVS."""
    os.setsid()
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE and SIGXFSZ; exec keeps ignored signals
    if identity.get("uid") is not None:
        os.setgroups([])
        os.setgid(identity["gid"])
        os.setuid(identity["uid"])  # clears every capability
    os.chdir(job["cwd"])
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if job_fd is not None:
        os.dup2(job_fd, JOB_FD)
        os.set_inheritable(JOB_FD, True)
    else:
        os.dup2(null, JOB_FD)
    os.dup2(setup_fd, SETUP_FD)  # close-on-exec (dup2 clears the flag; set it again below)
    os.set_inheritable(SETUP_FD, False)
    os.closerange(SETUP_FD + 1, 65536)
    _set_limits(job["limits"])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if syscall_filter is not None:
        syscall_filter.load()
    os.environ.clear()
    os.environ.update(job.get("env", {}))


def python_unreadable(identity: dict[str, Any]) -> str:
    """Which part of this Python installation the candidates' uid cannot read ("" when it can
    read all of it), checked inside the sandbox at start. Lazy imports and load_inline's
    headers need it; the service refuses the kernelbench toolchain where it is unreadable
    (the view binds the installation, so only its own file modes can make it so)."""
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


def _run_child(op: str, job: dict[str, Any], identity: dict[str, Any], job_fd: int | None, setup_fd: int,
               syscall_filter: Any, harness: Any) -> None:
    """The forked child: set up, then exec the program or run the harness; never returns.
    A failure before the job's own code starts is written to the setup pipe (an
    infrastructure failure, never the candidate's verdict)."""
    code = 70
    started = False
    try:
        # Out of the way of the fixed slots 0-4 before they are filled.
        setup_fd = fcntl.fcntl(setup_fd, fcntl.F_DUPFD, 10)
        if job_fd is not None:
            job_fd = fcntl.fcntl(job_fd, fcntl.F_DUPFD, 10)
        enter_sandbox(job, identity, job_fd, setup_fd, syscall_filter)
        setup_fd = SETUP_FD
        if op == "exec":
            os.execve(job["argv"][0], job["argv"], os.environ)  # SETUP_FD closes on success
        os.close(SETUP_FD)
        started = True
        code = harness.main(socket.socket(fileno=JOB_FD), job["spec"])
    except BaseException as err:  # noqa: BLE001 - anything here is the child's failure
        text = f"sandbox: {type(err).__name__}: {err}\n".encode()
        for fd in ([2] if started else [setup_fd, SETUP_FD]):
            try:
                os.write(fd, text)
                break
            except OSError:
                continue
    finally:
        os._exit(code)


def zygote_main(ctl_fd: int) -> None:
    """The zygote's loop: one job at a time, forever (until the service closes the socket)."""
    config = json.loads(os.environ.pop("LEAP_SANDBOX_ZYGOTE", "{}"))
    # No PR_SET_PDEATHSIG here: it fires when the parent *thread* ends, and the service starts
    # zygotes from short-lived threads. The zygote ends when its control socket closes instead
    # (and everything in its pid namespace with it).
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where it is (to the service's log)
    ctl = socket.socket(fileno=ctl_fd)
    identity = {"uid": config.get("uid"), "gid": config.get("gid")}
    syscall_filter, seccomp_error = None, ""
    if config.get("seccomp", True):
        try:
            from svc_sandbox.confinement import compiled_filter

            syscall_filter = compiled_filter()
        except Exception as err:  # reported at start; the service decides whether it may serve
            seccomp_error = f"{type(err).__name__}: {err}"
    unreadable = python_unreadable(identity)
    import numpy  # noqa: F401  (preloaded for every run child)

    from svc_sandbox import harness

    send_packet(ctl, {"ready": True, "pid": os.getpid(), "seccomp": syscall_filter is not None,
                      "seccomp_error": seccomp_error, "python_unreadable": unreadable})
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

            timer.serve(ctl, message, fds, identity, syscall_filter, harness)
            continue
        if op not in ("exec", "run"):
            send_packet(ctl, {"error": f"unknown op {op!r}"})
            continue
        job = message["job"]
        job_fd = fds[0] if fds else None
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            ctl.close()
            os.close(read)
            _run_child(op, job, identity, job_fd, write, syscall_filter, harness)
        os.close(write)
        if job_fd is not None:
            os.close(job_fd)
        failure = _read_all(read)
        if failure:
            _kill_everything(pid, identity)
            send_packet(ctl, {"setup_error": failure})
            continue
        send_packet(ctl, {"pid": pid})
        send_packet(ctl, {"exit": _supervise(ctl, pid, job, identity)})


def _read_all(fd: int) -> str:
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace").strip()


# --------------------------------------------------------------------------------------
# In the service: one Zygote per worker slot.


def read_job_file(path: str | os.PathLike, limit: int = 1 << 20) -> str:
    """The text of a file in a job directory, read by the service ("" when it is not a
    regular file there). The candidate owns its job directory and may have swapped the file
    for a symlink (the service would read the host's /etc/shadow or its own environment as
    root) or a FIFO (the service would wait forever): neither is followed or opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        chunks, left = [], limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


class SandboxUnavailable(RuntimeError):
    """The zygote could not be started, died, or could not set a job up; the job did not run
    (an infrastructure failure: never a verdict, never cached)."""


class JobCancelled(RuntimeError):
    """The job's caller cancelled it (the client went away, its deadline passed, or the
    service is stopping); its process was killed."""


@dataclasses.dataclass(frozen=True)
class Sandboxing:
    """How a slot's zygote is confined: the command that starts it inside its sandbox
    (bwrap and its arguments; empty: started bare), and whether children load the filter."""

    command: tuple[str, ...] = ()
    seccomp: bool = True


# The zygote's whole environment: nothing of the service's (no token, no credentials).
PASSED_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES",
                    "NVIDIA_DRIVER_CAPABILITIES")


def zygote_environment(threads: int, config: dict[str, Any]) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = {"PATH": os.pathsep.join(dict.fromkeys([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])),
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/nonexistent", "PYTHONPATH": root,
           "PYTHONDONTWRITEBYTECODE": "1", "LEAP_SANDBOX_ZYGOTE": json.dumps(config)}
    # NumPy's BLAS sizes its pool at import: the reference gets what a candidate gets.
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    env.update({name: os.environ[name] for name in PASSED_VARIABLES if name in os.environ})
    return env


class Zygote:
    """The service's handle on one zygote process. One worker thread uses it; `cancel` and
    `close` may come from any thread."""

    def __init__(self, slot: int, uid: int | None, log: Any, threads: int = 1,
                 sandboxing: Sandboxing = Sandboxing(seccomp=False)):
        self.slot = slot
        self.threads = threads
        self.uid = uid
        self.sandboxing = sandboxing
        self.log = log
        self.process: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.seccomp = False  # whether children load the syscall filter (from the zygote's hello)
        self.seccomp_error = ""
        self.python_unreadable = ""  # parts of the Python install the slot's uid cannot read
        self.preloaded: set[str] = set()
        self.closed = False  # closed for good (the service is stopping): never started again
        self._lock = threading.Lock()
        self._cancelled = False

    def start(self, timeout: float = 120.0) -> None:
        if self.closed:
            raise SandboxUnavailable(f"sandbox worker {self.slot} is stopping")
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"uid": self.uid, "gid": self.uid, "seccomp": self.sandboxing.seccomp}
        command = [*self.sandboxing.command, *(("--chdir", "/") if self.sandboxing.command else ()),
                   sys.executable, "-m", "svc_sandbox.zygote", str(child.fileno())]
        try:
            self.process = subprocess.Popen(command, pass_fds=[child.fileno()], env=zygote_environment(self.threads, config),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            start_new_session=True)
        except OSError as err:
            parent.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} did not start: {command[0]}: {err.strerror}") from None
        finally:
            child.close()
        self.ctl = parent
        self.preloaded = set()
        try:
            hello, _ = recv_packet(parent, timeout=timeout)
        except WireError as err:
            why = self._stderr() or str(err)
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} did not start: {why}") from None
        threading.Thread(target=self._drain_stderr, args=(self.process,), daemon=True).start()
        self.seccomp, self.seccomp_error = bool(hello.get("seccomp")), str(hello.get("seccomp_error", ""))
        self.python_unreadable = str(hello.get("python_unreadable", ""))

    def _stderr(self) -> str:
        """What a zygote that failed to start printed (bwrap says why it could not confine)."""
        if self.process is None or self.process.stderr is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        text = self.process.stderr.read(4096).decode(errors="replace") if self.process.poll() is not None else ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def _drain_stderr(self, process: subprocess.Popen) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self.log.warning("sandbox worker says", slot=self.slot, line=line.decode(errors="replace").rstrip()[:500])

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
        try:
            send_packet(self.ctl, {"op": "preload", "modules": wanted})
            reply, _ = recv_packet(self.ctl, timeout=300)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        self.preloaded.update(m for m in wanted if m not in reply.get("errors", {}))
        return dict(reply.get("errors", {}))

    # -------------------------------------------------------------- cancellation

    def begin_job(self) -> None:
        """A new job of the pool starts on this zygote: earlier cancellations are spent."""
        with self._lock:
            self._cancelled = False

    def cancel(self) -> None:
        """Kill the running job at once, and refuse to start another until `begin_job`; the
        worker's calls then raise JobCancelled. Safe from any thread."""
        with self._lock:
            self._cancelled = True
            if self.ctl is not None:
                with contextlib.suppress(WireError, OSError):
                    send_packet(self.ctl, {"op": "kill"})

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _submit(self, op: str, job: dict[str, Any], fds: list[int]) -> int:
        self.ensure()
        assert self.ctl is not None
        try:
            with self._lock:  # a cancel either comes before (and nothing starts) or after the job's op
                if self._cancelled:
                    raise JobCancelled(f"sandbox worker {self.slot}: the job was cancelled")
                send_packet(self.ctl, {"op": op, "job": job}, fds)
            reply, _ = recv_packet(self.ctl, timeout=60)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        if "setup_error" in reply:
            raise SandboxUnavailable(f"sandbox worker {self.slot} could not set the job up: {reply['setup_error']}")
        if "pid" not in reply:
            raise SandboxUnavailable(f"sandbox worker {self.slot}: {reply.get('error', reply)}")
        return int(reply["pid"])

    def _wait(self, grace: float) -> ExitInfo:
        assert self.ctl is not None
        try:
            reply, _ = recv_packet(self.ctl, timeout=grace)
        except WireError as err:
            self.close()
            if self._cancelled:
                raise JobCancelled(f"sandbox worker {self.slot}: the job was cancelled") from None
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        exit = ExitInfo(**reply["exit"])
        if self._cancelled:  # killed for its caller: no verdict (and nothing cached) from it
            raise JobCancelled(f"sandbox worker {self.slot}: the job was cancelled")
        return exit

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
        Every job runs as the slot's uid: `drop_privileges` is accepted for the callers
        that still pass it and has no effect."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._submit("run", {"spec": spec, "cwd": cwd, "env": env, "limits": limits.as_dict(), "log": log},
                         [theirs.fileno()])
        finally:
            theirs.close()
        handle = RunHandle(self, ours, limits)
        try:
            yield handle
        finally:
            if handle.failure is None:
                handle.finish()

    @contextlib.contextmanager
    def session(self, candidate: dict[str, Any], reference: dict[str, Any] | None, memfds: list[int]):
        """Start a measured session (timer.py): the candidate's harness and, when given, a
        reference process, each a job like `run`'s ({"spec", "cwd", "env", "limits", "log",
        "drop_privileges": the reference keeps the zygote's own user where it can}), with the
        memfds of their regions (the candidate's first). Yields the timer.SessionLink that
        commands it; the session is ended on the way out."""
        from svc_sandbox.timer import SessionLink

        self.ensure()
        assert self.ctl is not None
        try:
            with self._lock:  # as in _submit: a cancel comes before (nothing starts) or after
                if self._cancelled:
                    raise JobCancelled(f"sandbox worker {self.slot}: the job was cancelled")
                send_packet(self.ctl, {"op": "session", "candidate": candidate, "reference": reference}, memfds)
            reply, _ = recv_packet(self.ctl, timeout=60)
        except WireError as err:
            self.close()
            raise SandboxUnavailable(f"sandbox worker {self.slot} failed: {err}") from None
        if "setup_error" in reply:
            raise SandboxUnavailable(f"sandbox worker {self.slot} could not set the session up: {reply['setup_error']}")
        if "pids" not in reply:
            raise SandboxUnavailable(f"sandbox worker {self.slot}: {reply.get('error', reply)}")
        link = SessionLink(self, reply["pids"])
        try:
            yield link
        finally:
            link.end()

    def close(self, final: bool = False) -> None:
        """Stop the zygote and everything in its sandbox (its pid namespace ends with it).
        `final`: never start it again (the service is stopping). Safe from any thread: a
        worker blocked on the control socket wakes with an error."""
        if final:
            self.closed = True
        ctl, self.ctl = self.ctl, None
        if ctl is not None:
            with contextlib.suppress(OSError):
                ctl.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                ctl.close()
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.stderr is not None:
                with contextlib.suppress(OSError):
                    process.stderr.close()


class RunHandle:
    """A running harness: `sock` carries its frames; `finish()` ends it and gives its ExitInfo."""

    def __init__(self, zygote: Zygote, sock: socket.socket, limits: Limits):
        self.zygote = zygote
        self.sock = sock
        self.limits = limits
        self.exit: ExitInfo | None = None
        self.failure: BaseException | None = None  # why the zygote gave no ExitInfo (cancelled, died)

    def finish(self, kill: bool = False) -> ExitInfo:
        if self.failure is not None:
            raise self.failure
        if self.exit is None:
            with contextlib.suppress(OSError):
                self.sock.close()  # the harness sees EOF and exits
            if kill:
                self.zygote.kill()
            try:
                self.exit = self.zygote._wait(self.limits.wall_seconds + 60)
            except (JobCancelled, SandboxUnavailable) as err:
                self.failure = err  # the zygote answered (or died) once: never wait for a second answer
                raise
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

