"""``duomo stream rtsp://…`` against a real RTSP camera that goes away and comes back.

``duomo camera-sim`` (GStreamer's RTSP server, run by Debian's python3 with ``gi``) serves the
test video; ``duomo stream`` feeds it into the demo's ``face``. The server is stopped mid-run:
no frame comes, the supervisor shows the stream ``stalled`` and the source logs its reconnect
attempts; the server comes back on the same port: the source reconnects (backoff 0.5 s doubling,
at most 10 s) and the stream is ``running`` again, with answers to new frames.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.harness import (
    SupervisorProcess,
    duomo,
    poll,
    running_supervisor,
    stop_gracefully,
    write_config,
)
from tests.integration.video_fixtures import make_test_video, require_camera_sim, start_camera_sim

# frames sent a second: the camera runs at 15, faster than face answers on a slow 2-core
# machine (60-85 ms a frame), where the stream would be rightly shown ``blocked``, not running
SENT_FPS = 5


@pytest.fixture(scope="session")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_video(tmp_path_factory.getbasetemp() / "videos")


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = write_config(tmp_path_factory.mktemp("rtsp-source"), ["face"])
    with running_supervisor(config) as sup:
        yield sup


def stream_state(sup: SupervisorProcess, name: str) -> str | None:
    shown = duomo(sup.socket, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    states = {s["name"]: s["state"] for s in json.loads(shown.stdout).get("streams", [])}
    return states.get(name)


def answered_frames(path: Path) -> list[int]:
    if not path.is_file():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    return [line["frame"] for line in lines if "result" in line]


def test_a_camera_that_goes_away_stalls_and_comes_back_running(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    require_camera_sim()
    out, log = tmp_path / "answers.jsonl", tmp_path / "stream.log"
    camera = start_camera_sim([video])  # on a free port; it comes back on the same one
    with log.open("w") as log_file:
        source = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "stream",
             camera.url("/street"), "--model", "face", "--name", "cam",
             "--max-fps", str(SENT_FPS), "--stall-after", "1.5", "--out", str(out),
             "--socket", str(supervisor.socket)],
            cwd=ROOT, stderr=log_file,
        )  # fmt: skip
    try:
        poll(lambda: len(answered_frames(out)) >= 10, timeout_s=60)
        poll(lambda: stream_state(supervisor, "cam") == "running", timeout_s=30)

        stop_gracefully(camera.process)
        poll(lambda: stream_state(supervisor, "cam") == "stalled", timeout_s=30)
        poll(lambda: "reconnecting" in log.read_text(), timeout_s=10)
        last_before = max(answered_frames(out))

        camera = start_camera_sim([video], port=camera.port)
        poll(lambda: max(answered_frames(out)) >= last_before + 10, timeout_s=60)
        poll(lambda: stream_state(supervisor, "cam") == "running", timeout_s=30)
        assert "reconnected" in log.read_text()

        source.send_signal(signal.SIGTERM)
        assert source.wait(30) == 0, log.read_text()
    finally:
        stop_gracefully(source)
        stop_gracefully(camera.process)
