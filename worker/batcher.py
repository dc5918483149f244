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

The fairness rule, after priority: within one priority level, requests are taken from their
**flows** (``Request.flow``: a stream's, or a connection's own for its plain requests) in
weighted round-robin by stride scheduling. ``worker.flows`` states that rule and its bounds on
weights and passes; the batcher keeps a ``Level`` of it per priority, used under its lock.
When the queue is full, the flow with the most queued requests gives way: its newest is
refused RESOURCE_EXHAUSTED to make room for a flow with fewer (a full queue refuses the
newcomer only when its own flow holds the most). A request that ``supersedes`` (a stream of
policy ``latest``) takes the place of its flow's queued requests, which are answered
SUPERSEDED: at most one frame of such a stream ever waits in the queue.
``next_batch`` always returns at least one request to run or expire, or ``None`` once the batcher
is closed and empty, or once the calling worker's generation has been retired.

Workers belong to a generation: ``retire_workers`` ends the current one (its idle workers return
at once, a busy one after its batch) while queued requests stay for the next generation. That is
how an unload, a re-initialization or a reload lets go of workers without losing the queue.

A worker waits for its first request in one of two ways (``_wait_for_first``):

- it **sleeps** on a lock of its own, which whoever changes the queue releases (``_sleep``,
  ``_wake_all``): what ``threading.Condition`` does inside, without its Python wrapper, whose
  four calls per hand-off run on every request's path, cold after every inference;
- or, with an ``IdleReader`` (the supervisor's lending, ``supervisor.process.lending``) and nothing
  queued, it **waits in the idle reader**: it reads its model's producers and queues what
  arrives itself, so the request it then takes was never handed from one thread to another.
  One worker at a time does so: the ``ReaderSeat``, whose handshake with ``_wake_all`` (an
  eventfd per worker, ``batches``) is stated there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog

from duomo.ipc.errors import (
    DuomoError,
    ResourceExhaustedError,
    SupersededError,
    UnavailableError,
)
from duomo.worker.batch_window import BatchWindow
from duomo.worker.flows import Level
from duomo.worker.request import Request

log = structlog.get_logger("duomo.batcher")


class IdleReader(Protocol):
    """What an idle worker does instead of sleeping, when its batcher has one."""

    def __call__(self, model: str, wake_fd: int) -> bool:
        """On the worker's thread, without the batcher's lock: wait until something arrives
        for ``model`` or ``wake_fd`` is readable (the batcher wakes it so), and ``put`` what
        arrived. False at once when it has nothing to wait on for ``model``."""
        ...


class ReaderSeat:
    """The idle-reader handshake: the one worker waiting in the idle reader, and how it is
    woken. Every field is read and changed under the batcher's lock.

    Its steps::

        free ─take→ held ─the queue changes (``_wake_all``): its eventfd is written→ woken
        held | woken ─leave (the eventfd read again if it was written)→ free

    ``_wake_all`` writes the worker's eventfd once per wait, and never from the worker's own
    thread (it queues what it reads: waking itself would cost a spare turn). ``look_again``
    is set by ``Batcher.wake_idle`` (a connection became the model's to read, or the one
    borrowed must be given back): a worker that found nothing to read looks again instead of
    sleeping.
    """

    __slots__ = ("holder", "look_again", "reader", "woken")

    def __init__(self, reader: IdleReader | None) -> None:
        self.reader = reader
        self.holder: tuple[int, int] | None = None  # (thread, wake fd) of the worker in it
        self.woken = False  # its eventfd was written during this wait
        self.look_again = False

    def free(self) -> bool:
        """There is an idle reader and no worker waits in it."""
        return self.reader is not None and self.holder is None

    def take(self, wake_fd: int) -> None:
        self.holder = (threading.get_ident(), wake_fd)
        self.look_again = False

    def leave(self) -> bool:
        """Free the seat; whether its worker was woken meanwhile (its eventfd is read again:
        the next wait must not end on a spare wake-up)."""
        assert self.holder is not None
        wake_fd, woken = self.holder[1], self.woken
        self.holder = None
        if woken:
            self.woken = False
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(wake_fd)
        return woken

    def wake(self, wake_fd: int) -> None:
        """Wake the worker in the seat, whose eventfd is ``wake_fd`` (from another thread than
        its own; once per wait)."""
        if not self.woken:
            self.woken = True
            os.eventfd_write(wake_fd, 1)


@dataclass(slots=True)
class TakenBatch:
    """What one take from the queue yields: the requests that run together, and those already
    past their deadline."""

    run: list[Request]
    expired: list[Request]


class Batcher:
    """One model's bounded priority queue and its batching rule, shared by the model's worker
    threads: ``put`` queues, ``next_batch`` blocks for the first request and fills."""

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
        self._levels: dict[int, Level] = {}  # priority -> its requests, by flow
        self._count = 0
        self._lock = threading.Lock()
        self._sleepers: list[threading.Lock] = []  # one held lock per sleeping worker
        self._seat = ReaderSeat(idle_reader)  # the one worker waiting in the idle reader
        self._filling = False  # a worker fills a batch: the others wait
        self._closed = False
        self.generation = 0  # workers started now serve this generation

    @property
    def depth(self) -> int:
        with self._lock:
            return self._count

    def put(self, request: Request) -> list[tuple[Request, DuomoError]]:
        """Queue ``request``; a full queue or a closed batcher is an error at once.

        Returns the queued requests it displaced, each with the error to answer it with (the
        caller answers them, outside the lock): its flow's, SUPERSEDED, when it ``supersedes``;
        or, the queue being full, the newest of the flow holding the most, RESOURCE_EXHAUSTED.
        """
        displaced: list[tuple[Request, DuomoError]] = []
        with self._lock:
            if self._closed:
                raise UnavailableError(f"model {self.model!r} is not accepting requests")
            if request.supersedes:
                for old in self._remove_flow(request.flow):
                    displaced.append((old, SupersededError(_superseded(self.model))))
            if self._count >= self.queue_size:
                displaced.append((self._make_room(request), self._full()))
            level = self._levels.get(request.priority)
            if level is None:
                level = self._levels[request.priority] = Level()
            level.append(request)
            self._count += 1
            if self._window is not None:
                self._window.record_arrival()
            if self._sleepers or self._seat.holder is not None:
                self._wake_all()
        return displaced

    def _full(self) -> ResourceExhaustedError:
        return ResourceExhaustedError(
            f"model {self.model!r} queue is full ({self.queue_size} requests)"
        )

    def _remove_flow(self, flow: Hashable) -> list[Request]:
        removed: list[Request] = []
        for priority, level in list(self._levels.items()):
            removed += level.remove_flow(flow)
            if not level.count:
                del self._levels[priority]
        self._count -= len(removed)
        return removed

    def _make_room(self, request: Request) -> Request:
        """With the queue full: take out the newest request of the flow holding the most, if
        that flow holds more than ``request``'s would; else refuse ``request``."""
        held: dict[Hashable, int] = {}
        for level in self._levels.values():
            for flow, queue in level.flows.items():
                held[flow] = held.get(flow, 0) + len(queue)
        greediest = max(held, key=held.__getitem__)
        if held[greediest] <= held.get(request.flow, 0) + 1:
            raise self._full()
        newest: tuple[int, Level] | None = None
        for priority, level in self._levels.items():
            held_here = level.flows.get(greediest)
            if held_here and (
                newest is None or held_here[-1].seq > newest[1].flows[greediest][-1].seq
            ):
                newest = (priority, level)
        assert newest is not None
        priority, level = newest
        victim = level.pop_newest(greediest)
        if not level.count:
            del self._levels[priority]
        self._count -= 1
        return victim

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
            self._seat.look_again = True
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
                expired += level.remove_where(lambda r: r.expired(now))
                if not level.count:
                    del self._levels[priority]
            self._count -= len(expired)
            return expired

    def drain(self) -> list[Request]:
        """Remove and return everything still queued (for failing it on shutdown)."""
        with self._lock:
            taken = [r for level in self._levels.values() for r in level.requests()]
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

        The rule: block for the first request (in the idle reader, for a worker that gives its
        ``wake_fd``, when it may); then, unless the window is 0 or ``max_batch`` requests are
        queued, fill until either holds or the window has passed since the first request was
        enqueued; then take up to ``max_batch`` requests, best first."""
        with self._lock:
            while True:
                while not self._count or self._filling:  # 1. block for the first request
                    if (self._closed and not self._count) or generation != self.generation:
                        return None
                    self._wait_for_first(wake_fd)
                if generation != self.generation:
                    return None
                delay_s = self.max_delay_s if self._window is None else self._window.delay_s()
                if delay_s > 0 and self._count < self.max_batch:  # 2. fill within the window
                    self._fill(generation, delay_s)
                    if generation != self.generation:
                        return None  # retired while filling: the queue stays for the next
                    if not self._count:  # (a drain emptied it meanwhile)
                        continue
                return self._take()  # 3. the batch is what is queued, best first

    def _wait_for_first(self, wake_fd: int | None) -> None:
        """With the lock held and nothing to take: wait in the idle reader if this worker may
        (it gave its ``wake_fd``, the seat is free, and no other worker is filling a batch),
        else sleep until the queue changes. The caller looks again either way."""
        seat = self._seat
        if wake_fd is not None and not self._count and seat.free():
            seat.take(wake_fd)
            if self._wait_in_reader(wake_fd) or seat.look_again:
                return
        self._sleep(None)

    def _fill(self, generation: int, delay_s: float) -> None:
        """With the lock held and a first request queued: wait until ``max_batch`` requests
        are queued or ``delay_s`` has passed since the first was enqueued (or the batcher is
        closed, the worker retired, the queue drained). Other workers wait meanwhile."""
        self._filling = True
        try:
            first = self._levels[self._best_level(self._clock())].oldest()
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
        """With the lock held and the seat taken: wait in the idle reader (without the lock),
        then leave the seat. False only if it had nothing to read and nobody woke it
        meanwhile: then, and only then, the caller may sleep without looking again (a request
        queued while the lock was let go woke it through ``wake_fd``, which is consumed on
        leaving: that wake-up must not be lost)."""
        reader = self._seat.reader
        assert reader is not None
        self._lock.release()
        read = False
        try:
            read = reader(self.model, wake_fd)
        except Exception:  # a bug there must not end the worker: it sleeps here instead
            log.exception("idle reader failed", model=self.model)
        finally:
            self._lock.acquire()
            woken = self._seat.leave()
        if read and self._sleepers and not self._count:  # (woken, not by a request: the
            self._wake_all()  # next worker of a new generation, say, reads from now on)
        return read or woken

    def _wake_all(self) -> None:
        """With the lock held: wake every sleeping worker, and the one in the idle reader
        (unless it is the caller: it queues what it read)."""
        for wake in self._sleepers:
            wake.release()
        self._sleepers.clear()
        holder = self._seat.holder  # (the worker in the seat queues what it reads itself)
        if holder is not None and holder[0] != threading.get_ident():
            self._seat.wake(holder[1])

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
            head = level.oldest()
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
            request = level.pop()
            if not level.count:
                del self._levels[priority]
            self._count -= 1
            (taken.expired if request.expired(now) else taken.run).append(request)
        return taken


def _superseded(model: str) -> str:
    return f"a newer frame of the stream took its place in model {model!r}'s queue"
