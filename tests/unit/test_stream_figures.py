"""A stream's figures in the supervisor (``supervisor.dataflow.streams``) and the load streams put
on a model (``worker.stream_load``), on a clock the test sets: what the source did with the frames
it did not send counts as its own kind, a reopened stream starts its rates and ages afresh
(its counts go on) and shows only the models it feeds now, ages cover the last 60 s, and a
model's capacity state follows what its streams lose, logged once per change."""

from __future__ import annotations

from typing import Any

import pytest

from duomo.ipc.errors import ErrorCode
from duomo.ipc.stream_settings import StreamSettings
from duomo.supervisor.dataflow.streams import StreamRegistry
from duomo.worker import stream_load
from duomo.worker.stream_load import StreamLoad

OK, SUPERSEDED = ErrorCode.OK, ErrorCode.SUPERSEDED


def figures(registry: StreamRegistry, name: str, now: float) -> dict[str, Any]:
    """Stream ``name``'s status record, as its JSON."""
    [shown] = [s for s in registry.snapshot(now) if s.name == name]
    return shown.to_dict()


def test_the_sources_refusals_and_skips_are_counted_apart_and_refusals_block() -> None:
    registry = StreamRegistry(max_streams=4)
    stream = registry.open("gate", StreamSettings(("m",), policy="fifo"), now=0.0)
    stream.received("m", 0.0)
    stream.answered("m", OK, 0.05, 0.05)
    stream.received("m", 0.1, skipped=4)  # the cap dropped four frames: the camera's choice
    stream.answered("m", OK, 0.05, 0.15)
    shown = figures(registry, "gate", 0.2)
    assert shown["state"] == "running"
    assert shown["models"]["m"]["skipped"] == 4 and shown["models"]["m"]["refused"] == 0
    stream.received("m", 2.0, refused=7, superseded=1)  # the backlog was full: lost frames
    shown = figures(registry, "gate", 2.1)
    assert shown["state"] == "blocked"
    counts = {k: shown["models"]["m"][k] for k in ("frames_in", "refused", "superseded")}
    assert counts == {"frames_in": 3, "refused": 7, "superseded": 1}


def test_a_reopened_stream_starts_its_rates_and_ages_afresh_and_keeps_its_counts() -> None:
    registry = StreamRegistry(max_streams=4)
    stream = registry.open("gate", StreamSettings(("a", "b")), now=0.0)
    for i in range(50):  # a slow first run: every answer 3 s old
        stream.received("a", i * 0.02)
        stream.answered("a", OK, 3.0, i * 0.02)
        stream.received("b", i * 0.02)
    registry.close([stream])
    stream = registry.open("gate", StreamSettings(("a", "c")), now=2.0)
    shown = figures(registry, "gate", 2.0)
    assert list(shown["models"]) == ["a", "c"]  # b is no longer fed: its row is gone
    a = shown["models"]["a"]
    assert (a["frames_in"], a["answered"]) == (50, 50)  # counters go on (Prometheus)
    assert (a["input_fps"], a["answered_fps"], a["age_ms_p99"]) == (0.0, 0.0, None)
    stream.received("a", 2.1)
    stream.answered("a", OK, 0.04, 2.14)
    a = figures(registry, "gate", 2.2)["models"]["a"]
    assert a["age_ms_p50"] == a["age_ms_p99"] == 40.0
    registry.close([stream])
    registry.open("gate", StreamSettings(("b",)), now=3.0)  # b again: its counts are there
    assert figures(registry, "gate", 3.0)["models"]["b"]["frames_in"] == 50


def test_answer_ages_are_those_of_the_last_60_seconds_however_many() -> None:
    registry = StreamRegistry(max_streams=4)
    stream = registry.open("gate", StreamSettings(("m",)), now=0.0)
    for i in range(5000):  # a backlog's answers, 5 s old, long ago
        stream.answered("m", OK, 5.0, i * 0.001)
    for i in range(10):  # then fresh ones, a minute later
        stream.answered("m", OK, 0.05, 65.0 + i * 0.1)
    m = figures(registry, "gate", 66.0)["models"]["m"]
    assert m["age_ms_p50"] == m["age_ms_p99"] == 50.0 and m["answered"] == 5010


def feed(
    load: StreamLoad, streams: int, seconds: float, served_every: int, t0: float = 0.0
) -> float:
    """``streams`` cameras at 20 fps each from ``t0``; the model serves one frame of a camera
    in ``served_every``, the cameras in turn, and the rest are superseded (lost). The time
    the feed ends."""
    for step in range(int(seconds * 20)):
        now = t0 + step * 0.05
        for s in range(streams):
            load.offered(f"cam{s}", 0, now)
            served = (step + s) % served_every == 0
            load.answered(f"cam{s}", served, not served, now)
    return t0 + seconds


class Lines:
    """A logger that keeps what it is told (the module's is bound once, process-wide)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


def test_a_model_is_over_capacity_while_its_streams_lose_frames_logged_once_per_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logged = Lines()
    monkeypatch.setattr(stream_load, "log", logged)
    load = StreamLoad()
    now = feed(load, streams=4, seconds=3.0, served_every=4)  # 80 fps offered, 20 served
    for _ in range(10):  # (the housekeeping checks every 0.1 s)
        reading = load.check("face", now)
    assert reading.state == "over"
    assert reading.offered_fps == 80.0 and reading.served_fps == 20.0
    assert reading.lost_fps == 60.0
    assert set(reading.streams) == {"cam0", "cam1", "cam2", "cam3"}
    assert all(s.share == 0.25 and s.offered_fps == 20.0 for s in reading.streams.values())
    # within capacity again: the window forgets the losses, one line says so
    now = feed(load, streams=1, seconds=6.0, served_every=1, t0=now + 1.0)
    for _ in range(10):
        reading = load.check("face", now)
    assert reading.state == "ok" and list(reading.streams) == ["cam0"]
    assert reading.offered_fps == reading.served_fps == 20.0
    changes = [(e["capacity"], e["was"]) for e in logged.lines if e["event"] == "model capacity"]
    assert changes == [("over", "ok"), ("ok", "over")]


def lose_one_in_13(load: StreamLoad, t0: float) -> float:
    """5 s of one camera at 20 fps whose every 13th frame is lost: 7.7 %, between the
    thresholds."""
    for step in range(100):
        now = t0 + step * 0.05
        load.offered("cam0", 0, now)
        load.answered("cam0", step % 13 != 0, step % 13 == 0, now)
    return t0 + 5.0


def test_a_load_near_the_edge_keeps_its_state() -> None:
    """Between a twentieth and a tenth of the frames lost, the state stays what it was: no
    line per check when the load hovers near the model's capacity."""
    within = StreamLoad()
    now = feed(within, streams=1, seconds=5.0, served_every=1)
    assert within.check("m", now).state == "ok"
    assert within.check("m", lose_one_in_13(within, now)).state == "ok"
    over = StreamLoad()
    now = feed(over, streams=1, seconds=5.0, served_every=3)
    assert over.check("m", now).state == "over"
    assert over.check("m", lose_one_in_13(over, now)).state == "over"


def test_a_quiet_model_reads_as_within_capacity_with_no_stream() -> None:
    reading = StreamLoad().check("m", 100.0)
    assert (reading.state, reading.offered_fps, reading.streams) == ("ok", 0.0, {})
