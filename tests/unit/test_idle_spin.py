"""The idle spin: a model's idle worker polls its lent connections without sleeping for a
while before it sleeps (``supervisor.reactor._poll``), and the engine decides when it may
(``Engine._read_when_idle``: only while it pays and no instance serves a batch)."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from supervisor.config import load_config
from supervisor.engine import Engine
from supervisor.reactor import _poll
from tests.unit.test_config import classify, problems, write_config


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


def test_the_wait_spins_until_the_event_or_the_end_of_its_time(
    pipe: tuple[select.poll, int, int],
) -> None:
    poller, r, w = pipe
    asked: list[float] = []

    def keep_spinning() -> bool:
        asked.append(time.monotonic())
        return True

    write_later(w, 0.02).join()  # already readable: no spin at all
    assert _poll(poller, 10.0, keep_spinning) == [(r, select.POLLIN)] and asked == []
    os.read(r, 1)

    write_later(w, 0.05)  # comes while it spins
    assert _poll(poller, 10.0, keep_spinning) == [(r, select.POLLIN)]
    assert len(asked) > 1
    os.read(r, 1)

    asked.clear()
    sent = write_later(w, 0.3)  # comes long after the spin's 5 ms: it slept for it
    assert _poll(poller, 0.005, keep_spinning) == [(r, select.POLLIN)]
    sent.join()
    assert asked and asked[-1] < time.monotonic() - 0.1


def test_the_wait_sleeps_at_once_when_it_may_not_spin(pipe: tuple[select.poll, int, int]) -> None:
    poller, r, w = pipe
    asked: list[int] = []

    def busy_elsewhere() -> bool:
        asked.append(1)
        return False

    write_later(w, 0.05)
    assert _poll(poller, 10.0, busy_elsewhere) == [(r, select.POLLIN)]
    assert asked == [1]  # one look, then asleep until the event
    os.read(r, 1)
    write_later(w, 0.05)
    assert _poll(poller, 0.0, busy_elsewhere) == [(r, select.POLLIN)]  # no spin configured
    assert asked == [1]


def recording_engine(
    tmp_path: Path, waits_s: list[float]
) -> tuple[Engine, list[float], Callable[[], bool]]:
    """An engine (not started) whose idle reader records the spin it is given and waits
    ``waits_s`` in turn; the third value is that reader's last ``keep_spinning``."""
    engine = Engine(load_config(write_config(tmp_path, [classify()], idle_spin_us=20_000)))
    spins: list[float] = []
    last: list[Callable[[], bool]] = []

    def reader(model: str, wake_fd: int, spin_s: float, keep_spinning: Callable[[], bool]) -> bool:
        spins.append(spin_s)
        last[:] = [keep_spinning]
        time.sleep(waits_s.pop(0))
        return True

    engine.idle_reader = reader
    return engine, spins, lambda: last[0]()


def test_an_idle_worker_spins_while_its_waits_end_within_the_spin(tmp_path: Path) -> None:
    engine, spins, _ = recording_engine(tmp_path, [0.0, 0.2, 0.2, 0.0, 0.0])
    for _ in range(5):
        assert engine._read_when_idle("classify", -1)
    # a short wait, a long one (the spin did not pay: none next time), a long one while not
    # spinning, a short one (it would have paid: spin again)
    assert spins == [0.02, 0.02, 0.0, 0.0, 0.02]


def test_an_idle_worker_stops_spinning_while_any_instance_serves_a_batch(tmp_path: Path) -> None:
    engine, _, keep_spinning = recording_engine(tmp_path, [0.0])
    engine._read_when_idle("classify", -1)
    assert keep_spinning()
    worker = SimpleNamespace(busy_since=None)
    engine.models["other"] = SimpleNamespace(workers=[worker])  # type: ignore[assignment]
    assert keep_spinning()
    worker.busy_since = time.monotonic()
    assert not keep_spinning()


def test_no_spin_without_a_reactor_and_none_when_configured_off(tmp_path: Path) -> None:
    engine = Engine(load_config(write_config(tmp_path, [classify()], idle_spin_us=0)))
    assert not engine._read_when_idle("classify", -1)  # no reactor: the batcher sleeps
    spins: list[float] = []
    engine.idle_reader = lambda model, fd, spin_s, keep: spins.append(spin_s) is None
    engine._read_when_idle("classify", -1)
    engine._read_when_idle("classify", -1)
    assert spins == [0.0, 0.0]
    found = problems(write_config(tmp_path, [classify()], idle_spin_us=-1))
    assert [field for field, _ in found] == ["idle_spin_us"]
