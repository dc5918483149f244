"""The request trace: when each request passed the supervisor's stages that its slot header does
not time. Off unless the process was started with ``DUOMO_REQUEST_TRACE`` naming a file; made
for ``tools/bench/request_breakdown.py``, which starts a supervisor with it.

The header gives a request's queue, preprocess, infer and postprocess times
(``supervisor.process.attachment``). The trace adds, on the same monotonic clock as the
producers' (``CLOCK_MONOTONIC``, shared by every process of the host), the moments around them:

- ``intake_s``: the intake hands the slot to ``Attachment.submit`` (the notice has been read);
- ``enqueued_s``: the request was made and goes to its model's queue (``Request.enqueued_s``);
- ``answering_s``: the worker calls the slot's answer (the batch's statistics are counted);
- ``encoded_s``: the result is in the slot (JSON encoded and copied, or tensors written);
- ``sent_s``: the "slot done" notice has been sent (or queued in the connection's outbox).

With it on, ``ControlHandlers`` makes every ring a ``TracedAttachment``, a subclass that takes
these timestamps around the parent's own methods, so the answers are the same and, with it off,
the request's path runs no line more. Records are kept in memory (at most ``MAX_RECORDS``) and
written once, as JSON, when the supervisor shuts down (``RequestTrace.write``). A record names
the producer by its process id and the slot by ring and index: one producer process with one
slot in flight per ring makes each record its request's (the tool's rule).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from duomo.supervisor.process.attachment import Attachment
from duomo.worker.request import Outcome

TRACE_ENV = "DUOMO_REQUEST_TRACE"
MAX_RECORDS = 500_000
# a record's fields, in order (seconds; the stage times as the slot header's, unrounded)
FIELDS = (
    "pid", "model", "ring", "slot", "ok", "intake_s", "enqueued_s", "queue_s", "preprocess_s",
    "infer_s", "postprocess_s", "answering_s", "encoded_s", "sent_s",
)  # fmt: skip


class RequestTrace:
    """The records of one supervisor process, written to ``path`` by ``write``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: deque[tuple[Any, ...]] = deque(maxlen=MAX_RECORDS)

    @classmethod
    def from_environment(cls) -> RequestTrace | None:
        """A trace writing to the file ``DUOMO_REQUEST_TRACE`` names; None when it is not set."""
        path = os.environ.get(TRACE_ENV)
        return cls(Path(path)) if path else None

    def attachment(self, pid: int | None) -> functools.partial[TracedAttachment]:
        """What makes a ring of the producer ``pid`` (takes ``Attachment``'s arguments)."""
        return functools.partial(TracedAttachment, self, pid or 0)

    def write(self) -> None:
        """Every record kept, as ``{"fields": FIELDS, "records": [...]}``."""
        body = {"fields": FIELDS, "records": list(self.records)}
        self.path.write_text(json.dumps(body), encoding="utf-8")


class TracedAttachment(Attachment):
    """An ``Attachment`` whose answered requests leave a record in its ``RequestTrace``."""

    def __init__(self, trace: RequestTrace, pid: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trace = trace
        self._pid = pid
        self._intake_s = [0.0] * self.layout.slots
        self._encoded = threading.local()  # (a model's instances may answer at once)

    def submit(self, slot: int, seq: int) -> None:
        if 0 <= slot < len(self._intake_s):
            self._intake_s[slot] = time.monotonic()
        super().submit(slot, seq)

    def _encode(self, outcome: Outcome, area: memoryview) -> tuple[int, int]:
        encoded = super()._encode(outcome, area)
        self._encoded.at = time.monotonic()
        return encoded

    def _complete(self, slot: int, outcome: Outcome) -> None:
        answering = time.monotonic()
        # read before the parent answers: the producer may submit the slot again at once
        request, intake_s = self._in_flight.get(slot), self._intake_s[slot]
        self._encoded.at = 0.0
        super()._complete(slot, outcome)
        sent = time.monotonic()
        if request is None:  # refused at the intake: never queued
            return
        t = outcome.timings
        self._trace.records.append((
            self._pid, self.model_name, self.ring_id, slot, outcome.error is None, intake_s,
            request.enqueued_s, t.queue_s, t.preprocess_s, t.infer_s, t.postprocess_s,
            answering, self._encoded.at, sent,
        ))  # fmt: skip
