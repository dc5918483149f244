"""A source worker's tail socket: the next answers of one of its sources, as JSON lines, to whoever
asks (``duomo source tail NAME --count N``).

The socket is ``ipc.runtime_dir.source_tail_path(supervisor_socket, index)``: beside the
supervisor's socket, in its private runtime folder, mode 0600, and a peer of another user is
refused (``SO_PEERCRED``) whatever the folder's mode. The protocol is one JSON line in —
``{"source": NAME, "count": N}`` (N 1..``MAX_COUNT``) — then the source's next N answers out,
one line each, exactly as ``duomo stream --out`` writes them (``video.answer_lines.answer_line``),
and the connection closes. A source this worker does not decode is one line ``{"error": …}``.
A reader that falls ``MAX_BEHIND`` lines behind is cut off (it must never slow the source or hold
its memory).

Threads: one accepting, one per connection; ``publish`` is called by the sources' answer
readers and never blocks. Owned by ``video.source_worker``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from duomo.video.answer_lines import answer_line

if TYPE_CHECKING:
    from duomo.ipc.stream import StreamAnswer

log = structlog.get_logger("duomo.video")
MAX_COUNT = 1_000_000
MAX_BEHIND = 1024  # lines a reader may have waiting before it is cut off
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 4096
_CLOSED = ""  # put on a reader's queue: the worker stops


class AnswerTail:
    """The tail socket of one worker: readers by source, fed by ``publish``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sources: frozenset[str] = frozenset()  # what the worker decodes now (set by it)
        self._readers: dict[str, list[queue.Queue[str]]] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, name="duomo-tail", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self._lock:
            for readers in self._readers.values():
                for reader in readers:
                    with contextlib.suppress(queue.Full):
                        reader.put_nowait(_CLOSED)

    def publish(self, source: str, answer: StreamAnswer) -> None:
        """``answer`` of ``source`` to its readers (nothing to do when none reads)."""
        readers = self._readers.get(source)
        if not readers:
            return
        line = answer_line(answer)
        with self._lock:
            for reader in list(readers):
                try:
                    reader.put_nowait(line)
                except queue.Full:  # too slow: cut off (its thread sees the closing mark)
                    readers.remove(reader)
                    with contextlib.suppress(queue.Empty):
                        reader.get_nowait()
                    reader.put_nowait(_CLOSED)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = self._request(conn)
            except (OSError, ValueError) as err:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"error": str(err)}).encode() + b"\n")
                return
            source, count = request
            reader: queue.Queue[str] = queue.Queue(MAX_BEHIND)
            with self._lock:
                self._readers.setdefault(source, []).append(reader)
            try:
                for _ in range(count):
                    line = reader.get()
                    if line == _CLOSED:
                        return
                    conn.sendall(line.encode() + b"\n")
            except OSError:  # the reader went away
                return
            finally:
                with self._lock:
                    readers = self._readers.get(source, [])
                    if reader in readers:
                        readers.remove(reader)

    def _request(self, conn: socket.socket) -> tuple[str, int]:
        """The peer's request, checked: the same user, a known source, a count in range."""
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid not in (os.getuid(), 0):
            raise ValueError("refused: another user")
        conn.settimeout(REQUEST_TIMEOUT_S)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(MAX_REQUEST_BYTES)
            if not chunk or len(data) + len(chunk) > MAX_REQUEST_BYTES:
                raise ValueError('send one line: {"source": NAME, "count": N}')
            data += chunk
        conn.settimeout(None)
        request = json.loads(data)
        source, count = request.get("source"), request.get("count")
        if not isinstance(source, str) or type(count) is not int or not 0 < count <= MAX_COUNT:
            raise ValueError(f'send {{"source": NAME, "count": 1..{MAX_COUNT}}}')
        if source not in self.sources:
            raise ValueError(f"this worker does not decode source {source!r}")
        return source, count
