"""Streams as operators see them, on real supervisor processes: ``/metrics``' ``duomo_stream_*``
counts equal what the producer's answers say, exactly (frames superseded at the source
included), and a stream's liveness goes starting → running → blocked → running → stalled →
ended, each state seen in ``status`` (and ``duomo status``) and logged once.

The model is the test-only executor held to a known pace (``work_ms``: 20 answers/s, one at a
time), fed raw float32 N×4 frames."""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from duomo.ipc.client import Client
from duomo.ipc.runtime_dir import log_path
from duomo.ipc.status_records import StreamStatus
from duomo.ipc.stream import Stream, StreamAnswer
from tests.integration.harness import (
    duomo,
    faulty_model,
    free_port,
    logged_events,
    poll,
    running_supervisor,
    short_socket_dir,
    write_config,
)
from tests.integration.test_metrics import Samples, scrape, value
from tests.unit.test_grafana_dashboard import dashboard_metric_names

pytestmark = pytest.mark.integration
FRAME = {"x": np.ones((1, 4), dtype=np.float32)}
PACED = faulty_model("paced", max_batch=1, queue_size=2, params={"work_ms": 50})


def answers_of(cam: Stream) -> collections.Counter[str]:
    """Close ``cam`` (every frame sent and waiting is answered first) and count its answers
    by outcome."""
    cam.close(drain_s=30)
    taken: list[StreamAnswer] = cam.poll()
    assert all(a.stream == cam.name for a in taken)
    return collections.Counter(a.outcome for a in taken)


def stream_of(client: Client, name: str) -> StreamStatus:
    status = client.status()
    [stream] = [s for s in status.streams if s.name == name]
    return stream


def counted(samples: Samples, stream: str, model: str = "paced") -> dict[str, float]:
    """The stream's four counters in a scrape."""
    return {
        kind: value(samples, f"duomo_stream_{kind}_total", stream=stream, model=model)
        for kind in ("frames", "answered", "superseded", "refused")
    }


def test_the_metrics_count_exactly_what_the_producer_was_answered(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, [], extra=[PACED], metrics={"http": f"127.0.0.1:{port}"})
    with running_supervisor(config) as sup, Client(sup.socket) as client:
        assert not any(name.startswith("duomo_stream") for name, _ in scrape(port))

        # fifo into a queue of 2: every frame reaches the supervisor, the overflow is refused
        cam = client.stream("fifo-cam", models=["paced"], policy="fifo", slots=6)
        sent = sum(cam.send(FRAME) for _ in range(30))
        fifo = answers_of(cam)
        assert sent == 30 and fifo["OK"] >= 3 and fifo["RESOURCE_EXHAUSTED"] >= 1
        assert set(fifo) == {"OK", "RESOURCE_EXHAUSTED"}
        assert counted(scrape(port), "fifo-cam") == {
            "frames": 30, "answered": fifo["OK"], "superseded": 0,
            "refused": fifo["RESOURCE_EXHAUSTED"],
        }  # fmt: skip

        # latest with one slot: each frame sent while the slot is busy replaces the one
        # waiting at the source, which the next frame sent tells the supervisor about
        cam = client.stream("one-slot", models=["paced"], slots=1)
        sent = sum(cam.send(FRAME) for _ in range(20))
        one = answers_of(cam)
        assert one["SUPERSEDED"] >= 10 and set(one) == {"OK", "SUPERSEDED"}
        assert counted(scrape(port), "one-slot") == {
            "frames": sent - one["SUPERSEDED"], "answered": one["OK"],
            "superseded": one["SUPERSEDED"], "refused": 0,
        }  # fmt: skip

        # latest with three slots, at 4× the model's pace: superseded in the queue (and maybe
        # at the source too), never refused
        cam = client.stream("latest-cam", models=["paced"], fps=80.0, slots=3)
        sent = 0
        for _ in range(60):
            sent += cam.send(FRAME)
            time.sleep(1 / 80)
        latest = answers_of(cam)
        assert latest["SUPERSEDED"] >= 20 and set(latest) == {"OK", "SUPERSEDED"}
        samples = scrape(port)
        figures = counted(samples, "latest-cam")
        assert figures["answered"] == latest["OK"]
        assert figures["superseded"] == latest["SUPERSEDED"]
        assert figures["refused"] == 0
        # (frames that reached it: all but those superseded at the source)
        assert latest["OK"] + latest["SUPERSEDED"] == sent
        assert sent - latest["SUPERSEDED"] <= figures["frames"] <= sent

        # status says the same, and each stream's other series are there
        status = client.status()
        assert [s.name for s in status.streams] == ["fifo-cam", "latest-cam", "one-slot"]
        for stream in status.streams:
            assert stream.state == "ended"
            f = stream.models["paced"]
            assert counted(samples, stream.name) == {
                "frames": f.frames_in, "answered": f.answered, "superseded": f.superseded,
                "refused": f.refused,
            }  # fmt: skip
            states = {
                state: value(samples, "duomo_stream_state", stream=stream.name, state=state)
                for state in ("starting", "running", "blocked", "stalled", "ended")
            }
            assert states == {**dict.fromkeys(states, 0.0), "ended": 1.0}
            labels = {"stream": stream.name, "model": "paced"}
            assert value(samples, "duomo_stream_input_fps", **labels) > 0
            assert value(samples, "duomo_stream_answered_fps", **labels) > 0
            p50 = value(samples, "duomo_stream_age_ms", **labels, quantile="0.5")
            p99 = value(samples, "duomo_stream_age_ms", **labels, quantile="0.99")
            assert 50 <= p50 <= p99  # no answer comes sooner than the model's 50 ms
        assert status.streams[1].fps_nominal == 80.0 and status.streams[1].policy == "latest"
        # the Grafana dashboard's stream panels ask only for what is exposed
        exposed = {name for name, _ in samples}
        asked = {name for name in dashboard_metric_names() if name.startswith("duomo_stream_")}
        assert asked <= exposed, asked - exposed


class Sender:
    """A thread sending frames on ``cam`` every ``period_s`` (None: none), until ``stop``."""

    def __init__(self, cam: Stream) -> None:
        self.cam = cam
        self.period_s: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)

    def __enter__(self) -> Sender:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stopped.is_set():
            period_s = self.period_s
            if period_s is None:
                time.sleep(0.01)
                continue
            self.cam.send(FRAME)
            self.cam.poll()  # (the answers are not what this test reads)
            time.sleep(period_s)


@contextlib.contextmanager
def background_supervisor(config: Path) -> Iterator[Path]:
    """``duomo start`` (in the background, logging to its log file); ``duomo stop`` after."""
    folder = short_socket_dir()
    socket_path = folder / "duomo.sock"
    started = duomo(socket_path, "start", "-c", str(config))
    assert started.returncode == 0, started.stderr
    try:
        yield socket_path
    finally:
        stopped = duomo(socket_path, "stop")
        assert stopped.returncode == 0, stopped.stderr


def logged_states(socket_path: Path, stream: str) -> list[str]:
    """Each "stream state" line the supervisor logged for ``stream``: its new state."""
    events = logged_events(log_path(socket_path), "stream state")
    return [e["state"] for e in events if e.get("stream") == stream]


def test_a_stream_goes_through_each_state_once_seen_in_status_and_logged(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, [], extra=[PACED])
    with background_supervisor(config) as socket_path, Client(socket_path) as client:
        cam = client.stream("gate-3", models=["paced"], stall_after_s=0.5, slots=3)
        seen = [stream_of(client, "gate-3").state]  # opened, nothing sent yet
        assert seen == ["starting"]
        with Sender(cam) as sender:
            for state, period_s in (
                ("running", 0.1),  # 10 fps into a model that answers 20/s
                ("blocked", 0.005),  # 200 fps: frames superseded
                ("running", 0.1),  # a second without a frame superseded or refused
                ("stalled", None),  # no frame for stall_after_s
            ):
                sender.period_s = period_s
                poll(lambda s=state: stream_of(client, "gate-3").state == s, timeout_s=20)
                seen.append(state)
                # held until it is logged too: the supervisor checks every 0.1 s
                poll(lambda: len(logged_states(socket_path, "gate-3")) == len(seen) - 1)

        shown = duomo(socket_path, "status", "--json")
        [stream] = [s for s in json.loads(shown.stdout)["streams"] if s["name"] == "gate-3"]
        assert stream["state"] == "stalled" and stream["models"]["paced"]["superseded"] > 0
        table = duomo(socket_path, "status")
        [row] = [line for line in table.stdout.splitlines() if line.startswith("gate-3 ")]
        assert row.split()[:4] == ["gate-3", "stalled", "paced", "latest"]

        cam.close()
        assert stream_of(client, "gate-3").state == "ended"
        seen.append("ended")
        poll(lambda: len(logged_states(socket_path, "gate-3")) == len(seen) - 1)
        time.sleep(0.3)  # (three more checks by the supervisor: nothing more is logged)
        assert logged_states(socket_path, "gate-3") == seen[1:] == [
            "running", "blocked", "running", "stalled", "ended",
        ]  # fmt: skip


def test_frames_the_source_refuses_or_skips_reach_the_supervisors_figures(tmp_path: Path) -> None:
    """Issue 43: the supervisor showed a fifo camera ``running``, ``refused 0``, while 63 % of
    its frames were refused ``backlog full`` at the source. Now the source's refusals count as
    ``refused`` (the stream ``blocked`` meanwhile) and a cap's drops as ``skipped`` (a choice,
    not trouble: the capped stream stays ``running``), in ``status`` and ``/metrics``."""
    port = free_port()
    roomy = {**PACED, "queue_size": 8}  # (the model's queue never refuses: the source does)
    config = write_config(tmp_path, [], extra=[roomy], metrics={"http": f"127.0.0.1:{port}"})
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=30) as client:
        # 100 frames/s into a model that answers 20: two in flight, eight waiting, the rest
        # refused at the source
        fifo = client.stream("fifo-cam", models=["paced"], policy="fifo", slots=2, backlog=8)
        capped = client.stream("capped-cam", models=["paced"], max_fps=2.0)
        refused_seen: list[StreamStatus] = []
        skipped_before_last_sent = kept = 0
        start = time.monotonic()
        for i in range(300):  # 3 s
            time.sleep(max(0.0, start + i / 100 - time.monotonic()))
            fifo.send(FRAME)
            sent = capped.send(FRAME)
            kept += sent
            skipped_before_last_sent = 0 if sent else skipped_before_last_sent + 1
            if i % 25 == 24:
                shown = stream_of(client, "fifo-cam")
                if shown.models["paced"].refused:
                    refused_seen.append(shown)
                    assert shown.state == "blocked"  # never running while it loses frames
            if i == 250:
                assert stream_of(client, "capped-cam").state == "running"
        fifo_outcomes = answers_of(fifo)
        capped_outcomes = answers_of(capped)
        status = client.status()
        samples = scrape(port)

    shown = {s.name: s.models["paced"] for s in status.streams}
    at_source = fifo_outcomes["RESOURCE_EXHAUSTED"]  # backlog full (the queue has room)
    assert at_source >= 100 and refused_seen, fifo_outcomes
    # every frame it was handed is counted: answered, or refused at the source
    assert fifo_outcomes["OK"] + at_source == 300
    fifo_figures = shown["fifo-cam"]
    assert (fifo_figures.answered, fifo_figures.refused) == (fifo_outcomes["OK"], at_source)
    assert (fifo_figures.frames_in, fifo_figures.skipped) == (fifo_outcomes["OK"], 0)
    refused_total = value(samples, "duomo_stream_refused_total", stream="fifo-cam", model="paced")
    assert refused_total == at_source

    # the cap kept about 2 frames a second; the frames it dropped before the last one sent
    # are in the figures (those after it have no frame to ride on)
    assert 5 <= kept <= 8 and capped_outcomes == {"OK": kept}
    skipped = 300 - kept - skipped_before_last_sent
    assert (shown["capped-cam"].skipped, shown["capped-cam"].refused) == (skipped, 0)
    assert (
        value(samples, "duomo_stream_skipped_total", stream="capped-cam", model="paced") == skipped
    )


OTHER = faulty_model("other", max_batch=1, params={"work_ms": 10})


def test_a_reopened_stream_starts_afresh_and_leaves_a_model_it_no_longer_feeds(
    tmp_path: Path,
) -> None:
    """Issue 43: a reopened stream name showed the last run's p99 (71 s) for minutes, and rows
    of models no longer fed stayed. Now a reopened stream's rates and ages start afresh (its
    counters go on, as Prometheus needs), and only the models it feeds now have rows."""
    port = free_port()
    config = write_config(tmp_path, [], extra=[PACED, OTHER], metrics={"http": f"127.0.0.1:{port}"})
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=30) as client:
        backlog = client.stream("dock", models=["paced"], policy="fifo", slots=2, backlog=64)
        for _ in range(40):  # a burst: the last answer waits 40 × 50 ms
            backlog.send(FRAME)
        first = answers_of(backlog)
        assert first == {"OK": 40}
        old = stream_of(client, "dock").models["paced"]
        assert old.age_ms_p99 is not None and old.age_ms_p99 >= 1500 and old.input_fps > 5

        elsewhere = client.stream("dock", models=["other"], fps=5.0)  # reopened: other models
        for _ in range(5):
            elsewhere.send(FRAME)
            time.sleep(0.2)
        assert answers_of(elsewhere) == {"OK": 5}
        moved = stream_of(client, "dock")
        samples = scrape(port)
        assert list(moved.models) == ["other"]  # paced is no longer fed: no row
        assert (
            "duomo_stream_frames_total",
            frozenset({("stream", "dock"), ("model", "paced")}),
        ) not in samples
        assert value(samples, "duomo_stream_frames_total", stream="dock", model="other") == 5

        again = client.stream("dock", models=["paced"], fps=5.0)  # back: fresh, counts go on
        for _ in range(3):
            again.send(FRAME)
            time.sleep(0.2)
        assert answers_of(again) == {"OK": 3}
        back = stream_of(client, "dock").models["paced"]
        samples = scrape(port)

    assert (back.frames_in, back.answered) == (43, 43)
    assert value(samples, "duomo_stream_frames_total", stream="dock", model="paced") == 43
    assert back.age_ms_p99 is not None and back.age_ms_p99 < 400, back  # not the backlog's
    assert back.input_fps < 8 and back.answered_fps < 8, back  # 3 frames at 5/s, not 43
