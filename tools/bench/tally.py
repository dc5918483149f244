"""Counting one model's answers inside the measured window: correct, wrong (counted as none) and
typed errors, with the latency of every answer. Requests that finish before the window (warm-up)
or after it are not counted.

Used by every load generator of ``duomo bench`` (producers and the in-process engine mode); the
run sums the tallies of a model's producers with ``merge``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tools.bench.answers import is_correct


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.wrong = 0
        self.errors: Counter[str] = Counter()
        self.latencies_ms: list[float] = []
        self.first_error: dict[str, str] = {}  # per kind of error, the first message

    @property
    def counted(self) -> int:
        return self.ok + self.wrong + sum(self.errors.values())

    def add(
        self,
        sent: float,
        done: float,
        start_at: float,
        end_at: float,
        result: Any = None,
        expected: Any = None,
        error: str | None = None,
        message: str = "",
    ) -> None:
        """One answer: ``sent`` (or, in an open loop, when it was due) and ``done`` in wall-clock
        seconds; ``error`` names a failure, else ``result`` is checked against ``expected``."""
        if not start_at <= done <= end_at:
            return
        self.latencies_ms.append((done - sent) * 1e3)
        if error is not None:
            self.errors[error] += 1
            self.first_error.setdefault(error, message[:300])
        elif is_correct(result, expected):
            self.ok += 1
        else:
            self.wrong += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "wrong": self.wrong,
            "errors": dict(self.errors),
            "first_error": self.first_error,
            "latencies_ms": [round(x, 3) for x in self.latencies_ms],
        }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several tallies (``as_dict``) of one model as one."""
    errors: Counter[str] = Counter()
    first_error: dict[str, str] = {}
    for part in parts:
        errors.update(part["errors"])
        for kind, message in part["first_error"].items():
            first_error.setdefault(kind, message)
    return {
        "ok": sum(p["ok"] for p in parts),
        "wrong": sum(p["wrong"] for p in parts),
        "errors": dict(errors),
        "first_error": first_error,
        "latencies_ms": [x for p in parts for x in p["latencies_ms"]],
    }
