"""A source's own figures: what it decoded, sent and got back, as the preview page shows them.

``SourceFigures`` is written by two threads of one ``VideoSource`` — its decode thread
(``decoded``, ``sent``, ``state``) and whoever reads its answers (``answered``) — under one
lock, and read by anyone (``snapshot``). Rates count the last ``RATE_WINDOW_S`` seconds; the
answer age percentiles the last ``AGE_SAMPLES`` answers. The supervisor keeps its own figures
per stream (``duomo status``); these are the source's side, available without a round trip.
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
        self.state = "opening"  # opening | playing | reconnecting | ended
        self.fps_nominal: float | None = None
        self.counts = dict.fromkeys(
            ("decoded", "sent", "dropped", "answered", "superseded", "failed", "reconnects"), 0
        )
        self._decoded_at: deque[float] = deque()
        self._answered_at: deque[float] = deque()
        self._ages_ms: deque[float] = deque(maxlen=AGE_SAMPLES)

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state
            if state == "reconnecting":
                self.counts["reconnects"] += 1

    def decoded(self, accepted: bool) -> None:
        """A frame left the decoder; ``accepted``: sent (else dropped at the source)."""
        now = time.monotonic()
        with self._lock:
            self.counts["decoded"] += 1
            self.counts["sent" if accepted else "dropped"] += 1
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
        """State, counts, ``input_fps``/``answered_fps`` and ``age_ms_p50``/``age_ms_p99``."""
        now = time.monotonic()
        with self._lock:
            ages = np.array(self._ages_ms) if self._ages_ms else None
            return {
                "state": self.state,
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
