"""Filling a Verdict from what happened: how a process ended, what a harness reported, a
mismatch. Pure functions over the verdict message (no processes, no I/O beyond reading a
log file)."""

from __future__ import annotations

from pathlib import Path

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import checking
from svc_sandbox.isolation import ExitInfo, Limits, classify, read_job_file

Stage = common_pb2.Stage
Flag = sandbox_pb2.VerdictFlag
CRASH_HINT = " (an out-of-bounds access hits the guard page after each buffer)"
MEMORY_MARKERS = ("out of memory", "MemoryError", "DefaultCPUAllocator", "std::bad_alloc", "Cannot allocate memory")


def read_log(path: Path, limit: int = 1 << 20) -> str:
    """A job's log, never following a link the candidate left in its place."""
    return read_job_file(path, limit)


def trim(verdict: sandbox_pb2.Verdict, text: str, limit: int) -> str:
    """`text` within `limit` bytes (its head), flagging LOG_TRUNCATED when cut."""
    text, cut = checking.trim_log(text, limit)
    if cut and Flag.VERDICT_FLAG_LOG_TRUNCATED not in verdict.flags:
        verdict.flags.append(Flag.VERDICT_FLAG_LOG_TRUNCATED)
    return text


def add_flag(verdict: sandbox_pb2.Verdict, flag: int) -> None:
    if flag not in verdict.flags:
        verdict.flags.append(flag)


def first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["the compiler failed"])[0][:300]


def last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1]


def sandbox_line(log: str) -> str:
    """The harness's own last message in a log ("sandbox: ..."), else the log's last line."""
    found = [line for line in log.splitlines() if line.startswith("sandbox: ")]
    return found[-1].removeprefix("sandbox: ") if found else last_line(log)


def mismatch_message(m: sandbox_pb2.Mismatch) -> str:
    if m.reason == "output not written":
        return f"wrong: {m.bad_elements} of {m.total_elements} elements of {m.output} were never written"
    if m.reason == "shape":
        return f"wrong: {m.output} has the wrong shape"
    if m.reason == "input mutated":
        return f"wrong: the kernel modified its input {m.output}"
    return (f"wrong: {m.output}[{m.first_bad_index}] is {m.got:.6g}, expected {m.expected:.6g} "
            f"({m.bad_elements} of {m.total_elements} outside tolerance)")


def wrong(verdict: sandbox_pb2.Verdict, mismatch: sandbox_pb2.Mismatch, timed: bool) -> None:
    """A CORRECT-stage failure."""
    verdict.stage = Stage.STAGE_CORRECT
    verdict.mismatch.CopyFrom(mismatch)
    if mismatch.reason == "output not written":
        add_flag(verdict, Flag.VERDICT_FLAG_OUTPUT_NOT_WRITTEN)
    if mismatch.reason == "input mutated":
        add_flag(verdict, Flag.VERDICT_FLAG_INPUT_MUTATED)
    message = mismatch_message(mismatch)
    verdict.message = ("wrong during timing: " + message.removeprefix("wrong: ")) if timed else message


def runtime_error(verdict: sandbox_pb2.Verdict, message: str, limit: int) -> None:
    """The harness reported a failure while running (an exception, a CUDA error)."""
    verdict.stage = Stage.STAGE_RUN
    verdict.runtime_error = trim(verdict, message, limit)
    verdict.message = "runtime error: " + last_line(message)
    if any(marker in message for marker in MEMORY_MARKERS):
        add_flag(verdict, Flag.VERDICT_FLAG_MEMORY_LIMIT)


def runtime_failure(verdict: sandbox_pb2.Verdict, exit: ExitInfo, log: str, limits: Limits, limit: int,
                    timed_out_after: float | None = None, stage: int = Stage.STAGE_RUN) -> None:
    """How a process that ended (or was killed at a deadline) ends the verdict."""
    exit.log = log
    description, flags = classify(exit, limits)
    if timed_out_after is not None:
        description = f"timed out after {timed_out_after:g} s and was killed"
        flags.add("TIMEOUT")
    for name in sorted(flags):
        add_flag(verdict, getattr(Flag, f"VERDICT_FLAG_{name}"))
    text = description + (CRASH_HINT if "CRASHED" in flags and "SIGSEGV" in description else "")
    if "MEMORY_LIMIT" in flags and limits.memory_bytes:
        text += f" (out of memory: the limit is {limits.memory_bytes >> 20} MiB beyond its inputs)"
    tail = log.strip()
    verdict.runtime_error = trim(verdict, text + ("\n" + tail if tail else ""), limit)
    verdict.stage = stage
    verdict.message = ("compile error: " if stage == Stage.STAGE_COMPILE else "runtime error: ") + text
