"""The idle spin: what a model's idle worker does instead of sleeping in its batcher, once the
reactor lends it connections (``IdleSpin``, the idle reader of every model's batcher:
``worker.batcher.IdleReader``), and each model's count of those waits (``status``:
``idle_spin``).

The wait polls without sleeping for up to ``idle_spin_us`` before it sleeps, only while that
pays (the model's last wait ended within that time) and only while no instance of the process is
at work (``Activity``); the poll itself is the reactor's lending
(``supervisor.process.lending``: ``Lending.read_when_idle``, handed in with ``read_from`` while
the reactor runs). Owned by the engine, which shows its counts; in-process (no reactor) a model's
idle worker sleeps in its batcher as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# ``Lending.read_when_idle``: (model, wake fd, spin seconds, keep spinning) -> it read
LentReader = Callable[[str, int, float, Callable[[], bool]], bool]


@dataclass
class IdleWaits:
    """One model's waits in the reactor's lending while idle (``status``: ``idle_spin``)."""

    waits: int = 0
    spun: int = 0  # began with a spin
    caught: int = 0  # of those, ended within the spin's time
    pays: bool = False  # the last wait ended within ``idle_spin_us``: the next one spins

    def record(self, spun: bool, within: bool) -> None:
        """A wait that began with a spin or not and ended ``within`` ``idle_spin_us``."""
        self.waits += 1
        self.pays = within
        if spun:
            self.spun += 1
            if within:
                self.caught += 1

    def to_dict(self) -> dict[str, int]:
        return {"waits": self.waits, "spun": self.spun, "caught": self.caught}


class IdleSpin:
    """The idle reader of every model's batcher (``worker.batcher.IdleReader``): a model's idle
    worker waits in the reactor's lending once there is one (before that, and in-process, it
    sleeps in its batcher), spinning first while that pays and nothing else is at work."""

    def __init__(
        self,
        at_rest: Callable[[], bool],
        spin_us: Callable[[], int],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._lending: LentReader | None = None  # the reactor's, while it runs (``read_from``)
        self._at_rest = at_rest  # no instance of the process is at work (``Activity.idle``)
        self._spin_us = spin_us  # ``idle_spin_us``, read at each wait: a reload may change it
        self._clock = clock
        self._waits: dict[str, IdleWaits] = {}  # by model, since start

    def read_from(self, lending: LentReader | None) -> None:
        """Wait in ``lending`` (the reactor's ``Lending.read_when_idle``, while the reactor
        runs) from the next wait on; None: in the batcher again (the reactor stops)."""
        self._lending = lending

    def __call__(self, model: str, wake_fd: int) -> bool:
        lending = self._lending
        if lending is None:
            return False
        waits = self._waits.get(model)
        if waits is None:
            waits = self._waits[model] = IdleWaits()
        window_s = self._spin_us() / 1e6
        spin_s = window_s if waits.pays else 0.0
        start = self._clock()
        read = lending(model, wake_fd, spin_s, self._at_rest)
        if read:  # it waited: did (or would) a spin see the wait's end?
            waits.record(spun=spin_s > 0, within=self._clock() - start <= window_s)
        return read

    def counts(self, model: str) -> dict[str, int]:
        """``model``'s waits, the spins among them and the spins that caught a notice."""
        return (self._waits.get(model) or IdleWaits()).to_dict()
