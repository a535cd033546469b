"""The clock of a measured session. It runs in the zygote: a single-threaded process with no
candidate code in it, which the candidate's uid can neither signal nor trace (zygote_main
calls `serve` for the "session" op; isolation.py has the rest of the zygote).

`serve` forks two contained children, the candidate's harness and (when timing) a reference
process that runs the task's own reference and nothing else, and hands each the memfd of its
region (the reference also gets the candidate's, to write inputs it generates into both). Then
it executes the service's commands one at a time:

- `await`: wait for a child to say it is ready (it has mapped its region and loaded its code);
- `step`: continue one child (SIGCONT to its process group), take the time, send it one
  fixed-size command (run calls on slots [first, first + count)), wait for its one-byte
  answer, stop its process group again (SIGSTOP) and wait until the stop is complete, take
  the time. Two figures, both from just before the command to the completed stop, so that
  whatever the child does before it is stopped (threads still finishing, an early "done")
  is inside them: the wall clock (`ns`) and the CPU time of the child's whole thread group
  (`cpu_ns`, its POSIX process CPU clock, read by this process: dead threads included), which
  does not count the time it waited for a core. Between its steps a child is stopped: it
  cannot compute while the other one is timed, nor touch its buffers while the service
  writes or reads them;
- `guard`: before timing: kill every process of the candidate but its harness (anything it
  started), and where the candidate has a uid of its own, set its RLIMIT_NPROC to the tasks
  it has now (prlimit), so it can start no process (nor thread) while it is timed: a process
  outside its process group would not be stopped with it. Without a uid of its own, every
  guarded step ends with a search for such processes instead;
- `sweep`: kill every process of the candidate but its harness, and say how many there were
  and whether it sent bytes nobody asked for;
- `end`: kill both, sweep, and report how each ended.

Nothing a child sends is believed but the one byte of its answer, read from a
SOCK_SEQPACKET socket into a 64-byte buffer; a byte nobody asked for is a protocol error.

Every command gets one reply. A `kill` may arrive at any time (from another thread of the
service: a cancelled call): it ends both children at once, and the command in flight is
answered {"killed": true}.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import time
import types
from typing import Any

from svc_sandbox.isolation import _count_processes, _kill_everything, _read_all, _run_child
from svc_sandbox.wire import WireError, recv_packet, send_packet

STEP = struct.Struct("!cxxxIIQ")  # command byte, first slot, count, seed
ANSWER_BYTES = 64  # a longer answer is cut here (and is a protocol error anyway)
READY, DONE, LOAD_ERROR, COMPILE_ERROR, RUN_ERROR, SHAPE_ERROR = b"R", b"D", b"L", b"C", b"E", b"S"
LIMIT_TASKS = b"P"  # a command to the harness: lower your RLIMIT_NPROC to `count` (before it is timed)
ANSWERS = {READY, DONE, LOAD_ERROR, COMPILE_ERROR, RUN_ERROR, SHAPE_ERROR}


class _Killed(Exception):
    """The service asked for the session to end (or went away) while a command ran."""


class _Child:
    def __init__(self, name: str, pid: int, sock: socket.socket, identity: dict[str, Any], wall: float):
        self.name = name
        self.pid = pid
        self.sock = sock
        self.identity = identity
        self.pidfd = os.pidfd_open(pid)
        self.started = time.monotonic()
        self.deadline = self.started + wall
        self.exit: dict[str, Any] | None = None  # set once it has ended (and been reaped)
        self.timed_out = self.killed = False
        self.processes_at_kill = 0

    @property
    def alive(self) -> bool:
        return self.exit is None

    def reap(self, blocking: bool = True) -> bool:
        """Collect its exit (True) when it has ended."""
        if self.exit is not None:
            return True
        try:
            pid, status, usage = os.wait4(self.pid, 0 if blocking else os.WNOHANG)
        except ChildProcessError:
            pid, status, usage = self.pid, 0, None
        if pid == 0:
            return False
        if os.WIFSTOPPED(status):  # a stop report, not an end
            return False
        self._ended(status, usage)
        return True

    def _ended(self, status: int, usage: Any) -> None:
        self.exit = {
            "returncode": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": self.timed_out, "killed": self.killed, "wall_seconds": time.monotonic() - self.started,
            "cpu_seconds": (usage.ru_utime + usage.ru_stime) if usage else 0.0,
            "max_rss_bytes": usage.ru_maxrss * 1024 if usage else 0, "processes_at_kill": self.processes_at_kill,
        }
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self.sock.close()

    def kill(self, timed_out: bool = False, killed: bool = False) -> None:
        if self.exit is not None:
            return
        self.timed_out |= timed_out
        self.killed |= killed
        if timed_out or killed:
            self.processes_at_kill = _count_processes(self.identity.get("uid"), self.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)
        self.reap()

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self) -> None:
        """SIGSTOP its process group and wait until the stop is complete (every thread
        stopped), or until it ended."""
        self.signal_group(signal.SIGSTOP)
        while self.exit is None:
            try:
                pid, status, usage = os.wait4(self.pid, os.WUNTRACED)
            except ChildProcessError:
                self.reap(blocking=False)
                return
            except InterruptedError:
                continue
            if os.WIFSTOPPED(status):
                return
            self._ended(status, usage)  # it ended instead

    def unsolicited(self) -> bool:
        """Whether it sent something nobody asked for (drained)."""
        found = False
        while True:
            try:
                data = self.sock.recv(ANSWER_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return found
            except OSError:
                return found
            if not data:
                return found
            found = True


def _spawn(ctl: socket.socket, job: dict[str, Any], identity: dict[str, Any], memfds: list[int], trusted: bool,
           syscall_filter: Any, harness: Any) -> _Child:
    """Fork a child exactly as the zygote forks a run child (isolation._run_child: the same
    setup, limits, uid and syscall filter), running the harness's session loop on
    `job["spec"]`; it receives its memfds over its socket (every other descriptor is closed
    by then). A failure to set it up raises _SetupFailed (an infrastructure failure)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read, write = os.pipe()
    entry = types.SimpleNamespace(main=harness.session_main)
    spec = dict(job["spec"], trusted=trusted)  # the reference makes itself non-dumpable first
    pid = os.fork()
    if pid == 0:
        ctl.close()
        ours.close()
        os.close(read)
        _run_child("run", {**job, "spec": spec}, identity, theirs.fileno(), write, syscall_filter, entry)
    theirs.close()
    os.close(write)
    failure = _read_all(read)
    child = _Child("reference" if trusted else "candidate", pid, ours, identity, float(job["limits"]["wall_seconds"]))
    if failure:
        child.kill(killed=True)
        raise _SetupFailed(failure)
    socket.send_fds(ours, [b"M"], memfds)
    return child


class _SetupFailed(Exception):
    pass


def serve(ctl: socket.socket, message: dict[str, Any], fds: list[int], identity: dict[str, Any],
          syscall_filter: Any = None, harness: Any = None) -> None:
    """One session, from the service's "session" command to its "end" (see the module). The
    candidate runs as the slot's uid; the reference as the zygote's own user where that is
    another one (then the candidate can neither signal nor renice it), else as the slot's,
    non-dumpable."""
    if harness is None:
        from svc_sandbox import harness
    children: dict[str, _Child] = {}
    service_user = {"uid": None, "gid": None}
    try:
        children["candidate"] = _spawn(ctl, message["candidate"], identity, fds[:1], False, syscall_filter, harness)
        if message.get("reference"):
            reference = message["reference"]
            own = service_user if reference.get("drop_privileges") is False else identity
            children["reference"] = _spawn(ctl, reference, own, [fds[1], fds[0]], True, syscall_filter, harness)
    except _SetupFailed as failed:
        for child in children.values():
            child.kill(killed=True)
        for child in children.values():
            _kill_everything(child.pid, child.identity)
        send_packet(ctl, {"setup_error": str(failed)})
        return
    finally:
        for fd in fds:
            os.close(fd)
    send_packet(ctl, {"pids": {name: child.pid for name, child in children.items()}})
    _Session(ctl, children).run()


class _Session:
    def __init__(self, ctl: socket.socket, children: dict[str, _Child]):
        self.ctl = ctl
        self.children = children
        self.killed = False
        self.locked = False  # the candidate can start no process (RLIMIT_NPROC at its task count)

    # -------------------------------------------------------------- the command loop

    def run(self) -> None:
        while True:
            try:
                command, _ = recv_packet(self.ctl)
            except WireError:  # the service is gone: end everything, then this zygote
                self._end(killed=True)
                os._exit(0)
            op = command.get("op")
            if op == "kill":
                self._kill_all()
                continue  # answered by the next command
            if op == "end":
                send_packet(self.ctl, {"exit": self._end(killed=False)})
                return
            if self.killed:
                send_packet(self.ctl, {"killed": True})
                continue
            try:
                if op == "await":
                    reply = self._await(self.children[command["who"]], float(command["seconds"]))
                elif op == "step":
                    reply = self._step(self.children[command["who"]], command)
                elif op == "sweep":
                    candidate = self.children["candidate"]
                    reply = {"strays": self._sweep(), "unsolicited": candidate.alive and candidate.unsolicited()}
                elif op == "guard":
                    reply = {"strays": self._sweep(), "locked": self._lock()}
                else:
                    reply = {"error": f"unknown session command {op!r}"}
            except _Killed:
                reply = {"killed": True}
            send_packet(self.ctl, reply)

    # -------------------------------------------------------------- waiting

    def _wait_answer(self, child: _Child, deadline: float) -> tuple[bytes | None, int]:
        """The child's next answer and the clock when it arrived; (None, clock) when it ended
        or ran past the deadline (then it is killed)."""
        deadline = min(deadline, child.deadline)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                child.kill(timed_out=True)
                return None, time.perf_counter_ns()
            ready, _, _ = select.select([child.sock, child.pidfd, self.ctl], [], [], remaining)
            if child.sock in ready:
                now = time.perf_counter_ns()
                try:
                    data = child.sock.recv(ANSWER_BYTES)
                except OSError:
                    data = b""
                if data:
                    return data, now
                child.reap()  # EOF: it is ending
                return None, now
            if child.pidfd in ready:
                child.reap()
                return None, time.perf_counter_ns()
            if self.ctl in ready:
                self._control()

    def _control(self) -> None:
        """A command arrived while a child runs: only `kill` may come now."""
        try:
            command, _ = recv_packet(self.ctl, timeout=5)
        except WireError:
            self._end(killed=True)
            os._exit(0)
        if command.get("op") == "kill":
            self._kill_all()
            raise _Killed()
        # anything else mid-command is the service's bug; it gets an error when it reads the reply

    def _kill_all(self) -> None:
        self.killed = True
        for child in self.children.values():
            child.kill(killed=True)

    # -------------------------------------------------------------- commands

    def _await(self, child: _Child, seconds: float) -> dict[str, Any]:
        if not child.alive:
            return {"ended": True}
        child.signal_group(signal.SIGCONT)
        data, _ = self._wait_answer(child, time.monotonic() + seconds)
        if data is None:
            return {"ended": True, "timed_out": child.timed_out}
        if data[:1] != READY or len(data) != 1:
            return self._answer(child, data)
        child.stop()
        return {"answer": "R"} if child.alive else {"ended": True}

    def _step(self, child: _Child, command: dict[str, Any]) -> dict[str, Any]:
        if not child.alive:
            return {"ended": True}
        if child.unsolicited():
            return {"protocol": "it sent a message nobody asked for"}
        packet = STEP.pack(str(command["code"]).encode()[:1], int(command.get("first", 0)), int(command.get("count", 0)),
                           int(command.get("seed", 0)) & ((1 << 64) - 1))
        deadline = time.monotonic() + float(command["seconds"])
        cpu = _cpu_ns(child.pid)
        child.signal_group(signal.SIGCONT)
        start = time.perf_counter_ns()
        try:
            child.sock.send(packet)
        except OSError:
            child.reap()
            return {"ended": True}
        data, answered = self._wait_answer(child, deadline)
        if data is None:
            return {"ended": True, "timed_out": child.timed_out}
        child.stop()
        stopped = time.perf_counter_ns()
        reply = self._answer(child, data)
        reply.update(ns=stopped - start, answer_ns=answered - start)
        cpu_after = _cpu_ns(child.pid)
        if cpu is not None and cpu_after is not None:
            reply["cpu_ns"] = cpu_after - cpu
        if not child.alive:
            reply["ended"] = True
        elif command.get("guard") and child.name == "candidate" and not self.locked:
            strays = _strays(child.pid, {c.pid for c in self.children.values()})
            if strays:
                reply["strays"] = len(strays)
        return reply

    @staticmethod
    def _answer(child: _Child, data: bytes) -> dict[str, Any]:
        if len(data) != 1 or data not in ANSWERS:
            return {"protocol": f"it answered {len(data)} bytes that are not an answer"}
        return {"answer": data.decode()}

    def _sweep(self) -> int:
        """Kill every process of the candidate except its harness; how many there were."""
        child = self.children["candidate"]
        if not child.alive:
            return 0
        strays = _strays(child.pid, {c.pid for c in self.children.values()})
        me = os.getpid()
        for pid, parent in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            if parent == me:  # an orphan reparented to this zygote: reap it (never waitpid(-1) here)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        deadline = time.monotonic() + 5  # SIGKILL takes effect asynchronously: until each one is dead
        while time.monotonic() < deadline and _strays(child.pid, {c.pid for c in self.children.values()}):
            time.sleep(0.002)
        return len(strays)

    def _lock(self) -> bool:
        """When the candidate has a uid of its own (then RLIMIT_NPROC counts only its tasks):
        have its harness lower its RLIMIT_NPROC, soft and hard, to the tasks it has now (a
        limit cannot be raised again without privilege; setting another process's limit would
        need CAP_SYS_RESOURCE, which a container's root lacks), then read the limit back from
        /proc, which is the kernel's word, not the candidate's. Whether it is in force."""
        child = self.children["candidate"]
        if not child.alive or child.identity.get("uid") is None:
            return False
        try:
            with open(f"/proc/{child.pid}/status") as status:
                threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
        except (OSError, StopIteration, ValueError):
            return False
        reply = self._step(child, {"code": LIMIT_TASKS.decode(), "count": threads, "seconds": 10})
        if reply.get("answer") != "D" or not child.alive:
            return False
        try:
            with open(f"/proc/{child.pid}/limits") as limits:
                line = next(line for line in limits if line.startswith("Max processes"))
            soft, hard = line.split()[2:4]
        except (OSError, StopIteration, ValueError):
            return False
        self.locked = soft == hard == str(threads)
        return self.locked

    def _end(self, killed: bool) -> dict[str, Any]:
        for child in self.children.values():
            child.kill(killed=killed)  # a stopped child dies of SIGKILL too; an ended one is left as it is
        for child in self.children.values():  # then whatever they left behind, daemons included
            _kill_everything(child.pid, child.identity)
        return {name: child.exit for name, child in self.children.items()}


def _cpu_ns(pid: int) -> int | None:
    """CPU time of a process's whole thread group so far, in ns (its POSIX CPU clock,
    CPUCLOCK_SCHED: the scheduler's own accounting, exited threads included); None when it
    cannot be read."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        return None


def _strays(harness: int, ours: set[int]) -> list[tuple[int, int]]:
    """Processes the candidate started: in its session, its children, or orphans reparented
    to this zygote (a subreaper: a daemon that left the session ends up here). By uid would
    be wider, but a uid is only this sandbox's once uids are allocated per host."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in ours or int(name) == me:
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 1024)
            finally:
                os.close(fd)
            fields = stat[stat.rfind(b")") + 2:].split(None, 5)
            state, ppid, session = fields[0], int(fields[1]), int(fields[3])
        except (OSError, ValueError, IndexError):
            continue
        if state == b"Z":  # already dead (a killed child its parent has not reaped)
            continue
        if session == harness or ppid == harness or ppid == me:
            found.append((int(name), ppid))
    return found


# --------------------------------------------------------------------------------------
# In the service: the link to a session (Zygote.session yields one).


class SessionLink:
    """Commands to a running session and their replies. Not thread-safe, except `kill`
    (through the zygote, from any thread)."""

    GRACE = 60.0  # beyond a command's own limit, which the zygote enforces

    def __init__(self, zygote: Any, pids: dict[str, int]):
        self.zygote = zygote
        self.pids = pids
        self.exits: dict[str, Any] | None = None

    def command(self, message: dict[str, Any], seconds: float = 0.0) -> dict[str, Any]:
        from svc_sandbox.isolation import SandboxUnavailable

        try:
            send_packet(self.zygote.ctl, message)
            reply, _ = recv_packet(self.zygote.ctl, timeout=seconds + self.GRACE)
        except (WireError, OSError, AttributeError) as err:
            self.zygote.close()
            raise SandboxUnavailable(f"sandbox worker {self.zygote.slot} failed in a session: {err}") from None
        return reply

    def await_ready(self, who: str, seconds: float) -> dict[str, Any]:
        return self.command({"op": "await", "who": who, "seconds": seconds}, seconds)

    def step(self, who: str, code: bytes, first: int, count: int, seconds: float, seed: int = 0,
             guard: bool = False) -> dict[str, Any]:
        """Run one command in `who`; with `guard` (timed runs), the reply says "strays" when the
        candidate has a process outside its stopped group (where it could not be prevented)."""
        return self.command({"op": "step", "who": who, "code": code.decode(), "first": first, "count": count,
                             "seed": seed, "seconds": seconds, "guard": guard}, seconds)

    def guard(self) -> dict[str, Any]:
        """Before timing: kill the candidate's other processes and prevent new ones."""
        return self.command({"op": "guard"})

    def sweep(self) -> dict[str, Any]:
        """After timing: {"strays": how many other processes it had, "unsolicited": bool}."""
        return self.command({"op": "sweep"})

    def kill(self) -> None:
        self.zygote.kill()

    def end(self) -> dict[str, Any]:
        """How each process ended (ExitInfo by name); idempotent."""
        from svc_sandbox.isolation import ExitInfo

        if self.exits is None:
            reply = self.command({"op": "end"})
            self.exits = {name: ExitInfo(**info) for name, info in (reply.get("exit") or {}).items()}
        return self.exits
