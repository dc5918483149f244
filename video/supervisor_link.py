"""The connection to the supervisor that a process's video sources share, made again when lost.

``duomo stream`` runs beside a supervisor as a process of its own (compose's ``stream-source``,
the pod's sidecar), so it outlives the supervisor's restarts. ``SupervisorLink.connect`` waits
for the supervisor's socket and key file (up to ``wait_s``; 0: one attempt). When the connection
is lost — the client saw the socket close, or a source's send or stream open raised
``UnavailableError`` and called ``lost`` — the link closes that client and a thread of its own
connects again, with the backoff of a dropped camera (``video.backoff``: 0.5 s doubling to 10 s),
one log line per attempt, until it connects or ``close`` is called. Each connection has a new
``generation``: the sources (``video.source``) see it in ``current`` and open their streams on
it again under the same names; the frames they decode meanwhile are dropped. A lost client is
closed only once every stream opened on it is closed (``opened``/``closed``): closing it frees
rings that a source's thread may still be writing or unmapping.

Threads: ``connect`` runs on the caller's (the command's main thread); ``current`` and ``lost``
are called by the decode threads and by whoever shows figures; the reconnect thread is started
by the first ``lost`` of a generation and ends once connected or closed. Called by
``video.command`` (and any producer that wants its sources to outlive a supervisor).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import structlog

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError, UnavailableError
from duomo.ipc.runtime_dir import default_socket_path
from duomo.video.backoff import Backoff

log = structlog.get_logger("duomo.video")

CLOSE_JOIN_S = 5.0  # close(): the reconnect thread is mid-attempt at most this long


class SupervisorLink:
    """One supervisor connection, shared by sources, connected again after it is lost.

    Args:
        socket_path: The supervisor's socket; None: ``$DUOMO_SOCKET``, else the standard
            runtime directory's (as ``Client``).
        timeout_s: Each connection's ``Client.timeout_s``.
        backoff: The schedule between attempts (default: 0.5 s doubling to 10 s).

    Attributes:
        generation: Counts the connections made: a source whose stream belongs to an older
            one opens it again.
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        timeout_s: float = 30.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout_s = timeout_s
        self.backoff = backoff or Backoff()
        self.generation = 0
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reconnecting: threading.Thread | None = None
        self._holds: dict[int, int] = {}  # generation -> streams open on it
        self._retired: dict[int, Client] = {}  # lost connections some stream still holds

    def connect(self, wait_s: float = 0.0, stop: threading.Event | None = None) -> Client | None:
        """Connect, trying again with backoff for up to ``wait_s`` while no supervisor answers
        (a log line per attempt). Returns None when ``stop`` was set meanwhile.

        Raises:
            UnavailableError: No supervisor within ``wait_s`` (the last attempt's error).
            ResourceExhaustedError: It refused the connection, until ``wait_s`` passed.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                client = self._dial()
            except DuomoError as err:
                left_s = deadline - time.monotonic()
                if left_s <= 0 or self._stopped(stop):
                    raise
                delay_s = min(self.backoff.next_delay_s(), left_s)
                log.warning(
                    "waiting for the supervisor", socket=str(self.socket_path),
                    attempt=self.backoff.attempts, delay_s=round(delay_s, 3), error=err.message,
                )  # fmt: skip
                if self._wait(delay_s, stop):
                    return None
                continue
            if self.backoff.attempts:
                log.warning("connected to the supervisor", socket=str(self.socket_path))
            self.backoff.reset()
            with self._lock:
                self._client = client
                self.generation += 1
            return client

    def current(self) -> tuple[Client | None, int]:
        """The connection now and its generation; None while it is being made again (a
        client that saw the supervisor go is handed to ``lost`` here)."""
        with self._lock:
            client, generation = self._client, self.generation
        if client is not None and not client.connected:
            self.lost(generation, "the supervisor closed the connection")
            return None, generation
        return client, generation

    def lost(self, generation: int, why: str) -> None:
        """The connection ``generation`` failed: connect again on the link's thread (the old
        client is closed once no stream holds it). Later calls for the same generation (other
        sources) do nothing."""
        with self._lock:
            if generation != self.generation or self._client is None or self._closed.is_set():
                return
            self._retired[generation], self._client = self._client, None
            self._reconnecting = threading.Thread(
                target=self._reconnect, args=(why,), name="duomo-link", daemon=True
            )
            self._reconnecting.start()
        self._close_unheld()

    def opened(self, generation: int) -> None:
        """A source opened a stream on connection ``generation``: it is not closed under it."""
        with self._lock:
            self._holds[generation] = self._holds.get(generation, 0) + 1

    def closed(self, generation: int) -> None:
        """A source closed its stream of connection ``generation``; the last one on a lost
        connection closes it (never while a stream on it still writes or unmaps its rings)."""
        with self._lock:
            held = self._holds.get(generation, 0) - 1
            if held > 0:
                self._holds[generation] = held
            else:
                self._holds.pop(generation, None)
        self._close_unheld()

    def close(self) -> None:
        """Stop reconnecting and close the connections (idempotent); after the sources."""
        self._closed.set()
        with self._lock:
            clients = [*self._retired.values(), self._client]
            self._retired.clear()
            self._client = None
            thread = self._reconnecting
        for client in clients:
            if client is not None:
                client.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_JOIN_S)

    def _close_unheld(self) -> None:
        with self._lock:
            unheld = [g for g in self._retired if not self._holds.get(g)]
            clients = [self._retired.pop(g) for g in unheld]
        for client in clients:  # (lost already: closing frees its socket and rings here)
            with contextlib.suppress(Exception):
                client.close()

    # -- the reconnect thread ------------------------------------------------------------------

    def _reconnect(self, why: str) -> None:
        error = why
        while True:
            delay_s = self.backoff.next_delay_s()
            log.warning(
                "supervisor lost; reconnecting", socket=str(self.socket_path),
                attempt=self.backoff.attempts, delay_s=delay_s, error=error,
            )  # fmt: skip
            if self._closed.wait(delay_s):
                return
            try:
                client = self._dial()
            except DuomoError as err:
                error = err.message
                continue
            with self._lock:
                if self._closed.is_set():
                    client.close()
                    return
                self._client = client
                self.generation += 1
            log.warning(
                "supervisor reconnected",
                socket=str(self.socket_path),
                attempts=self.backoff.attempts,
            )
            self.backoff.reset()
            return

    def _dial(self) -> Client:
        try:
            return Client(self.socket_path, timeout_s=self.timeout_s)
        except OSError as err:  # (the key file unreadable, say: Client maps the socket's own)
            raise UnavailableError(f"cannot reach the supervisor: {err}") from None

    def _stopped(self, stop: threading.Event | None) -> bool:
        return self._closed.is_set() or (stop is not None and stop.is_set())

    def _wait(self, delay_s: float, stop: threading.Event | None) -> bool:
        """Sleep ``delay_s`` unless stopped or closed first; whether it was."""
        until = time.monotonic() + delay_s
        while not self._stopped(stop):
            left_s = until - time.monotonic()
            if left_s <= 0:
                return False
            (stop or self._closed).wait(min(left_s, 0.1))
        return True
