"""The live preview of ``duomo stream --preview HOST:PORT``: a small HTTP server showing, per
stream, its latest frame with the models' results drawn over it, its state, rates and answer age.

Called by the ``duomo stream`` command (and by any producer that wants the page): it hands each
decoded frame to ``PreviewServer.frame``, each answer to ``answer`` and the stream's figures to
``figures``; none of them blocks or encodes. Loopback by default, like the gateway.

Routes (``{s}`` a stream name, percent-encoded: a name may hold any printable character):

==========================  ========================================================================
``GET /``                   the page (``static/index.html``, ``preview.js``, ``preview.css``)
``GET /events``             server-sent events: the whole board as one JSON object per change, at
                            most ``EVENTS_PER_S`` a second per client (``/state`` is one of them)
``GET /frame/{s}.jpg``      the stream's latest JPEG (``X-Frame-Seq``: its encoding's number)
``GET /mjpeg/{s}``          the same JPEGs as they are encoded, as MJPEG
==========================  ========================================================================

Threads (who runs what, and hands off through what):

===========================  ============================  =====================================
thread                       runs                          hands off through
===========================  ============================  =====================================
the caller's (decode, loop)  ``frame``/``answer``/         the board under its lock: a frame is
                             ``figures``: store, notify    copied only when its stream is due
``preview-encoder``          JPEG encoding, ≤ ``max_fps``  the board: the JPEG and its seq
                             per stream (cv2 drops the GIL)
``preview-http``             the accept loop               one daemon thread per connection
one per connection           a file, a JPEG, the events,   reads the board under the lock,
                             MJPEG                         writes to its socket outside it
===========================  ============================  =====================================

Invariants: the caller's thread never encodes, never serialises and never waits for a client;
a frame that arrives before its stream is due again is not kept (the one after is: the newest);
a client that stops reading blocks only its own connection's thread, and is dropped after
``CLIENT_TIMEOUT_S``. Results are drawn from each model's latest OK answer (the box lags the
image by the answer's age); the page says which frame each answer belongs to.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import numpy as np
import structlog

if TYPE_CHECKING:
    from duomo.ipc.stream import StreamAnswer

log = structlog.get_logger("duomo.video.preview")

EVENTS_PER_S = 10.0  # the most events a second one /events client is sent
KEEPALIVE_S = 10.0  # an SSE comment this often keeps proxies and idle clients from closing
CLIENT_TIMEOUT_S = 30.0  # a client that neither reads nor sends for this long is dropped
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/preview.js": ("preview.js", "text/javascript; charset=utf-8"),
    "/preview.css": ("preview.css", "text/css; charset=utf-8"),
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob:; object-src 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass
class _StreamView:
    """What the page shows of one stream. ``pending`` is the frame the encoder takes next."""

    name: str
    next_due_s: float = 0.0  # monotonic: a frame before this is not kept
    pending: np.ndarray | None = None
    pending_number: int | None = None
    jpeg: bytes = b""
    jpeg_seq: int = 0  # 0: nothing encoded yet
    image: dict[str, Any] | None = None  # seq, frame, width, height of the source frame
    answers: dict[str, StreamAnswer] = field(default_factory=dict)  # latest OK, per model
    outcomes: dict[str, StreamAnswer] = field(default_factory=dict)  # latest any, per model
    figures: dict[str, Any] = field(default_factory=dict)


class _Board:
    """The streams' views behind one lock; ``changed`` wakes the encoder and the clients."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.streams: dict[str, _StreamView] = {}
        self.due: set[str] = set()  # streams with a pending frame
        self.version = 0  # bumped on every change the page shows
        self.stopping = threading.Event()
        self._cache_lock = threading.Lock()
        self._cache: tuple[int, bytes] = (-1, b"")

    def view(self, name: str) -> _StreamView:
        """The stream's view (created on first sight); the caller holds the lock."""
        found = self.streams.get(name)
        if found is None:
            found = self.streams[name] = _StreamView(name)
        return found

    def touched(self) -> None:
        """One more change to show; the caller holds the lock."""
        self.version += 1
        self.changed.notify_all()

    def wait_newer(self, seen: int, timeout_s: float) -> int:
        """The board's version once it is past ``seen`` (or ``timeout_s`` passed, or stop)."""
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen or self.stopping.is_set(), timeout_s)
            return self.version

    def event(self) -> tuple[int, bytes]:
        """The board as JSON (one SSE payload), serialised once per version for all clients."""
        with self.lock:
            version = self.version
            views = [
                (v.name, v.image, dict(v.answers), dict(v.outcomes), v.figures)
                for v in self.streams.values()
            ]
        with self._cache_lock:
            if self._cache[0] == version:
                return self._cache
        streams = [
            {
                "name": name,
                "image": image,
                "figures": _plain(figures),
                "answers": {m: _plain(a.to_json()) for m, a in answers.items()},
                "outcomes": {m: _outcome(a) for m, a in outcomes.items()},
            }
            for name, image, answers, outcomes, figures in views
        ]
        body = json.dumps({"version": version, "streams": streams}, allow_nan=False)
        with self._cache_lock:
            self._cache = (version, body.encode())
            return self._cache


class PreviewServer:
    """The preview page's HTTP server and JPEG encoder (see the module docstring).

    ``max_fps`` bounds the JPEG encodings per stream; ``max_width`` the JPEG's width (a wider
    frame is scaled down; the results are drawn in the source frame's pixels, scaled alike).
    ``start`` binds the port (``port=0``: a free one, read back from ``url``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_fps: float = 5.0,
        max_width: int = 1280,
        jpeg_quality: int = 80,
    ) -> None:
        if max_fps <= 0 or max_width < 16 or not 1 <= jpeg_quality <= 100:
            raise ValueError("max_fps > 0, max_width >= 16 and jpeg_quality in 1..100")
        self.host = host
        self.port = port
        self.max_width = max_width
        self.jpeg_quality = jpeg_quality
        self._board = _Board(1.0 / max_fps)
        self._http: _PreviewHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        """The page's address, once started (an IPv6 host in brackets)."""
        if self._http is None:
            raise RuntimeError("the preview server is not started")
        host, port = str(self._http.server_address[0]), int(self._http.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def start(self) -> None:
        """Bind the port and start the encoder and the server threads."""
        server_class = _PreviewHTTPServer6 if ":" in self.host else _PreviewHTTPServer
        self._http = server_class((self.host, self.port), _Handler)
        self._http.board = self._board
        self._threads = [
            threading.Thread(target=self._encode_loop, name="preview-encoder", daemon=True),
            threading.Thread(target=self._http.serve_forever, name="preview-http", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("preview serving", url=self.url)

    def stop(self) -> None:
        """Stop serving: the accept loop, the encoder, and every client's event stream."""
        board = self._board
        board.stopping.set()
        with board.changed:
            board.changed.notify_all()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def frame(self, stream: str, image: np.ndarray, number: int | None = None) -> None:
        """Offer the stream's newest frame (RGB uint8 H×W×3, or H×W): kept (copied) only when
        the stream is due for its next JPEG, else dropped; never encodes, never waits on a
        client. ``number``: the frame's number, shown beside the answers' own."""
        channels = image.shape[2] if image.ndim == 3 else 1
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or channels not in (1, 3, 4):
            shown = f"{image.dtype}{image.shape}"
            raise ValueError(f"a preview frame is uint8 H×W×3 or H×W, not {shown}")
        board = self._board
        now = time.monotonic()
        with board.lock:
            view = board.view(stream)
            if now < view.next_due_s:
                return
            view.next_due_s = now + board.interval_s
        copy = image.copy()  # the caller may reuse its buffer (a slot, a decoder's frame)
        with board.lock:
            view.pending, view.pending_number = copy, number
            board.due.add(stream)
            board.changed.notify_all()

    def answer(self, stream: str, answer: StreamAnswer) -> None:
        """Record an answer: an OK one is drawn (the latest per model), any is shown by outcome."""
        board = self._board
        with board.lock:
            view = board.view(stream)
            view.outcomes[answer.model] = answer
            if answer.outcome == "OK":
                view.answers[answer.model] = answer
            board.touched()

    def figures(self, stream: str, figures: dict[str, Any]) -> None:
        """Replace the stream's figures (state, input_fps, answered_fps, age_ms_p50/p99, counts)."""
        board = self._board
        with board.lock:
            board.view(stream).figures = dict(figures)
            board.touched()

    def _encode_loop(self) -> None:
        board = self._board
        while True:
            with board.changed:
                board.changed.wait_for(lambda: bool(board.due) or board.stopping.is_set())
                if board.stopping.is_set():
                    return
                work = []
                for name in board.due:
                    view = board.streams[name]
                    work.append((view, view.pending, view.pending_number))
                    view.pending = None
                board.due.clear()
            for view, image, number in work:
                if image is None:
                    continue
                try:
                    jpeg = encode_jpeg(image, self.max_width, self.jpeg_quality)
                except Exception:  # a bad frame must not end the preview
                    log.exception("preview frame not encoded", stream=view.name)
                    continue
                with board.lock:
                    view.jpeg, view.jpeg_seq = jpeg, view.jpeg_seq + 1
                    height, width = image.shape[:2]
                    view.image = {
                        "seq": view.jpeg_seq,
                        "frame": number,
                        "width": width,
                        "height": height,
                    }
                    board.touched()


def encode_jpeg(image: np.ndarray, max_width: int, quality: int) -> bytes:
    """The frame (RGB, RGBA or grey, uint8) as a JPEG no wider than ``max_width``."""
    import cv2  # lazily: only the preview's encoder needs it

    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if image.ndim == 3:
        code = cv2.COLOR_RGBA2BGR if image.shape[2] == 4 else cv2.COLOR_RGB2BGR
        image = cv2.cvtColor(image, code)
    height, width = image.shape[:2]
    if width > max_width:
        size = (max_width, max(1, round(height * max_width / width)))
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    ok, buffer = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("cv2.imencode failed")
    return bytes(buffer)


def _outcome(answer: StreamAnswer) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "frame": answer.frame,
        "outcome": answer.outcome,
        "age_ms": _plain(answer.age_ms),
    }
    if answer.error:
        shown["error"] = answer.error
    return shown


def _plain(value: Any) -> Any:
    """``value`` as plain JSON: numpy scalars and small arrays unwrapped (a large one said by
    its shape), NaN and ±inf as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):  # a raw model's output: the page shows only its shape
        return _plain(value.tolist()) if value.size <= 64 else f"array {value.dtype}{value.shape}"
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class _PreviewHTTPServer(ThreadingHTTPServer):
    """The HTTP server with the board its handlers read; one daemon thread per connection."""

    daemon_threads = True
    board: _Board

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("preview request failed", client=str(client_address))


class _PreviewHTTPServer6(_PreviewHTTPServer):
    """The same on an IPv6 address (``--preview [::1]:8090``)."""

    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """One connection: the page's files, a stream's JPEG or MJPEG, or the event stream."""

    server: _PreviewHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S  # the socket's: a client that stops reading is dropped
    server_version = "duomo-preview"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("preview request", line=format % args)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path in STATIC:
                name, kind = STATIC[path]
                page = resources.files("duomo.video") / "static" / name
                self._send(200, kind, page.read_bytes())
            elif path == "/events":
                self._events()
            elif path == "/state":
                self._send(200, "application/json", self.server.board.event()[1])
            elif path.startswith("/frame/") and path.endswith(".jpg"):
                self._jpeg(unquote(path[len("/frame/") : -len(".jpg")]))
            elif path.startswith("/mjpeg/"):
                self._mjpeg(unquote(path[len("/mjpeg/") :]))
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")
        except (ConnectionError, TimeoutError):
            self.close_connection = True  # the client went away or stopped reading

    def _send(self, status: int, kind: str, body: bytes, **headers: str) -> None:
        self.send_response(status)
        self._headers(kind, {"Content-Length": str(len(body)), **headers})
        self.wfile.write(body)

    def _headers(self, kind: str, headers: dict[str, str]) -> None:
        self.send_header("Content-Type", kind)
        self.send_header("Cache-Control", "no-store")
        for key, value in {**SECURITY_HEADERS, **headers}.items():
            self.send_header(key, value)
        self.end_headers()

    def _latest(self, stream: str) -> tuple[int, int, bytes]:
        """The board's version, and the stream's latest JPEG and its seq (0: none yet)."""
        board = self.server.board
        with board.lock:
            view = board.streams.get(stream)
            seq, jpeg = (view.jpeg_seq, view.jpeg) if view is not None else (0, b"")
            return board.version, seq, jpeg

    def _jpeg(self, stream: str) -> None:
        _, seq, jpeg = self._latest(stream)
        if not seq:
            self._send(404, "text/plain; charset=utf-8", b"no frame yet\n")
        else:
            self._send(200, "image/jpeg", jpeg, **{"X-Frame-Seq": str(seq)})

    def _streaming(self, kind: str) -> None:
        self.close_connection = True  # no length: the response ends with the connection
        self.send_response(200)
        self._headers(kind, {"Connection": "close", "X-Accel-Buffering": "no"})

    def _events(self) -> None:
        board = self.server.board
        self._streaming("text/event-stream")
        seen = -1
        while not board.stopping.is_set():
            if board.wait_newer(seen, KEEPALIVE_S) == seen:
                self.wfile.write(b": keepalive\n\n")
            else:
                seen, body = board.event()
                self.wfile.write(b"data: " + body + b"\n\n")
            self.wfile.flush()
            board.stopping.wait(1.0 / EVENTS_PER_S)  # changes meanwhile go in the next event

    def _mjpeg(self, stream: str) -> None:
        board = self.server.board
        self._streaming("multipart/x-mixed-replace; boundary=frame")
        seen = 0
        while not board.stopping.is_set():
            version, seq, jpeg = self._latest(stream)
            if seq != seen:
                seen = seq
                head = f"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
                self.wfile.write(head.encode() + jpeg + b"\r\n")
                self.wfile.flush()
            board.wait_newer(version, KEEPALIVE_S)
