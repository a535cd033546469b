"""The trust boundary: what the service believes about a candidate, and why.

The candidate's process is the attacker's: every byte of its memory, every thread in it,
everything it writes to any file descriptor. So the service believes nothing it says. What a
verdict rests on is each of these, and nothing else:

- Outputs the service reads itself. Every input and output of every call lives in a memfd
  the service created and sealed at its size (shm.py); the service writes the inputs, fills
  the outputs with the NaN sentinel before each run, and after the run reads the outputs and
  compares them with its own expected values, a chunk at a time. A candidate's only channel
  to the service is one byte per command ("done", or which kind of failure), through the
  zygote; any other byte breaks the protocol and fails it.
- Inputs it has never seen. A correctness trial's inputs come from the request's seed (so a
  verdict can be reproduced). A timed call's inputs are new for every call of every run: a
  built-in task's come from a pool drawn from seeds only this process knows, each float's
  mantissa XOR-ed with a fresh random key (references.scramble_into); a KernelBench
  problem's come from its own get_inputs() with fresh random seeds, run by the reference
  process. A fingerprint cache never hits, and no output of an earlier call helps with the
  next one.
- Outputs of the timed runs, checked: every timed call writes outputs; after each run the
  service checks a random subset of them, chosen after the run (so the candidate cannot
  know which): a candidate that fakes a share q of its calls survives R runs with
  probability (1 - q) ** (checked * R), and gains at most q of its time. The checked calls'
  inputs are compared with a pristine copy the candidate cannot map: a changed input fails
  (and the reference runs on a copy of its own, so changing inputs cannot slow it).
- A clock outside its address space: the zygote (timer.py), a single-threaded process with
  no candidate code that the candidate's uid cannot signal or trace, continues the
  candidate's process group, sends the command, waits for the answer and stops the group
  again, timing from the command to the *completed* stop: the wall clock, and the CPU time
  the kernel accounted to the candidate's whole thread group (exited threads included). With
  one thread per candidate on a CPU the figure is the CPU time, which a busy machine does not
  inflate (waiting for a core is not counted); on a GPU, or with several threads, the wall
  clock. While anything else happens (the reference's run, the service writing or reading
  buffers) the candidate is stopped: its threads cannot slow the reference, compute ahead,
  or write after "done"; a process it started would not be stopped with it, so it can start
  none while timed (RLIMIT_NPROC) or is found and failed.
- A reference timed in the same session: a process with no candidate code (the task's own
  reference) runs on the same inputs, interleaved run by run with the candidate, so both
  see the same machine; the speedup is the Hodges-Lehmann estimate of the ratios of blocks
  of pairs (one of each order, so which side runs first cancels), with its signed-rank
  interval (timing.py), repeated until the interval is narrow or the budget is spent, else
  TIMING_UNRELIABLE.
- Sizes it cannot choose: every buffer's size comes from the task's signature (KernelBench:
  from the problem's own Model, probed in a process of its own).

Residual windows (docs/ARCHITECTURE.md, "Sandbox", says why they are negligible or how they
are closed): kernel work started before the stop (asynchronous I/O; on a GPU, work queued
on the device), and the scheduler's latency between "done" and the stop, which is inside
the timed figure.

`Measurement` runs one candidate's session through these steps and fills its verdict.
Where the inputs and the expected outputs come from is a `Source` (built-in tasks: the
service's oracle; KernelBench: the problem's Model in the reference process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from leap import tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import checking, shm, timing, verdicts
from svc_sandbox.harness import FETCH, GENERATE, GO, STAGE
from svc_sandbox.isolation import ExitInfo, JobCancelled, Limits
from svc_sandbox.references import ReferenceStore, TrialData, fresh_integers, mantissa_key, scramble_rows
from svc_sandbox.timer import SessionLink

Stage = common_pb2.Stage
Flag = sandbox_pb2.VerdictFlag
CANDIDATE, REFERENCE = "candidate", "reference"


class _Stop(Exception):
    """The verdict is decided (a failure); stop measuring."""


@dataclasses.dataclass(frozen=True)
class Options:
    """How one session measures (resolved from the request and the service's settings)."""

    trials: int
    timing: bool
    min_pairs: int  # timed runs of each, at least
    warmup_runs: int
    run_timeout: float  # every command (a trial, a timed run) has its own
    load_timeout: float  # the candidate loading its code (a KernelBench module building)
    sentinel: bool
    input_mutation: bool
    fresh_inputs: bool
    alternate: bool
    speedup_bound: float | None  # SUSPICIOUS_SPEEDUP above it; None when the check is off
    atol: float
    rtol: float
    run_seconds: float  # a timed run lasts about this long (calls_per_run)
    max_pairs: int
    budget_seconds: float  # of the timed runs beyond min_pairs (which always run)
    interval_width: float  # the interval's relative width to reach (then no more pairs)
    unreliable_width: float  # wider than this at the end: TIMING_UNRELIABLE
    verify_per_run: int  # timed calls checked in each run
    staged: bool  # cuda: STAGE and FETCH around GO
    max_log_bytes: int
    reference_timeout: float = 0.0  # the reference process loading (0: load_timeout)
    clock: str = "wall"  # "cpu": each process's CPU time (one thread each, on a CPU); "wall": the zygote's clock
    charge_copies: bool = True  # staged: copies slower than the reference's count (off with DEVICE_SYNC off)


class Source:
    """Where a session's inputs and expected outputs come from."""

    expected_in_reference = False  # expected outputs are views of the reference's region
    paces: ReferenceStore | None = None  # where the task's pace is kept (timing.paced_calls)
    pace_key: Hashable = None  # the task and its sizes

    def trial(self, m: Measurement, t: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Write trial t's inputs into slot 0 of the candidate's region; return (pristine
        inputs, expected outputs) as flat arrays."""
        raise NotImplementedError

    def fresh(self, m: Measurement, count: int) -> None:
        """New inputs for slots [0, count): written into both regions, here or by `prepare`."""
        raise NotImplementedError

    def prepare(self, m: Measurement, who: str, count: int) -> None:
        """Right before `who` runs slots [0, count) of a timed pair (both sides alike, so both
        find their inputs as freshly written, as warm in the caches)."""

    def expected(self, m: Measurement, slot: int) -> list[np.ndarray]:
        """Expected outputs of slot `slot` (after the reference has run on it, where it must)."""
        raise NotImplementedError

    def pristine(self, m: Measurement, slot: int) -> list[np.ndarray]:
        """The inputs of a timed slot as they were written (the reference's copy)."""
        assert m.reference is not None
        return [m.reference.raw(slot, i) for i in range(len(m.layout.inputs))]


class BuiltinSource(Source):
    """A built-in task: the service makes every input and keeps the float64 oracle."""

    def __init__(self, store: ReferenceStore, spec: tasks.TaskSpec, size: str, sizes: dict[str, int], seed: int):
        self.store, self.spec, self.size, self.sizes, self.seed = store, spec, size, sizes, seed
        self.paces, self.pace_key = store, ("builtin", spec.task.id, size, tuple(sorted(sizes.items())))
        self._trial0: TrialData | None = None
        self._rng = np.random.default_rng(secrets.randbits(64))
        self._keys_used: set[tuple[int, int]] = set()

    def _data(self, m: Measurement, t: int) -> TrialData:
        data = self.store.trial(self.spec, self.size, self.sizes, self.seed, t if m.options.fresh_inputs else 0)
        if t == 0:
            self._trial0 = data
        return data

    def trial(self, m: Measurement, t: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        data = self._data(m, t)
        for index, tensor in enumerate(m.layout.inputs):
            m.candidate.write(0, index, data.inputs[tensor.name])
        inputs = [data.inputs[t_.name].reshape(-1).view(np.uint8) for t_ in m.layout.inputs]
        return inputs, [data.expected[t_.name].reshape(-1) for t_ in m.layout.outputs]

    def fresh(self, m: Measurement, count: int) -> None:
        """Draw each slot's inputs: a pool set and a key per tensor (integers drawn afresh);
        `prepare` writes them into each side's region right before it runs. The slots are in
        the order of their pool sets, so `scramble_rows` writes each set's slots in one
        operation (a candidate learns nothing from it: the keys differ slot by slot, and which
        slots share a set it could tell from their bits anyway)."""
        self._batch: list[list[tuple[np.ndarray, int]]] = []
        if not m.options.fresh_inputs:  # the check is off: every timed call gets trial 0's inputs
            data = self._trial0 or self._data(m, 0)
            self._batch = [[(data.inputs[t.name], 0) for t in m.layout.inputs]] * count
            return
        pool = self.store.pool(self.spec, self.size, self.sizes)
        integers = [t.name for t in m.layout.inputs if np.dtype(t.dtype).kind != "f"]
        draws = []
        for _ in range(count):
            while True:  # a (pool set, key) pair used once per session
                choice = int(self._rng.integers(len(pool)))
                key = mantissa_key(np.dtype(np.float32), self._rng)
                if (choice, key) not in self._keys_used:
                    self._keys_used.add((choice, key))
                    break
            draws.append((choice, key))
        draws.sort(key=lambda draw: draw[0])
        for choice, key in draws:
            drawn = fresh_integers(self.spec, self.sizes, integers, self._rng) if integers else {}
            row = []
            for tensor in m.layout.inputs:
                dtype = np.dtype(tensor.dtype)
                own_key = key if dtype.itemsize == 4 else mantissa_key(dtype, self._rng) if dtype.kind == "f" else 0
                row.append((drawn.get(tensor.name, pool[choice][tensor.name]), own_key if dtype.kind == "f" else 0))
            self._batch.append(row)

    def prepare(self, m: Measurement, who: str, count: int) -> None:
        region = m.candidate if who == CANDIDATE else m.reference
        assert region is not None
        batch = self._batch[:count]
        for index in range(len(m.layout.inputs)):
            scramble_rows([row[index][0] for row in batch], region.rows(index, len(batch)),
                          [row[index][1] for row in batch])

    def expected(self, m: Measurement, slot: int) -> list[np.ndarray]:
        assert m.reference is not None
        inputs = {t.name: m.reference.view(slot, i).reshape(t.shape) for i, t in enumerate(m.layout.inputs)}
        oracle = self.spec.expected(inputs, self.sizes)
        return [oracle[t.name].reshape(-1) for t in m.layout.outputs]


class ReferenceSource(Source):
    """A KernelBench problem: the reference process makes the inputs (get_inputs() with the
    service's seeds) and computes the expected outputs with the problem's own Model."""

    expected_in_reference = True

    def __init__(self, trial_seeds: Sequence[int], paces: ReferenceStore | None = None, pace_key: Hashable = None):
        self.trial_seeds = list(trial_seeds)
        self.paces, self.pace_key = paces, pace_key

    def trial(self, m: Measurement, t: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        m.step(REFERENCE, GENERATE, 0, 1, seed=self.trial_seeds[t])
        m.run(REFERENCE, 0, 1)
        assert m.reference is not None
        return self.pristine(m, 0), self.expected(m, 0)

    def fresh(self, m: Measurement, count: int) -> None:
        seed = secrets.randbits(62) if m.options.fresh_inputs else self.trial_seeds[0]
        if m.options.fresh_inputs:
            m.step(REFERENCE, GENERATE, 0, count, seed=seed)
        else:  # every timed call gets trial 0's inputs
            for slot in range(count):
                m.step(REFERENCE, GENERATE, slot, 1, seed=seed)

    def expected(self, m: Measurement, slot: int) -> list[np.ndarray]:
        assert m.reference is not None
        first = len(m.layout.inputs)
        return [m.reference.view(slot, first + i) for i in range(len(m.layout.outputs))]


@dataclasses.dataclass
class Pair:
    reference_seconds: float  # per call
    candidate_seconds: float
    copies_candidate: float = 0.0  # cuda: STAGE + FETCH seconds (per run)
    copies_reference: float = 0.0


class Measurement:
    """One candidate's session: readiness, correctness trials, interleaved timed runs."""

    def __init__(self, link: SessionLink, candidate: shm.Region, reference: shm.Region | None, source: Source,
                 options: Options, verdict: sandbox_pb2.Verdict, logs: dict[str, Path], limits: Limits,
                 sampling: Callable[[], Any] | None = None):
        self.link = link
        self.candidate = candidate
        self.reference = reference
        self.layout = candidate.layout
        self.source = source
        self.options = options
        self.verdict = verdict
        self.logs = logs
        self.limits = limits
        self.sampling = sampling
        self.load_seconds = 0.0  # the candidate loading its code (a KernelBench module: its build)
        self.timing = False  # in the timed runs (the candidate may have no other process)
        self.floor = 0.0  # what an empty run costs (the reference's), taken off every run
        self.trial_seconds = 0.0  # the candidate's slowest correctness trial (one call)
        self._random = secrets.SystemRandom()

    # ------------------------------------------------------------------ commands

    def step(self, who: str, code: bytes, first: int, count: int, seed: int = 0) -> float:
        """One command; its seconds. A failure fills the verdict and raises _Stop."""
        reply = self.link.step(who, code, first, count, self.options.run_timeout, seed, guard=self.timing)
        if reply.get("strays"):
            self._started_processes(reply["strays"])
            raise _Stop()
        if reply.get("answer") == "D" and not reply.get("ended"):
            if self.options.clock == "cpu" and "cpu_ns" in reply:
                return reply["cpu_ns"] / 1e9
            return reply["ns"] / 1e9
        self._failed(who, reply, self.options.run_timeout)
        raise _Stop()

    def run(self, who: str, first: int, count: int) -> tuple[float, float]:
        """GO on slots [first, first + count) (with STAGE and FETCH around it on cuda):
        (seconds of GO, seconds of the copies)."""
        copies = self.step(who, STAGE, first, count) if self.options.staged else 0.0
        seconds = max(self.step(who, GO, first, count) - self.floor, 1e-9)
        if self.options.staged:
            copies += self.step(who, FETCH, first, count)
        return seconds, copies

    def _failed(self, who: str, reply: dict[str, Any], seconds: float) -> None:
        if reply.get("killed"):
            raise JobCancelled("the session was cancelled")  # its caller went away: no verdict
        verdict, log = self.verdict, verdicts.read_log(self.logs[who])
        if who == REFERENCE:
            what = "the reference failed"
            if reply.get("ended"):
                exit = self.link.end().get(REFERENCE, ExitInfo())
                what += f" ({'timed out' if exit.timed_out else exit.describe()})"
            verdict.stage = Stage.STAGE_RUN
            verdict.message = f"runtime error: {what}: {verdicts.last_line(log)}"[:500]
            verdict.runtime_error = verdicts.trim(verdict, log, self.options.max_log_bytes)
            return
        if "protocol" in reply:
            verdict.stage = Stage.STAGE_RUN
            verdict.message = f"runtime error: the kernel broke the harness's protocol ({reply['protocol']})"
            verdict.runtime_error = verdict.message
            return
        answer = reply.get("answer")
        if answer == "E":
            verdicts.runtime_error(verdict, log, self.options.max_log_bytes)
        elif answer == "S":
            verdicts.wrong(verdict, sandbox_pb2.Mismatch(output="outputs", trial=verdict.trials_run, reason="shape"),
                           timed=False)
            verdict.message = "wrong: " + verdicts.sandbox_line(log)
        elif answer in ("L", "C"):
            verdict.stage = Stage.STAGE_COMPILE
            verdict.message = "compile error: " + verdicts.last_line(log)
        else:  # it ended (crashed, exited, hit a limit) or ran past its command's limit
            exit = self.link.end().get(CANDIDATE, ExitInfo())
            verdicts.runtime_failure(verdict, exit, log, self.limits, self.options.max_log_bytes,
                                     seconds if exit.timed_out else None)

    # ------------------------------------------------------------------ the session

    def measure(self) -> None:
        """Run the session and fill the verdict (stage PASSED, or where it failed)."""
        try:
            self._ready()
            if not self._correctness():
                return
            if self.options.timing:
                self._timing()
            else:
                self.verdict.stage = Stage.STAGE_PASSED
                self.verdict.message = "passed"
        except _Stop:
            return

    def _ready(self) -> None:
        for who, seconds in ((CANDIDATE, self.options.load_timeout),
                             (REFERENCE, self.options.reference_timeout or self.options.load_timeout)):
            if who == REFERENCE and self.reference is None:
                continue
            started = time.monotonic()
            reply = self.link.await_ready(who, seconds)
            if who == CANDIDATE:
                self.load_seconds = time.monotonic() - started
            if reply.get("answer") != "R":
                self._failed(who, reply, seconds)
                raise _Stop()

    def _correctness(self) -> bool:
        verdict = self.verdict
        for t in range(self.options.trials):
            verdict.trials_run = t + 1
            inputs, expected = self.source.trial(self, t)
            if self.options.sentinel or t == 0:  # without the sentinel, later trials see the previous outputs
                self.candidate.fill([0], self._outputs(), checking.SENTINEL_BYTE if self.options.sentinel else 0)
            self.trial_seconds = max(self.trial_seconds, self.run(CANDIDATE, 0, 1)[0])
            if not self._judge(0, t, inputs, expected, timed=False):
                return False
            verdict.trials_passed = t + 1
        return True

    def _outputs(self) -> range:
        return range(len(self.layout.inputs), len(self.layout.tensors))

    def _judge(self, slot: int, trial: int, inputs: Sequence[np.ndarray] | None, expected: Sequence[np.ndarray],
               timed: bool) -> bool:
        """Inputs unchanged (unless `inputs` is None: compared already) and outputs within
        tolerance in `slot`; else the verdict says why."""
        if self.options.input_mutation and inputs is not None and \
                not self._inputs_intact(slot, trial, inputs, timed, self.source.expected_in_reference):
            return False
        first = len(self.layout.inputs)
        for number, (tensor, want) in enumerate(zip(self.layout.outputs, expected)):
            index = first + number
            got = self.candidate.view(slot, index)
            convert = shm.bfloat16_to_float32 if tensor.dtype == shm.BFLOAT16 else None
            mismatch = checking.compare(
                tensor.name, trial, got, want.reshape(-1), self.options.atol, self.options.rtol,
                sentinel=self.options.sentinel, convert=convert,
                release=self._releaser(slot, index, tensor.itemsize))
            if mismatch is not None:
                verdicts.wrong(self.verdict, mismatch, timed)
                return False
        return True

    def _releaser(self, slot: int, index: int, itemsize: int) -> Callable[[int, int], None]:
        """Drops the compared chunk's pages from the service's mappings (the candidate's
        output, and the expected output where it is a view of the reference's region)."""
        reference = self.reference if self.source.expected_in_reference else None

        def release(start: int, end: int) -> None:
            self.candidate.release(slot, index, start * itemsize, end * itemsize)
            if reference is not None:
                reference.release(slot, index, start * itemsize, end * itemsize)

        return release

    def _inputs_intact(self, slot: int, trial: int, inputs: Sequence[np.ndarray], timed: bool,
                       in_reference: bool) -> bool:
        """Every input of `slot` byte for byte as `inputs` (a view of the reference's region
        when `in_reference`: its pages are dropped as they are compared, like the candidate's)."""
        reference = self.reference if in_reference else None
        for index, (tensor, pristine) in enumerate(zip(self.layout.inputs, inputs)):
            def release(start: int, end: int, index: int = index) -> None:
                self.candidate.release(slot, index, start, end)
                if reference is not None:
                    reference.release(slot, index, start, end)

            if not checking.same_bytes(self.candidate.raw(slot, index), pristine.reshape(-1).view(np.uint8),
                                       release=release):
                verdicts.wrong(self.verdict, sandbox_pb2.Mismatch(output=tensor.name, trial=trial, reason="input mutated"),
                               timed)
                return False
        return True

    # ------------------------------------------------------------------ timing

    def _timing(self) -> None:
        verdict = self.verdict
        self.link.guard()  # whatever it started while being checked is gone before it is timed
        self.timing = True
        pairs: list[Pair] = []
        for attempt in range(2):
            with self._sampled() as samples:
                pairs = self._pairs()
            reasons = checking.throttled(samples)
            if samples:
                del verdict.telemetry[:]
                verdict.telemetry.extend(samples)
            if reasons and attempt == 0:
                verdicts.add_flag(verdict, Flag.VERDICT_FLAG_RETIMED)
                continue
            if reasons:
                verdicts.add_flag(verdict, Flag.VERDICT_FLAG_TIMING_UNRELIABLE)
            break
        swept = self.link.sweep()
        if swept.get("strays"):
            self._started_processes(swept["strays"])
            return
        if swept.get("unsolicited"):
            self._failed(CANDIDATE, {"protocol": "it sent a message nobody asked for"}, 0.0)
            return
        self._conclude(pairs)

    def _started_processes(self, count: int) -> None:
        verdict = self.verdict
        verdict.stage = Stage.STAGE_RUN
        verdict.message = f"runtime error: the kernel started {count} processes while it was timed"
        verdict.runtime_error = verdict.message + " (a kernel must not start processes)"

    @contextlib.contextmanager
    def _sampled(self) -> Iterator[list]:
        if self.sampling is None:
            yield []
            return
        with self.sampling() as samples:
            yield samples

    def _pairs(self) -> list[Pair]:
        options = self.options
        # A run's fixed cost (continue, command, answer, stop; on a GPU the synchronize) is
        # measured on the trusted reference with no calls and taken off both sides' runs, so it
        # does not pull every ratio towards 1 (on a device a call can be shorter than it). The
        # candidate's own empty runs are not used: it could make them slow and so look faster.
        empty = sorted(self.step(REFERENCE, GO, 0, 0) for _ in range(5))
        self.floor = empty[len(empty) // 2]
        source, key = self.source, (self.source.pace_key, options.clock)
        pace = source.paces.pace(key) if source.paces is not None and source.pace_key is not None else None
        longest = options.run_timeout / 4  # the slower side's run keeps well inside its own time limit
        if pace is None:
            # The task's first timed evaluation in this service: runs of 1, 4, 16, ... calls
            # (checked like any run, untimed for the verdict) until, at 4 calls or more, the
            # reference's lasts half the target, or the slots run out, or the candidate's
            # would pass its bound; the reference's seconds a call there are the task's pace.
            calls, number = 1, 0
            while True:
                pair = self._pair(number, calls)
                number += 1
                grown = min(self.layout.slots, calls * 4)
                if ((calls >= 4 and calls * pair.reference_seconds >= options.run_seconds / 2) or grown == calls
                        or grown * pair.candidate_seconds > longest):
                    break
                calls = grown
            # a run's first calls are cold: the faster of two runs of the last size is the pace
            pace = min(pair.reference_seconds, self._pair(number, calls).reference_seconds)
            if source.paces is not None and source.pace_key is not None:
                source.paces.record_pace(key, pace)
                pace = source.paces.pace(key) or pace  # another evaluation may have recorded it first
        # Every evaluation of a task runs the same calls (timing.paced_calls): the candidate's
        # correctness trials bound its first run, its warm-ups the others. The warm-ups run at
        # that count, so every slot a timed run uses has been touched (an untouched slot costs
        # each process its first-touch page faults: the first pair's candidate 28 us against 16).
        calls = timing.paced_calls(pace, options.run_seconds, self.layout.slots, self.trial_seconds, longest)
        for warmup in range(options.warmup_runs):
            pair = self._pair(warmup, calls)
            calls = min(calls, timing.paced_calls(pace, options.run_seconds, self.layout.slots,
                                                  pair.candidate_seconds, longest))
        self.verdict.calls_per_run = calls
        pairs: list[Pair] = []
        started = time.monotonic()
        while True:
            pairs.append(self._pair(len(pairs), calls))
            low, high, center = self._interval(pairs)
            width = timing.relative_width(low, high, center)
            if timing.should_stop(len(pairs), width, min_pairs=options.min_pairs, max_pairs=options.max_pairs,
                                  target_width=options.interval_width, elapsed=time.monotonic() - started,
                                  budget_seconds=options.budget_seconds, block=timing.block_size(options.alternate)):
                return pairs

    def _pair(self, number: int, calls: int) -> Pair:
        """One timed run of each on `calls` fresh input sets; checked. Right before each
        side's run its inputs are written and its outputs filled, the same way for both, so
        neither finds its buffers warmer in the caches."""
        self.source.fresh(self, calls)
        seconds: dict[str, tuple[float, float]] = {}
        for who in timing.order(number, self.options.alternate):
            self.source.prepare(self, who, calls)
            region = self.candidate if who == CANDIDATE else self.reference
            assert region is not None
            if self.options.sentinel or who == REFERENCE:
                region.fill(range(calls), self._outputs(), checking.SENTINEL_BYTE)
            seconds[who] = self.run(who, 0, calls)
        self._verify(calls)
        (ref, ref_copies), (cand, cand_copies) = seconds[REFERENCE], seconds[CANDIDATE]
        return Pair(ref / calls, cand / calls, cand_copies, ref_copies)

    def _verify(self, calls: int) -> None:
        """The inputs and outputs of a random subset of the run's calls, chosen now. (The
        reference has inputs of its own, so a candidate changing its inputs cannot slow it:
        a changed input is a correctness failure, checked where the outputs are.)"""
        trial = self.options.trials  # Mismatch.trial of the timed runs
        for slot in sorted(self._random.sample(range(calls), min(calls, self.options.verify_per_run))):
            if self.options.input_mutation and not self._inputs_intact(
                    slot, trial, self.source.pristine(self, slot), timed=True, in_reference=True):
                raise _Stop()
            if not self._judge(slot, trial, None, self.source.expected(self, slot), timed=True):
                raise _Stop()

    def _interval(self, pairs: Sequence[Pair]) -> tuple[float, float, float]:
        center, low, high = timing.speedup_interval([p.reference_seconds for p in pairs],
                                                    [self._charged(p) for p in pairs], self.options.alternate)
        return low, high, center

    def _charged(self, pair: Pair) -> float:
        """The candidate's time per call. On cuda, copies that took longer than the
        reference's identical ones are charged to it: work moved out of GO into STAGE or
        FETCH is counted."""
        if not (self.options.staged and self.options.charge_copies):
            return pair.candidate_seconds
        return pair.candidate_seconds + max(0.0, pair.copies_candidate - pair.copies_reference) / max(1,
                                                                                                     self.verdict.calls_per_run)

    def _conclude(self, pairs: Sequence[Pair]) -> None:
        verdict, options = self.verdict, self.options
        verdict.candidate_timing.CopyFrom(checking.timing_stats([self._charged(p) for p in pairs]))
        verdict.reference_timing.CopyFrom(checking.timing_stats([p.reference_seconds for p in pairs]))
        low, high, center = self._interval(pairs)
        verdict.speedup, verdict.speedup_low, verdict.speedup_high = center, low, high
        verdict.timing_clock = options.clock
        verdict.stage = Stage.STAGE_PASSED
        if timing.relative_width(low, high, center) > options.unreliable_width:
            verdicts.add_flag(verdict, Flag.VERDICT_FLAG_TIMING_UNRELIABLE)
        if options.speedup_bound is not None and center > options.speedup_bound:
            verdicts.add_flag(verdict, Flag.VERDICT_FLAG_SUSPICIOUS_SPEEDUP)
        verdict.message = (f"passed: {center:.2f}x the reference ({low:.2f}-{high:.2f})" if center else "passed")
