"""The idle spin: a model's idle worker polls its lent connections without sleeping for a
while before it sleeps (``supervisor.reactor._poll_spinning_first``), and the engine decides
when it may (``Engine._read_when_idle``: only while it pays and no instance is at work)."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.config import load_config
from supervisor.engine import Engine
from supervisor.reactor import _poll_spinning_first
from tests.unit.test_config import classify, problems, write_config
from worker.thread_budget import Activity

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
    assert _poll_spinning_first(poller, 10.0, asked) == [(r, READABLE)]
    assert asked.at == []


def test_the_wait_spins_until_the_event_comes(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked = Asked()
    write_later(w, 0.05)
    assert _poll_spinning_first(poller, 10.0, asked) == [(r, READABLE)]
    assert len(asked.at) > 1


def test_the_wait_sleeps_once_its_spin_is_over(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked = Asked()
    sent = write_later(w, 0.3)  # long after the spin's 5 ms
    assert _poll_spinning_first(poller, 0.005, asked) == [(r, READABLE)]
    sent.join()
    assert asked.at and asked.at[-1] < time.monotonic() - 0.1


def test_the_wait_asks_at_every_turn_and_sleeps_once_told_to(
    pipe: tuple[select.poll, int, int],
) -> None:
    poller, r, w = pipe
    asked = Asked(times=3)  # work elsewhere begins after three turns
    sent = write_later(w, 0.3)
    assert _poll_spinning_first(poller, 10.0, asked) == [(r, READABLE)]
    sent.join()
    assert len(asked.at) == 4 and asked.at[-1] < time.monotonic() - 0.1


def test_a_spin_of_zero_never_asks(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked = Asked()
    write_later(w, 0.05)
    assert _poll_spinning_first(poller, 0.0, asked) == [(r, READABLE)]
    assert asked.at == []


class RecordingReader:
    """The reactor's ``read_when_idle`` as the engine sees it: it records the spin it is given
    and advances the engine's clock by the next of ``waits_s`` (False: nothing to read)."""

    def __init__(self, engine: Engine, waits_s: list[float | bool]) -> None:
        self.now = 0.0
        self.waits_s = waits_s
        self.spins: list[float] = []
        self.keep_spinning: Callable[[], bool] = lambda: True
        engine._clock = lambda: self.now
        engine.idle_reader = self

    def __call__(self, model: str, fd: int, spin_s: float, keep: Callable[[], bool]) -> bool:
        self.spins.append(spin_s)
        self.keep_spinning = keep
        wait = self.waits_s.pop(0)
        if wait is False:
            return False
        self.now += wait
        return True


def engine_for(tmp_path: Path, idle_spin_us: int = 1000) -> Engine:
    """An engine, not started: its idle reader's policy needs no model loaded."""
    return Engine(load_config(write_config(tmp_path, [classify()], idle_spin_us=idle_spin_us)))


def test_an_idle_worker_spins_while_its_waits_end_within_the_spin(tmp_path: Path) -> None:
    engine = engine_for(tmp_path)
    reader = RecordingReader(engine, [0.5, 0.0004, 0.0008, False, 0.3, 0.2, 0.0001, 0.0])
    for _ in range(8):
        engine._read_when_idle("classify", -1)
    assert reader.spins == [
        0.0,  # the first wait after a load: nothing was answered before it
        0.0,  # after a long wait
        0.001,  # after a short one
        0.001,  # it had nothing to read: the policy stands
        0.001,  # (this one lasts 0.3 s)
        0.0,  # the spin did not pay: none now
        0.0,  # (this one would have ended within it)
        0.001,  # so spin again
    ]
    assert engine._idle_waits["classify"].to_dict() == {"waits": 7, "spun": 3, "caught": 2}


def test_an_idle_worker_stops_spinning_while_any_instance_is_at_work(tmp_path: Path) -> None:
    engine = engine_for(tmp_path)
    reader = RecordingReader(engine, [0.0])
    engine._read_when_idle("classify", -1)
    assert reader.keep_spinning()
    engine.activity.enter()
    assert not reader.keep_spinning()
    engine.activity.leave()
    assert reader.keep_spinning()


def test_no_spin_without_a_reactor_or_when_configured_off(tmp_path: Path) -> None:
    engine = engine_for(tmp_path, idle_spin_us=0)
    assert not engine._read_when_idle("classify", -1)  # no reactor: the batcher sleeps
    reader = RecordingReader(engine, [0.0, 0.0, 0.0])
    for _ in range(3):
        engine._read_when_idle("classify", -1)
    assert reader.spins == [0.0, 0.0, 0.0]


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
