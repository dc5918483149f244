"""What a gateway worker gives back once its callers go quiet: the memory its rings hold for
large frames, and the C heap's free pages.

While it serves, a worker keeps what the next request will want: request-sized buffers in its
heap (``main.keep_request_buffers``: a 720 KB body faulted in afresh each time cost 0.8 ms of a
2.4 ms round trip), a ring grown for a large frame, and the pages its slots' inputs touched. That
is right under load and wrong after it: a burst of large and malformed requests left a worker at
its high-water mark for good (issue 42 measured 72 -> 405 MiB). So every ``LOOK_EVERY_S`` the
keeper looks:

- a model none of whose slots was taken since the last look is quiet: its handle is trimmed
  (``ModelHandle.trim``: a grown ring goes back to the model's default, the free slots' input
  pages are released, in this worker and in the supervisor, which maps the same memfd);
- when no request at all came since the last look and the worker's anonymous memory is more than
  ``HEAP_SLACK_BYTES`` above what the last trim left, the garbage is collected (a failed
  request's traceback can hold its buffers in a cycle) and the heap is trimmed (``malloc_trim``:
  the free pages of every arena, not only the top), on an executor thread.

A worker under steady load is never trimmed; one whose callers left is back near its level at
start within two looks (the margin, measured: ``tests/integration/test_gateway_memory.py``).

Runs as a task on the worker's event loop (``gateway.main``), where it also trims the handles: a
trim may attach a ring, whose reply only the loop reads (``Client.read_in_loop``). The link
counts the slots taken per model (``SupervisorLink.taken``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc

import structlog

from duomo.gateway.link import SupervisorLink
from duomo.ipc.errors import DuomoError
from duomo.ipc.host_memory import resident_bytes, trim_heap

log = structlog.get_logger("duomo.gateway.memory")
LOOK_EVERY_S = 10.0
HEAP_SLACK_BYTES = 8 << 20  # anonymous growth since the last trim that is worth a trim


class MemoryKeeper:
    """Gives back what a quiet worker holds (the module docstring's rule)."""

    def __init__(self, link: SupervisorLink, look_every_s: float = LOOK_EVERY_S) -> None:
        self.link = link
        self.look_every_s = look_every_s
        self._seen: dict[str, int] = {}  # model -> slots taken at the last look
        self._trimmed_bytes = resident_bytes()  # anonymous memory after the last heap trim

    async def run(self) -> None:
        """Look every ``look_every_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.look_every_s)
            await self.look()

    async def look(self) -> None:
        """Trim the handles of the models quiet since the last look, and the heap if the worker
        was quiet and its memory grew."""
        taken = dict(self.link.taken)
        busy = taken != self._seen
        for name, handle in self.link.handles().items():
            if taken.get(name, 0) == self._seen.get(name, 0):
                with contextlib.suppress(DuomoError):  # (refused: it keeps its ring for now)
                    handle.trim()
        self._seen = taken
        if not busy and resident_bytes() > self._trimmed_bytes + HEAP_SLACK_BYTES:
            before = resident_bytes()
            gc.collect()  # (a failed request's traceback can hold its buffers in a cycle)
            await asyncio.get_running_loop().run_in_executor(None, trim_heap)
            self._trimmed_bytes = resident_bytes()
            log.info(
                "gave back the heap's free memory",
                before_mb=round(before / 2**20, 1),
                after_mb=round(self._trimmed_bytes / 2**20, 1),
            )
