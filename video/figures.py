"""A source's own figures: what it decoded, sent and got back, as the preview page shows them.

``SourceFigures`` is written by two threads of one ``VideoSource`` — its decode thread
(``decoded``, ``sent``, ``state``) and whoever reads its answers (``answered``) — under one
lock, and read by anyone (``snapshot``). Rates count the last ``RATE_WINDOW_S`` seconds; the
answer age percentiles the last ``AGE_SAMPLES`` answers. The supervisor keeps its own figures
per stream (``duomo status``); these are the source's side, available without a round trip.

States: the camera's (``video.health``: ``connecting``, ``playing``, ``reconnecting``,
``failed``, ``stopped``), and ``detached`` while the supervisor is away (frames are decoded and
dropped until the stream opens again). ``last_error`` says why it is not playing (masked).
Counts: ``decoded`` = ``sent`` + ``dropped`` (by ``max_fps``/``every``) + ``detached`` (no
supervisor to send to) + ``corrupt`` (concealed by the decoder: not sent); ``decode_errors``
counts the packets the decoder refused and the frames it concealed; ``reconnects`` counts the
camera's, ``reattached`` the stream's openings on a new supervisor connection.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from duomo.ipc.stream import StreamAnswer

RATE_WINDOW_S = 2.0
AGE_SAMPLES = 256


class SourceFigures:
    """Counts, rates and answer ages of one source (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = "connecting"  # video.health's states, or detached
        self.last_error: str | None = None
        self.fps_nominal: float | None = None
        self.counts = dict.fromkeys(
            (
                "decoded", "sent", "dropped", "detached", "corrupt", "decode_errors", "answered",
                "superseded", "failed", "reconnects", "reattached",
            ),
            0,
        )  # fmt: skip
        self._decoded_at: deque[float] = deque()
        self._answered_at: deque[float] = deque()
        self._ages_ms: deque[float] = deque(maxlen=AGE_SAMPLES)

    def set_state(self, state: str, last_error: str | None = None) -> None:
        """The source is now in ``state``, and why when it says (a failure counts as a
        reconnect); playing clears the last error."""
        with self._lock:
            if state in ("reconnecting", "failed"):
                self.counts["reconnects"] += 1
            if state == "playing":
                self.last_error = None
            elif last_error is not None:  # (a file that stopped on an error keeps it)
                self.last_error = last_error
            self.state = state

    def add_decode_errors(self, count: int) -> None:
        """``count`` more packets refused or frames concealed by the decoder."""
        with self._lock:
            self.counts["decode_errors"] += count

    def reattached(self) -> None:
        """The stream opened again on a new connection to the supervisor: playing."""
        with self._lock:
            self.counts["reattached"] += 1
            self.state = "playing"

    def decoded(self, accepted: bool, attached: bool = True, corrupt: bool = False) -> None:
        """A frame left the decoder; ``accepted``: sent (else dropped at the source: by
        ``max_fps``/``every``, or, not ``attached``, for want of a supervisor, or ``corrupt``:
        concealed by the decoder)."""
        now = time.monotonic()
        with self._lock:
            self.counts["decoded"] += 1
            if corrupt:
                kept = "corrupt"
            elif not attached:
                kept = "detached"
            else:
                kept = "sent" if accepted else "dropped"
            self.counts[kept] += 1
            _push(self._decoded_at, now)

    def answered(self, answer: StreamAnswer) -> None:
        now = time.monotonic()
        with self._lock:
            if answer.outcome == "OK":
                self.counts["answered"] += 1
                self._ages_ms.append(answer.age_ms)
                _push(self._answered_at, now)
            elif answer.outcome == "SUPERSEDED":
                self.counts["superseded"] += 1
            else:
                self.counts["failed"] += 1

    def snapshot(self) -> dict[str, Any]:
        """State, last error, counts, ``input_fps``/``answered_fps`` and
        ``age_ms_p50``/``age_ms_p99``."""
        now = time.monotonic()
        with self._lock:
            ages = np.array(self._ages_ms) if self._ages_ms else None
            return {
                "state": self.state,
                "last_error": self.last_error,
                "fps_nominal": self.fps_nominal,
                **self.counts,
                "input_fps": _rate(self._decoded_at, now),
                "answered_fps": _rate(self._answered_at, now),
                "age_ms_p50": None if ages is None else float(np.percentile(ages, 50)),
                "age_ms_p99": None if ages is None else float(np.percentile(ages, 99)),
            }


def _push(times: deque[float], now: float) -> None:
    times.append(now)
    while times and times[0] < now - RATE_WINDOW_S:
        times.popleft()


def _rate(times: deque[float], now: float) -> float:
    recent = sum(1 for t in times if t >= now - RATE_WINDOW_S)
    return recent / RATE_WINDOW_S
