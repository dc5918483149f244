"""Dynamic batching for one model: a bounded priority queue and the rule that forms batches.

Shared by all worker threads of one model; requests are put by the engine, the reactor, or the
model's own idle worker (below).

The rule, as Mosec and Triton do it: a worker blocks for the first request, then fills the batch
until ``max_batch`` requests are queued or ``max_delay_ms`` has passed since that first request
was *enqueued* (a backlog therefore never waits). With ``max_delay_ms: auto`` the window is
chosen anew as the load changes, from the batches' cost curve, the arrival rate and the SLO
(``worker.batch_window`` states that rule); it is 0 where batching does not pay. Only one
worker fills at a time, so two idle instances do not split a forming batch. Higher
``priority`` is taken first, FIFO within a level, and every second a request waits raises its
effective priority by ``aging_per_s``: a low priority is delayed for a bounded time under
sustained higher-priority load, never starved.
Requests whose deadline has passed are handed back as ``expired`` and never run.
``next_batch`` always returns at least one request to run or expire, or ``None`` once the batcher
is closed and empty, or once the calling worker's generation has been retired.

Workers belong to a generation: ``retire_workers`` ends the current one (its idle workers return
at once, a busy one after its batch) while queued requests stay for the next generation. That is
how an unload, a re-initialization or a reload lets go of workers without losing the queue.

A worker sleeps on a lock of its own, which whoever changes the queue releases (``_sleep``,
``_wake_all``): what ``threading.Condition`` does inside, without its Python wrapper, whose
four calls per hand-off run on every request's path, cold after every inference. Or, with an
``IdleReader`` (the supervisor's lending, ``supervisor.lending``) and nothing queued, one idle
worker at a time waits in the idle reader instead: it reads its model's producers and queues
what arrives itself, so the request it then takes was never handed from one thread to
another; ``_wake_all`` wakes it through its ``wake_fd`` (an eventfd, one per worker:
``batches``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog

from ipc.errors import ResourceExhaustedError, UnavailableError
from worker.batch_window import BatchWindow
from worker.request import Request

log = structlog.get_logger("duomo.batcher")


class IdleReader(Protocol):
    """What an idle worker does instead of sleeping, when its batcher has one."""

    def __call__(self, model: str, wake_fd: int) -> bool:
        """On the worker's thread, without the batcher's lock: wait until something arrives
        for ``model`` or ``wake_fd`` is readable (the batcher wakes it so), and ``put`` what
        arrived. False at once when it has nothing to wait on for ``model``."""
        ...


@dataclass(slots=True)
class TakenBatch:
    run: list[Request]
    expired: list[Request]


class Batcher:
    def __init__(
        self,
        model: str,
        max_batch: int,
        max_delay_s: float,
        queue_size: int,
        clock: Callable[[], float] = time.monotonic,
        aging_per_s: float = 0.0,
        idle_reader: IdleReader | None = None,
        window: BatchWindow | None = None,
    ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self._window = window  # ``max_delay_ms: auto``: it chooses the fill window instead
        self.queue_size = queue_size
        self.aging_per_s = aging_per_s
        self._clock = clock
        self._levels: dict[int, deque[Request]] = {}  # priority -> FIFO of its requests
        self._count = 0
        self._lock = threading.Lock()
        self._sleepers: list[threading.Lock] = []  # one held lock per sleeping worker
        self._idle_reader = idle_reader
        self._reader: tuple[int, int] | None = None  # (thread, wake fd) of the one reading
        self._reader_woken = False
        self._look_again = False  # ``wake_idle`` came during a wait in the idle reader
        self._filling = False
        self._closed = False
        self.generation = 0  # workers started now serve this generation

    @property
    def depth(self) -> int:
        with self._lock:
            return self._count

    def put(self, request: Request) -> None:
        """Queue ``request``; a full queue or a closed batcher is an error at once."""
        with self._lock:
            if self._closed:
                raise UnavailableError(f"model {self.model!r} is not accepting requests")
            if self._count >= self.queue_size:
                raise ResourceExhaustedError(
                    f"model {self.model!r} queue is full ({self.queue_size} requests)"
                )
            level = self._levels.get(request.priority)
            if level is None:
                level = self._levels[request.priority] = deque()
            level.append(request)
            self._count += 1
            if self._window is not None:
                self._window.record_arrival()
            if self._sleepers or self._reader is not None:
                self._wake_all()

    def close(self) -> None:
        """Stop accepting; workers drain what is queued, then ``next_batch`` returns None."""
        with self._lock:
            self._closed = True
            self._wake_all()

    def wake_idle(self) -> None:
        """Wake the sleeping workers, and the one waiting in the idle reader, to look again at
        what they may read (``idle_reader``): a connection became theirs, or the one borrowed
        must be given back (answers wait to be sent on it)."""
        with self._lock:
            self._look_again = True
            self._wake_all()

    def retire_workers(self) -> int:
        """End the current worker generation; returns the new one (for the next workers)."""
        with self._lock:
            self.generation += 1
            self._wake_all()
            return self.generation

    def reopen(self) -> None:
        """Accept requests again after ``close`` (a model loaded again after an unload)."""
        with self._lock:
            self._closed = False

    def take_expired(self, now: float) -> list[Request]:
        """Remove and return the queued requests whose deadline has passed (for a model that
        has no worker to expire them: one waiting for its load or re-initialization)."""
        with self._lock:
            expired: list[Request] = []
            for priority, level in list(self._levels.items()):
                kept: deque[Request] = deque()
                for request in level:
                    (expired if request.expired(now) else kept).append(request)
                if not kept:
                    del self._levels[priority]
                elif len(kept) != len(level):
                    self._levels[priority] = kept
            self._count -= len(expired)
            return expired

    def drain(self) -> list[Request]:
        """Remove and return everything still queued (for failing it on shutdown)."""
        with self._lock:
            taken = [r for level in self._levels.values() for r in level]
            self._levels.clear()
            self._count = 0
            return sorted(taken, key=lambda r: (-r.priority, r.seq))

    def batches(self, generation: int) -> Iterator[TakenBatch]:
        """``next_batch`` for one worker of ``generation`` until it should stop, with a wake-up
        eventfd of its own (closed at the end) for its waits in the idle reader. Without one
        (no descriptor left) it sleeps here, as a worker without an idle reader does."""
        try:
            wake_fd: int | None = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            wake_fd = None
        try:
            while (taken := self.next_batch(generation, wake_fd)) is not None:
                yield taken
        finally:
            if wake_fd is not None:
                os.close(wake_fd)

    def next_batch(self, generation: int = 0, wake_fd: int | None = None) -> TakenBatch | None:
        """The next batch for a worker of ``generation``; None when that worker should stop.
        A worker that gives its ``wake_fd`` may wait in the idle reader."""
        with self._lock:
            while True:
                while not self._count or self._filling:
                    if (self._closed and not self._count) or generation != self.generation:
                        return None
                    if (
                        wake_fd is not None
                        and self._idle_reader is not None
                        and self._reader is None
                        and not self._count  # (not while another worker fills a batch)
                    ):
                        self._look_again = False
                        if self._wait_in_reader(wake_fd) or self._look_again:
                            continue
                    self._sleep(None)
                if generation != self.generation:
                    return None
                delay_s = self.max_delay_s if self._window is None else self._window.delay_s()
                if delay_s <= 0 or self._count >= self.max_batch:
                    return self._take()  # nothing to wait for: the batch is what is queued
                self._filling = True
                try:
                    first = self._levels[self._best_level(self._clock())][0]
                    fill_until = first.enqueued_s + delay_s
                    late_from, late = fill_until - delay_s / 2, False  # (the second half)
                    while self._count < self.max_batch and not self._closed:
                        remaining = fill_until - self._clock()
                        if remaining <= 0 or generation != self.generation or not self._count:
                            break
                        before = self._count
                        self._sleep(remaining)
                        late = late or (self._count > before and self._clock() >= late_from)
                    if self._window is not None:
                        self._window.record_fill(late or self._count >= self.max_batch)
                    if generation != self.generation:
                        return None  # retired while filling: the queue stays for the next
                    if self._count:  # (a drain may have emptied it meanwhile)
                        return self._take()
                finally:
                    self._filling = False
                    if self._sleepers:
                        self._wake_all()

    def _sleep(self, timeout_s: float | None) -> None:
        """With the lock held: let it go and sleep until ``_wake_all`` or ``timeout_s``, then
        hold it again. Callers check again what they wait for (a wake-up may be spare)."""
        wake = threading.Lock()
        wake.acquire()
        self._sleepers.append(wake)
        self._lock.release()
        try:
            woken = wake.acquire(True, -1 if timeout_s is None else timeout_s)
        finally:
            self._lock.acquire()
        if not woken:
            with contextlib.suppress(ValueError):  # (woken right after the timeout)
                self._sleepers.remove(wake)

    def _wait_in_reader(self, wake_fd: int) -> bool:
        """With the lock held: wait in the idle reader (without the lock). False only if it
        had nothing to read and nobody woke it meanwhile: then, and only then, the caller may
        sleep without looking again (a request queued while the lock was let go woke it
        through ``wake_fd``, which is consumed here: that wake-up must not be lost)."""
        assert self._idle_reader is not None
        self._reader = (threading.get_ident(), wake_fd)
        self._lock.release()
        read = False
        try:
            read = self._idle_reader(self.model, wake_fd)
        except Exception:  # a bug there must not end the worker: it sleeps here instead
            log.exception("idle reader failed", model=self.model)
        finally:
            self._lock.acquire()
            self._reader = None
            woken = self._reader_woken
            if woken:
                self._reader_woken = False
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(wake_fd)
        if read and self._sleepers and not self._count:  # (woken, not by a request: the
            self._wake_all()  # next worker of a new generation, say, reads from now on)
        return read or woken

    def _wake_all(self) -> None:
        """With the lock held: wake every sleeping worker, and the one in the idle reader
        (unless it is the caller: it queues what it read)."""
        for wake in self._sleepers:
            wake.release()
        self._sleepers.clear()
        reader = self._reader
        if reader is not None and not self._reader_woken and reader[0] != threading.get_ident():
            self._reader_woken = True
            os.eventfd_write(reader[1], 1)

    def _best_level(self, now: float) -> int:
        """The priority level whose oldest request goes next.

        A request's effective priority is its priority plus ``aging_per_s`` for every second it
        has waited, so under sustained higher-priority load a request at priority p is taken
        once it has waited (P - p) / aging_per_s seconds longer than the P-level head; ties go
        to the earlier request.
        """
        if len(self._levels) == 1:
            return next(iter(self._levels))
        best: int | None = None
        best_key = (0.0, 0)
        for priority, level in self._levels.items():
            head = level[0]
            key = (priority + (now - head.enqueued_s) * self.aging_per_s, -head.seq)
            if best is None or key > best_key:
                best, best_key = priority, key
        assert best is not None
        return best

    def _take(self) -> TakenBatch:
        now = self._clock()
        taken = TakenBatch([], [])
        while self._count and len(taken.run) < self.max_batch:
            priority = self._best_level(now)
            level = self._levels[priority]
            request = level.popleft()
            if not level:
                del self._levels[priority]
            self._count -= 1
            (taken.expired if request.expired(now) else taken.run).append(request)
        return taken
