"""Dynamic batching for one model: a bounded priority queue and the rule that forms batches.

Shared by all worker threads of one model; requests are put by the engine (or the reactor).

The rule, as Mosec and Triton do it: a worker blocks for the first request, then fills the batch
until ``max_batch`` requests are queued or ``max_delay_ms`` has passed since that first request
was *enqueued* (a backlog therefore never waits). Only one worker fills at a time, so two idle
instances do not split a forming batch. Higher ``priority`` is taken first, FIFO within a level.
Requests whose deadline has passed are handed back as ``expired`` and never run.
``next_batch`` always returns at least one request to run or expire, or ``None`` once the batcher
is closed and empty.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ipc.errors import ResourceExhaustedError, UnavailableError
from worker.request import Request


@dataclass
class TakenBatch:
    run: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)


class Batcher:
    def __init__(
        self,
        model: str,
        max_batch: int,
        max_delay_s: float,
        queue_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.queue_size = queue_size
        self._clock = clock
        self._heap: list[tuple[int, int, Request]] = []
        self._cond = threading.Condition()
        self._filling = False
        self._closed = False

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._heap)

    def put(self, request: Request) -> None:
        """Queue ``request``; a full queue or a closed batcher is an error at once."""
        with self._cond:
            if self._closed:
                raise UnavailableError(f"model {self.model!r} is not accepting requests")
            if len(self._heap) >= self.queue_size:
                raise ResourceExhaustedError(
                    f"model {self.model!r} queue is full ({self.queue_size} requests)"
                )
            heapq.heappush(self._heap, (-request.priority, request.seq, request))
            self._cond.notify_all()

    def close(self) -> None:
        """Stop accepting; workers drain what is queued, then ``next_batch`` returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[Request]:
        """Remove and return everything still queued (for failing it on shutdown)."""
        with self._cond:
            taken = [item[2] for item in sorted(self._heap)]
            self._heap.clear()
            return taken

    def next_batch(self) -> TakenBatch | None:
        with self._cond:
            while not self._heap or self._filling:
                if self._closed and not self._heap:
                    return None
                self._cond.wait()
            self._filling = True
            try:
                first = self._heap[0][2]
                fill_until = first.enqueued_s + self.max_delay_s
                while len(self._heap) < self.max_batch and not self._closed:
                    remaining = fill_until - self._clock()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                return self._take()
            finally:
                self._filling = False
                self._cond.notify_all()

    def _take(self) -> TakenBatch:
        now = self._clock()
        taken = TakenBatch()
        while self._heap and len(taken.run) < self.max_batch:
            request = heapq.heappop(self._heap)[2]
            (taken.expired if request.expired(now) else taken.run).append(request)
        return taken
