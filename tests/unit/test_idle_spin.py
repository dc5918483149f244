"""The idle spin: a model's idle worker polls its lent connections without sleeping for a
while before it sleeps (``supervisor.process.lending.poll_spinning_first``), and ``IdleSpin``
decides when it may: only while it pays and no instance of the process is at work."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from duomo.supervisor.core.idle_spin import IdleSpin
from duomo.supervisor.process.lending import poll_spinning_first
from duomo.worker.model_worker import Activity
from tests.unit.test_config import classify, problems, write_config

READABLE = select.POLLIN


@pytest.fixture
def pipe() -> Iterator[tuple[select.poll, int, int]]:
    r, w = os.pipe()
    poller = select.poll()
    poller.register(r, select.POLLIN)
    yield poller, r, w
    os.close(r)
    os.close(w)


def write_later(fd: int, after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, os.write, (fd, b"x"))
    timer.start()
    return timer


class Asked:
    """A ``keep_spinning`` that answers True ``times`` times, then False; it notes when."""

    def __init__(self, times: int = 1_000_000_000) -> None:
        self.times = times
        self.at: list[float] = []

    def __call__(self) -> bool:
        self.at.append(time.monotonic())
        return len(self.at) <= self.times


def test_no_spin_when_the_event_is_already_there(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    os.write(w, b"x")
    asked = Asked()
    assert poll_spinning_first(poller, 10.0, asked) == [(r, READABLE)]
    assert asked.at == []


def test_the_wait_spins_until_the_event_comes(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked = Asked()
    write_later(w, 0.05)
    assert poll_spinning_first(poller, 10.0, asked) == [(r, READABLE)]
    assert len(asked.at) > 1


def test_the_wait_sleeps_once_its_spin_is_over(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked = Asked()
    sent = write_later(w, 0.3)  # long after the spin's 5 ms
    assert poll_spinning_first(poller, 0.005, asked) == [(r, READABLE)]
    sent.join()
    assert asked.at and asked.at[-1] < time.monotonic() - 0.1


def test_the_wait_asks_at_every_turn_and_sleeps_once_told_to(
    pipe: tuple[select.poll, int, int],
) -> None:
    poller, r, w = pipe
    asked = Asked(times=3)  # work elsewhere begins after three turns
    sent = write_later(w, 0.3)
    assert poll_spinning_first(poller, 10.0, asked) == [(r, READABLE)]
    sent.join()
    assert len(asked.at) == 4 and asked.at[-1] < time.monotonic() - 0.1


def test_a_spin_of_zero_never_asks(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked = Asked()
    write_later(w, 0.05)
    assert poll_spinning_first(poller, 0.0, asked) == [(r, READABLE)]
    assert asked.at == []


class RecordingLending:
    """The reactor's ``Lending.read_when_idle`` as the spin sees it: it records the spin it is
    given and advances the spin's clock by the next of ``waits_s`` (False: nothing to read)."""

    def __init__(self, waits_s: list[float | bool]) -> None:
        self.now = 0.0
        self.waits_s = waits_s
        self.spins: list[float] = []
        self.keep_spinning: Callable[[], bool] = lambda: True

    def __call__(self, model: str, fd: int, spin_s: float, keep: Callable[[], bool]) -> bool:
        self.spins.append(spin_s)
        self.keep_spinning = keep
        wait = self.waits_s.pop(0)
        if wait is False:
            return False
        self.now += wait
        return True


def spin_over(
    lending: RecordingLending, activity: Activity | None = None, idle_spin_us: int = 1000
) -> IdleSpin:
    spin = IdleSpin((activity or Activity()).idle, lambda: idle_spin_us, lambda: lending.now)
    spin.read_from(lending)
    return spin


def test_an_idle_worker_spins_while_its_waits_end_within_the_spin() -> None:
    lending = RecordingLending([0.5, 0.0004, 0.0008, False, 0.3, 0.2, 0.0001, 0.0])
    spin = spin_over(lending)
    for _ in range(8):
        spin("classify", -1)
    assert lending.spins == [
        0.0,  # the first wait after a load: nothing was answered before it
        0.0,  # after a long wait
        0.001,  # after a short one
        0.001,  # it had nothing to read: the policy stands
        0.001,  # (this one lasts 0.3 s)
        0.0,  # the spin did not pay: none now
        0.0,  # (this one would have ended within it)
        0.001,  # so spin again
    ]
    assert spin.counts("classify") == {"waits": 7, "spun": 3, "caught": 2}
    assert spin.counts("face") == {"waits": 0, "spun": 0, "caught": 0}


def test_an_idle_worker_stops_spinning_while_any_instance_is_at_work() -> None:
    lending, activity = RecordingLending([0.0]), Activity()
    spin_over(lending, activity)("classify", -1)
    assert lending.keep_spinning()
    activity.enter()
    assert not lending.keep_spinning()
    activity.leave()
    assert lending.keep_spinning()


def test_no_spin_without_a_reactor_or_when_configured_off() -> None:
    lending = RecordingLending([0.0, 0.0, 0.0])
    spin = spin_over(lending, idle_spin_us=0)
    for _ in range(3):
        spin("classify", -1)
    assert lending.spins == [0.0, 0.0, 0.0]
    spin.read_from(None)
    assert not spin("classify", -1)  # no reactor: the batcher sleeps


def test_the_engine_spins_by_its_config_and_its_instances(tmp_path: Path) -> None:
    """The engine's ``IdleSpin``: the supervisor hands it the reactor's lending through
    ``IdleSpin.read_from``; the window is the config's ``idle_spin_us``, read at each wait (a
    reload may change it); the instances at work are the engine's."""
    path = write_config(tmp_path, [classify()], idle_spin_us=10_000)
    engine = Engine(load_config(path))
    assert not engine.idle_spin("classify", -1)  # no reactor yet
    lending = RecordingLending([0.0, 0.0])
    engine.idle_spin.read_from(lending)
    engine.idle_spin("classify", -1)
    engine.idle_spin("classify", -1)
    assert lending.spins == [0.0, 0.01]  # (the first wait after a load never spins)
    engine.activity.enter()
    assert not lending.keep_spinning()
    engine.activity.leave()
    engine.idle_spin.read_from(None)
    assert not engine.idle_spin("classify", -1)


def test_idle_spin_us_is_bounded(tmp_path: Path) -> None:
    for bad in (-1, 10_001):
        found = problems(write_config(tmp_path, [classify()], idle_spin_us=bad))
        assert [field for field, _ in found] == ["idle_spin_us"]


def test_activity_counts_instances_at_work() -> None:
    activity = Activity()
    assert activity.idle()
    activity.enter()
    activity.enter()
    activity.leave()
    assert not activity.idle()
    activity.leave()
    assert activity.idle()
