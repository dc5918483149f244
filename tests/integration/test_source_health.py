"""A managed source's health and time against real RTSP cameras (issue 43, items 4 and 5):
``duomo camera-sim`` serves them — a good one, a path it does not serve (404), damaged slices, a
camera stopped and started again, a clock of its own — and a real supervisor plays them as
sources added at run time, shown the way a user sees them: ``duomo source list --json`` and
``duomo source tail``'s JSON lines.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import poll
from tests.integration.harness import (
    SupervisorProcess,
    duomo,
    free_port,
    running_supervisor,
    stop_gracefully,
    write_config,
)
from tests.integration.video_fixtures import (
    camera_sim,
    make_clip,
    require_camera_sim,
    start_camera_sim,
)

pytestmark = pytest.mark.integration

FPS = 50  # the simulator's: FFmpeg holds a frame until the next begins, so its clock is read
#           one frame late (20 ms here; measured within 5.4 ms of that)
CLOCK_OFFSET_S = -3600.0  # the camera's clock, an hour behind this host's
CLOCK_WITHIN_S = 0.050


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(tmp_path_factory.mktemp("clips") / "gate.mp4", seconds=2.0, fps=FPS)


@pytest.fixture(scope="module")
def sup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    require_camera_sim()
    config = write_config(tmp_path_factory.mktemp("health"), ["classify"])
    with running_supervisor(config) as supervisor:
        yield supervisor


def add(sup: SupervisorProcess, name: str, url: str, *options: str) -> None:
    done = duomo(sup.socket, "source", "add", name, url, "--model", "classify", *options)
    assert done.returncode == 0, done.stderr


def remove(sup: SupervisorProcess, name: str) -> None:
    assert duomo(sup.socket, "source", "remove", name).returncode == 0


def source(sup: SupervisorProcess, name: str) -> dict[str, Any]:
    done = duomo(sup.socket, "source", "show", name, "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def tail(sup: SupervisorProcess, name: str, count: int) -> list[tuple[float, dict[str, Any]]]:
    """``duomo source tail NAME --count N``'s lines, each with the time it was read."""
    read: list[tuple[float, dict[str, Any]]] = []
    command = [sys.executable, "-m", "duomo.supervisor", "source", "tail", name, "--count",
               str(count), "--socket", str(sup.socket)]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        for line in process.stdout:
            read.append((time.time(), json.loads(line)))
    assert process.returncode == 0 and len(read) == count
    return read


def test_a_wrong_path_and_a_refused_port_fail_with_the_reason(
    sup: SupervisorProcess, clip: Path
) -> None:
    with camera_sim([clip]) as sim:
        add(sup, "typo-path", sim.url("/no-such-camera"))
        add(sup, "no-camera", f"rtsp://127.0.0.1:{free_port()}/gate", "--failed-after", "5")
        # a permanent error fails within three attempts (0.5 + 1 + 2 s); an outage once it
        # has lasted failed_after_s (30 s by default; 5 here)
        poll(lambda: source(sup, "typo-path")["state"] == "failed", timeout_s=30)
        typo = source(sup, "typo-path")
        assert "no such path (404 Not Found)" in typo["last_error"], typo
        assert typo["reconnects"] >= 3 and typo["decoded"] == 0
        refused = source(sup, "no-camera")
        assert refused["state"] == "reconnecting" and "Connection refused" in refused["last_error"]
        poll(lambda: source(sup, "no-camera")["state"] == "failed", timeout_s=30)
        remove(sup, "typo-path")
        remove(sup, "no-camera")


def test_damaged_slices_are_counted_and_not_sent(sup: SupervisorProcess, clip: Path) -> None:
    with camera_sim([clip]) as sim:
        add(sup, "damaged", sim.url("/gate/corrupt"))
        poll(lambda: source(sup, "damaged")["decode_errors"] >= 5, timeout_s=60)
        damaged = source(sup, "damaged")
        # one frame in five is damaged: never sent, so answered + damaged <= decoded
        assert damaged["state"] == "playing" and damaged["answered"] > 0
        assert damaged["decode_errors"] <= damaged["decoded"] / 3, damaged
        remove(sup, "damaged")


def test_a_camera_stopped_and_started_again_reconnects_and_counts_on(
    sup: SupervisorProcess, clip: Path
) -> None:
    sim = start_camera_sim([clip])
    try:
        add(sup, "door", sim.url("/gate"), "--max-fps", "10")
        poll(lambda: source(sup, "door")["state"] == "playing", timeout_s=30)
        before = [line["frame"] for _, line in tail(sup, "door", 5)]
        port = sim.port
        stop_gracefully(sim.process)
        poll(lambda: source(sup, "door")["state"] == "reconnecting", timeout_s=30)
        sim = start_camera_sim([clip], port=port)
        poll(lambda: source(sup, "door")["state"] == "playing", timeout_s=60)
        after = [line["frame"] for _, line in tail(sup, "door", 5)]
        shown = source(sup, "door")
        assert shown["reconnects"] >= 1 and shown["last_error"] is None
        # the frame index keeps counting across the reconnection: it never goes back
        assert before == sorted(before) and after == sorted(after) and after[0] > before[-1]
        remove(sup, "door")
    finally:
        stop_gracefully(sim.process)


@pytest.mark.serial  # clocks compared within 50 ms
def test_answers_carry_the_cameras_clock_when_it_sends_reports(
    sup: SupervisorProcess, clip: Path
) -> None:
    with (
        camera_sim([clip], "--fps", str(FPS), "--clock-offset-s", str(CLOCK_OFFSET_S)) as timed,
        camera_sim([clip], "--fps", str(FPS), "--no-sender-reports") as silent,
    ):
        # (answered at 10 fps: a model over capacity beside two 50 fps decoders on two cores
        # made a decoder 77 ms late once, past the bound; the clock is the subject, not it)
        add(sup, "timed", timed.url("/gate"), "--max-fps", "10")
        add(sup, "silent", silent.url("/gate"), "--max-fps", "10")
        poll(lambda: source(sup, "timed")["answered"] >= 10, timeout_s=60)
        poll(lambda: source(sup, "silent")["answered"] >= 10, timeout_s=60)
        timed_lines = [(t, line) for t, line in tail(sup, "timed", 20) if "result" in line]
        for read_at, line in timed_lines:
            assert line["clock"] == "camera", line
            captured = _utc(line["captured_at"])
            decoded_at = read_at - line["age_ms"] / 1e3  # (this host's clock)
            late = decoded_at + CLOCK_OFFSET_S - captured  # the decoder after the camera
            assert 0 <= late <= 1 / FPS + CLOCK_WITHIN_S, (late, line)
            assert line["pts"] is not None and line["pts"] >= 0
        for read_at, line in tail(sup, "silent", 10):
            assert line["clock"] == "arrival", line
            assert abs(read_at - line["age_ms"] / 1e3 - _utc(line["captured_at"])) < 0.05
        remove(sup, "timed")
        remove(sup, "silent")


def _utc(rfc3339: str) -> float:
    assert rfc3339.endswith("Z") and len(rfc3339) == 24, rfc3339
    return datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
