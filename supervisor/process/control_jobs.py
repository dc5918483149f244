"""The slow control messages (``reload``, ``load``, ``unload``, attaching a model never loaded,
and the ``galleries`` and ``gallery_*`` messages, which read or write a gallery's file): one
thread runs them in the order they arrived, from a bounded queue.

Owned by ``Supervisor``; its control handlers (``supervisor.process.control_handlers``) submit
from the reactor thread so the reactor never waits for a model or a file. The model jobs would
run one at a time anyway (each takes the engine's lifecycle lock), so one thread costs no
throughput, and a client
that pipelines hundreds of them adds no thread: past ``limits.control_queue`` waiting jobs in
all, or ``limits.control_queue_per_client`` of one client's, ``submit`` answers
RESOURCE_EXHAUSTED at once, so one client cannot fill the queue for the others.

Every job answers its caller exactly once, whatever it raises: its reply, the error it raised
(a ``DuomoError``, with its own message), INTERNAL for anything else (a fixed message naming
the job; the traceback goes to the log), or UNAVAILABLE for the jobs still queued at ``stop``.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from duomo.ipc.errors import DuomoError, ResourceExhaustedError, UnavailableError
from duomo.supervisor.process.connection import Connection
from duomo.supervisor.process.control_messages import Reply, error_reply, internal_reply

log = structlog.get_logger("duomo.control")


@dataclass
class ControlJob:
    """One slow control message: who asked, what it said (its id goes into the reply), the
    work whose result is the reply (None: the work answered itself, as an ``attach`` does, whose
    reply carries a descriptor), and what to call it in an INTERNAL reply and the log."""

    conn: Connection
    message: dict[str, Any]
    run: Callable[[], Reply | None]
    what: str = "a control job"


class ControlJobs:
    """The one thread that runs the slow control messages in the order they arrived, from a queue
    bounded in all and per client (``submit`` refuses past either)."""

    def __init__(self, capacity: int, per_client: int) -> None:
        self._queue: queue.Queue[ControlJob | None] = queue.Queue()
        self._capacity = capacity
        self._per_client = per_client
        self._waiting = 0  # submitted and not yet started (queue.Queue's bound blocks instead)
        self._waiting_by: Counter[int] = Counter()  # the same, by connection id
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return self._waiting

    def set_capacity(self, capacity: int, per_client: int) -> None:
        """A reload's new ``limits.control_queue`` and ``control_queue_per_client`` (jobs
        already queued stay)."""
        self._capacity, self._per_client = capacity, per_client

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="duomo-control", daemon=True)
        self._thread.start()

    def submit(self, job: ControlJob) -> None:
        """Queue ``job``; ResourceExhaustedError (nothing queued) when the queue is full,
        UnavailableError once stopping."""
        with self._lock:
            if self._stopping:
                raise UnavailableError("the supervisor is stopping")
            if self._waiting >= self._capacity:
                raise ResourceExhaustedError(
                    f"{self._waiting} slow control messages are queued already "
                    f"(limits.control_queue: {self._capacity}); retry once they are answered"
                )
            mine = self._waiting_by[job.conn.id]
            if mine >= self._per_client:
                raise ResourceExhaustedError(
                    f"{mine} of this client's slow control messages are queued already "
                    f"(limits.control_queue_per_client: {self._per_client}); retry once they "
                    "are answered"
                )
            self._waiting += 1
            self._waiting_by[job.conn.id] += 1
        self._queue.put(job)

    def _started(self, job: ControlJob) -> None:
        with self._lock:
            self._waiting -= 1
            self._waiting_by[job.conn.id] -= 1
            if not self._waiting_by[job.conn.id]:
                del self._waiting_by[job.conn.id]

    def stop(self, wait_s: float) -> None:
        """Answer the jobs not started yet UNAVAILABLE, let the running one finish within
        ``wait_s``, end the thread."""
        with self._lock:
            self._stopping = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._started(job)
                job.conn.reply(job.message, error_reply(UnavailableError("the supervisor stopped")))
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(wait_s)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self._started(job)
            self._answer(job)

    @staticmethod
    def _answer(job: ControlJob) -> None:
        try:
            result = job.run()
            if result is None:
                return
            reply = {"ok": True, **result}
        except DuomoError as err:
            reply = error_reply(err)
        except Exception:  # a bug must still answer, and never end the thread
            log.exception("control job failed", job=job.what)
            reply = internal_reply(job.what)
        try:
            job.conn.reply(job.message, reply)
        except Exception:  # (``reply`` fits every reply; this is a last guard for the thread)
            log.exception("control job's reply failed", job=job.what)
