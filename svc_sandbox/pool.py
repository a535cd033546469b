"""The worker pool: N threads, each with its own zygote (worker slot), behind a bounded
queue. Admission is all-or-nothing per request: a batch that does not fit is refused whole
with RESOURCE_EXHAUSTED and a retry hint (the expected time for the backlog to drain).

Threads suffice: a worker mostly waits on its compiler or its candidate process; the CPU
work happens in those processes, so N workers keep N cores busy.
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
from svc_sandbox.isolation import Zygote

T = TypeVar("T")


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
        self.pending = 0  # admitted, not finished (queued or running)
        self.completed = 0
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

    def _work(self, job: Callable[[Zygote], T]) -> T:
        zygote = self._free.get()
        started = time.monotonic()
        try:
            return job(zygote)
        finally:
            self._free.put(zygote)
            took = time.monotonic() - started
            with self._lock:
                self.pending -= 1
                self.completed += 1
                self._mean_seconds += 0.1 * (took - self._mean_seconds)

    def submit(self, job: Callable[[Zygote], T]) -> asyncio.Future[T]:
        """Run an admitted job on a free worker; the admission is released when it ends (or
        when it is cancelled before starting)."""
        future = self._executor.submit(self._work, job)
        wrapped = asyncio.wrap_future(future)

        def on_done(f: asyncio.Future[Any]) -> None:
            if f.cancelled() and future.cancelled():
                self.release()

        wrapped.add_done_callback(on_done)
        return wrapped

    def run_on_each(self, job: Callable[[Zygote], None]) -> None:
        """Run `job` once on every zygote (start-up work), from the calling thread."""
        for zygote in self.zygotes:
            job(zygote)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for zygote in self.zygotes:
            zygote.close()
