"""``preload_policy: predictive``: which model tends to be asked for after which, learned from
the stream of requests.

Owned by the ``Engine``, which reports every request (``observe``, on the request's path: a
few dict operations) and, when the requested model differs from the one before, loads in the
background the models that ``likely_after`` it with at least ``predictive_threshold`` — when
they fit without evicting a model that is at least as likely (the engine's rule).

The counts are a decayed first-order transition table over the *changes* of model: after a
request for A, the next request for another model B adds 1 to ``A → B``, once every count of A's
row is multiplied by ``DECAY``, so the table follows a shifting access pattern. Repeated
requests for the same model are not transitions. Each model's recent inter-arrival time is kept
beside it for ``status``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DECAY = 0.8  # the weight an old transition keeps each time its row gains a new one
SMOOTHING = 0.2  # of the inter-arrival running mean


class TransitionModel:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rows: dict[str, dict[str, float]] = {}  # from -> to -> decayed count
        self._last: str | None = None
        self._seen: dict[str, float] = {}  # model -> when it was last asked for
        self.gap_s: dict[str, float] = {}  # model -> running mean seconds between its requests

    def observe(self, name: str) -> str | None:
        """A request for ``name``; the model asked for before it, when that was another one
        (a transition), else None."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(name)
            if seen is not None:
                gap, old = now - seen, self.gap_s.get(name)
                self.gap_s[name] = gap if old is None else old + SMOOTHING * (gap - old)
            self._seen[name] = now
            previous, self._last = self._last, name
            if previous is None or previous == name:
                return None
            row = self._rows.setdefault(previous, {})
            for other in row:
                row[other] *= DECAY
            row[name] = row.get(name, 0.0) + 1.0
            return previous

    def likely_after(self, name: str) -> dict[str, float]:
        """The probability of each model being the next other model asked for after
        ``name`` (from the decayed counts; empty before any transition from it)."""
        with self._lock:
            row = dict(self._rows.get(name, {}))
        total = sum(row.values())
        return {other: count / total for other, count in row.items()} if total else {}
