"""The worker pool: N threads, each with its own zygote (worker slot), behind a bounded
queue. Admission is all-or-nothing per request: a batch that does not fit is refused whole
with RESOURCE_EXHAUSTED and a retry hint (the expected time for the backlog to drain).

Threads suffice: a worker mostly waits on its compiler or its candidate process; the CPU
work happens in those processes, so N workers keep N cores busy.

Cancellation: cancelling the future `submit` returned (the gRPC call was cancelled or its
deadline passed) drops a queued job, and kills a running one at once (its zygote kills the
process; the job's later calls raise JobCancelled). `shutdown` does both to everything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from leap.runtime import resource_exhausted
from svc_sandbox.isolation import JobCancelled, Zygote

T = TypeVar("T")


class _Ticket:
    """One submitted job: where it runs, and whether its caller gave up on it."""

    __slots__ = ("zygote", "cancelled")

    def __init__(self) -> None:
        self.zygote: Zygote | None = None
        self.cancelled = False


class WorkerPool:
    def __init__(self, zygotes: list[Zygote], max_queue: int):
        self.zygotes = zygotes
        self.workers = len(zygotes)
        self.max_queue = max_queue
        self._free: queue.SimpleQueue[Zygote] = queue.SimpleQueue()
        for zygote in zygotes:
            self._free.put(zygote)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="sandbox-worker")
        self._lock = threading.Lock()
        self._tickets: set[_Ticket] = set()
        self._closing = False
        self.pending = 0  # admitted, not finished (queued or running)
        self.completed = 0
        self.cancelled = 0  # jobs killed or dropped because their caller went away
        self._mean_seconds = 0.5  # running estimate of one evaluation, for retry hints

    @property
    def capacity(self) -> int:
        return self.workers + self.max_queue

    def admit(self, count: int) -> None:
        """Reserve room for `count` evaluations, or raise RESOURCE_EXHAUSTED with a retry hint."""
        with self._lock:
            if self.pending + count > self.capacity:
                backlog = self.pending + count - self.capacity
                wait = max(0.1, backlog * self._mean_seconds / self.workers)
                raise resource_exhausted(
                    f"the sandbox queue is full ({self.pending} evaluations pending, room for {self.capacity}); "
                    f"retry in {wait:.1f} s", wait)
            self.pending += count

    def release(self, count: int = 1) -> None:
        with self._lock:
            self.pending -= count

    def _work(self, job: Callable[[Zygote], T], ticket: _Ticket) -> T:
        zygote = None
        started = time.monotonic()
        try:
            if ticket.cancelled or self._closing:
                raise JobCancelled("cancelled before it started")
            zygote = self._free.get()
            with self._lock:
                if ticket.cancelled or self._closing:
                    raise JobCancelled("cancelled before it started")
                ticket.zygote = zygote
                zygote.begin_job()
            return job(zygote)
        finally:
            with self._lock:
                ticket.zygote = None
                self._tickets.discard(ticket)
                self.pending -= 1
                if ticket.cancelled:
                    self.cancelled += 1
                else:
                    self.completed += 1
                    took = time.monotonic() - started
                    self._mean_seconds += 0.1 * (took - self._mean_seconds)
            if zygote is not None:
                self._free.put(zygote)

    def _cancel(self, ticket: _Ticket) -> None:
        with self._lock:
            ticket.cancelled = True
            if ticket.zygote is not None:
                ticket.zygote.cancel()

    def submit(self, job: Callable[[Zygote], T]) -> asyncio.Future[T]:
        """Run an admitted job on a free worker; the admission is released when it ends (or
        when it is cancelled before starting). Cancelling the returned future cancels the job."""
        ticket = _Ticket()
        with self._lock:
            self._tickets.add(ticket)
        try:
            future = self._executor.submit(self._work, job, ticket)
        except RuntimeError:  # the executor is shut down: the service is stopping
            with self._lock:
                self._tickets.discard(ticket)
                self.pending -= 1
            raise JobCancelled("the sandbox is stopping") from None
        wrapped = asyncio.wrap_future(future)

        def on_done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                if future.cancelled():  # never started: _work did not run, so nothing released it
                    with self._lock:
                        self._tickets.discard(ticket)
                        self.pending -= 1
                        self.cancelled += 1
                else:
                    self._cancel(ticket)

        wrapped.add_done_callback(on_done)
        return wrapped

    def run_on_each(self, job: Callable[[Zygote], None]) -> None:
        """Run `job` once on every zygote (start-up work), from the calling thread."""
        for zygote in self.zygotes:
            job(zygote)

    def shutdown(self, patience: float = 10.0) -> None:
        """Drop every queued job, kill every running one, stop the zygotes. Returns within
        about `patience` seconds whatever the jobs were doing."""
        with self._lock:
            self._closing = True
            tickets = list(self._tickets)
        for ticket in tickets:
            self._cancel(ticket)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for zygote in self.zygotes:
            zygote.close(final=True)  # wakes a worker blocked on its zygote; a cancelled job never restarts it
        deadline = time.monotonic() + patience
        for thread in list(getattr(self._executor, "_threads", ())):
            thread.join(max(0.0, deadline - time.monotonic()))
