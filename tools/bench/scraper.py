"""Scraping Duomo's ``/metrics`` while a benchmark mode runs, as Prometheus would. Used by
``tools.bench.mixed_load`` for the ``duomo-scraped`` mode, whose work against ``duomo``'s in the
same run is what a scrape costs serving (the report's target).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any


class MetricsScraper:
    """One thread that GETs every supervisor's ``/metrics`` every ``every_s`` seconds."""

    def __init__(self, ports: list[int], every_s: float) -> None:
        self.ports = ports
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-scraper", daemon=True)
        self._seconds: list[float] = []
        self._bytes = 0
        self._failures = 0

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.every_s
            for port in self.ports:
                started = time.perf_counter()
                try:
                    url = f"http://127.0.0.1:{port}/metrics"
                    with urllib.request.urlopen(url, timeout=10) as reply:
                        self._bytes += len(reply.read())
                except OSError:
                    self._failures += 1
                    continue
                self._seconds.append(time.perf_counter() - started)

    def stop(self) -> dict[str, Any]:
        """End the scrapes; how many there were, their mean and worst time and size."""
        self._stop.set()
        self._thread.join(15)
        count = len(self._seconds)
        return {
            "every_s": self.every_s,
            "count": count,
            "failures": self._failures,
            "mean_ms": sum(self._seconds) / count * 1e3 if count else None,
            "max_ms": max(self._seconds) * 1e3 if count else None,
            "mean_bytes": self._bytes / count if count else None,
        }
