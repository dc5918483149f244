"""Fairness between flows: one priority level's queue, taken in weighted round-robin.

The rule, after priority: within one priority level, requests are taken from their **flows**
(``Request.flow``: a stream's, or a connection's own for its plain requests) in weighted
round-robin, by stride scheduling — each flow has a pass, the flow with the lowest goes next
(ties: the older request) and its pass grows by 1/weight; a flow that was idle joins at the
pass last served, with no credit saved up. So a 30 fps camera cannot starve a 5 fps camera of
the same model, and a client with many slots in flight cannot starve one with few.

Invariants: the passes stay finite and comparable whatever the load. A weight is in
[0.001, 1000] (``ipc.stream_settings``: the wire refuses others: ``stream_open``, and a source's
definition), so a stride is at most 1000; a level's passes are counted from the pass last
served once it passes ``REBASE_AT`` (``Level.rebase``), so a stride of 0.001 still moves a pass
however long the queue has stayed busy. ``Level.count`` is the number of requests queued in
its flows, and a flow with no request queued holds no queue.

Who calls it: the batcher (``worker.batcher``) keeps one ``Level`` per priority and uses it
under its own lock (a ``Level`` has none); its other rules — priority with aging, the batching
window, a full queue's flow that gives way, ``supersedes`` — are the batcher's. The weight
bounds are read by the control protocol (``supervisor.process.control_messages``) and a
source's definition (``supervisor.sources.definition``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator

from duomo.worker.request import Request

REBASE_AT = float(1 << 32)  # a level's passes are counted afresh from here (``Level.rebase``)


class Level:
    """One priority level's queue: a FIFO per flow, taken in weighted round-robin (the module
    docstring's rule). Used under the batcher's lock."""

    __slots__ = ("count", "flows", "passes", "served")

    def __init__(self) -> None:
        self.flows: dict[Hashable, deque[Request]] = {}  # the flows with requests queued
        self.passes: dict[Hashable, float] = {}  # flow -> its pass (idle ones: while ahead)
        self.served = 0.0  # the pass last served
        self.count = 0

    def append(self, request: Request) -> None:
        flow = request.flow
        queue = self.flows.get(flow)
        if queue is None:
            queue = self.flows[flow] = deque()
            self.passes[flow] = max(self.served, self.passes.get(flow, 0.0))
        queue.append(request)
        self.count += 1

    def oldest(self) -> Request:
        """The request queued longest (the batching window runs from its arrival)."""
        if len(self.flows) == 1:
            return next(iter(self.flows.values()))[0]
        return min((queue[0] for queue in self.flows.values()), key=_arrival)

    def pop(self) -> Request:
        """The next request by the round-robin rule."""
        flows, passes = self.flows, self.passes
        if len(flows) == 1:
            flow = next(iter(flows))
        else:
            flow = min(flows, key=lambda f: (passes[f], flows[f][0].seq))
        queue = flows[flow]
        request = queue.popleft()
        self.count -= 1
        self.served = passes[flow]
        passes[flow] = self.served + 1.0 / request.weight
        if not queue:
            del flows[flow]
            if len(passes) > 2 * len(flows) + 64:  # forget idle flows no longer ahead
                self.passes = {f: p for f, p in passes.items() if f in flows or p > self.served}
        if self.served >= REBASE_AT:
            self.rebase()
        return request

    def rebase(self) -> None:
        """Count every pass from the pass last served (which becomes 0): the order is the
        same, and a pass of 2^32 + a stride of 0.001 would otherwise lose the stride's last
        digits to rounding (a queue that never empties keeps its level, and its passes, for
        good)."""
        served = self.served
        self.passes = {
            f: p - served for f, p in self.passes.items() if f in self.flows or p > served
        }
        self.served = 0.0

    def pop_newest(self, flow: Hashable) -> Request:
        """Take out ``flow``'s newest queued request (it must hold one here): the one a full
        queue refuses to make room. Its pass stays as it was."""
        queue = self.flows[flow]
        request = queue.pop()
        self.count -= 1
        if not queue:
            del self.flows[flow]
        return request

    def remove_flow(self, flow: Hashable) -> list[Request]:
        """Take out every queued request of ``flow``."""
        queue = self.flows.pop(flow, None)
        if queue is None:
            return []
        self.count -= len(queue)
        return list(queue)

    def remove_where(self, doomed: Callable[[Request], bool]) -> list[Request]:
        removed: list[Request] = []
        for flow, queue in list(self.flows.items()):
            kept: deque[Request] = deque()
            for request in queue:
                (removed if doomed(request) else kept).append(request)
            if not kept:
                del self.flows[flow]
            elif len(kept) != len(queue):
                self.flows[flow] = kept
        self.count -= len(removed)
        return removed

    def requests(self) -> Iterator[Request]:
        for queue in self.flows.values():
            yield from queue


def _arrival(request: Request) -> tuple[float, int]:
    return request.enqueued_s, request.seq
