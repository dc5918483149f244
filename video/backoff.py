"""The reconnect schedule of a live source: exponential backoff, 0.5 s doubling to 10 s.

A source that drops (or never opens) waits ``next_delay_s()`` before each new attempt; a frame
decoded after reconnecting calls ``reset()``, so the next drop starts again at the first delay.
Owned by one ``VideoSource`` decode thread; not shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0


@dataclass
class Backoff:
    """Delays of ``first_s``, doubling each attempt, never above ``max_s``."""

    first_s: float = FIRST_DELAY_S
    max_s: float = MAX_DELAY_S
    factor: float = 2.0
    attempts: int = field(default=0, init=False)  # since the last success

    def next_delay_s(self) -> float:
        """The wait before the next attempt (and count that attempt)."""
        delay = min(self.first_s * self.factor**self.attempts, self.max_s)
        self.attempts += 1
        return delay

    def reset(self) -> None:
        """The source plays again: the next drop starts from ``first_s``."""
        self.attempts = 0
