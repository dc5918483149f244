"""``duomo stream`` beside a supervisor that comes late and restarts: it waits and attaches again.

The stream source is started before any supervisor exists (``--wait-s``); a supervisor then
starts on that socket, and the looped test video's answers flow into the JSON lines. The
supervisor is stopped (SIGTERM, as a container restart does): the source keeps running, drops
what it decodes, and reconnects with backoff; a new supervisor on the same socket gets the same
stream again, whose frame numbers count on. SIGTERM ends the source with 0. Each step is
bounded by polls; nothing sleeps.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.integration.harness import (
    duomo,
    poll,
    running_supervisor,
    short_socket_dir,
    stop_gracefully,
    write_config,
)
from tests.integration.video_fixtures import make_test_video

CONTRACT_KEYS = {"stream", "frame", "model", "age_ms", "captured_at", "clock", "pts"}
SECOND_ATTEMPT = re.compile(r"supervisor lost; reconnecting\s+attempt=2 ")


@pytest.fixture(scope="session")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_video(tmp_path_factory.getbasetemp() / "videos")


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def answered(path: Path) -> list[int]:
    """The frame numbers answered with a result, in the order written."""
    return [line["frame"] for line in read_lines(path) if "result" in line]


def stream_state(socket_path: Path, name: str) -> str | None:
    shown = duomo(socket_path, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    states = {s["name"]: s["state"] for s in json.loads(shown.stdout).get("streams", [])}
    return states.get(name)


def test_the_source_waits_for_the_supervisor_and_attaches_again_after_its_restart(
    video: Path, tmp_path: Path
) -> None:
    folder = short_socket_dir()
    socket_path = folder / "duomo.sock"
    config = write_config(tmp_path, ["face"])
    out, log = tmp_path / "answers.jsonl", tmp_path / "stream.log"
    with log.open("w") as log_file:
        source = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "stream", str(video),
             "--model", "face", "--name", "gate", "--loop", "--wait-s", "120",
             "--out", str(out), "--socket", str(socket_path)],
            cwd=ROOT, stderr=log_file,
        )  # fmt: skip
    try:
        poll(lambda: "waiting for the supervisor" in log.read_text(), timeout_s=30)
        assert source.poll() is None, log.read_text()  # no supervisor yet: it waits

        with running_supervisor(config, socket_path=socket_path) as first:
            poll(lambda: len(answered(out)) >= 10, timeout_s=90)
            assert stream_state(socket_path, "gate") in ("running", "blocked")
            stop_gracefully(first.process)
            assert first.process.returncode == 0
        # the second attempt (0.5 s on): the old stream's last answers are all written by then
        poll(lambda: bool(SECOND_ATTEMPT.search(log.read_text())), timeout_s=30)
        before = answered(out)
        assert source.poll() is None, log.read_text()

        with running_supervisor(config, socket_path=socket_path):
            poll(lambda: len(answered(out)) >= len(before) + 10, timeout_s=90)
            assert stream_state(socket_path, "gate") in ("running", "blocked")
            after = answered(out)[len(before) :]
            # the same stream, its numbers counting on past those answered before the restart
            # (the frames decoded while no supervisor was there are skipped, not renumbered)
            assert min(after) > max(before), (max(before), after[:5])
            text = log.read_text()
            assert "supervisor reconnected" in text and "video source attached again" in text

            source.send_signal(signal.SIGTERM)
            assert source.wait(30) == 0, log.read_text()
            poll(lambda: stream_state(socket_path, "gate") in (None, "ended"), timeout_s=30)
    finally:
        stop_gracefully(source)
        shutil.rmtree(folder, ignore_errors=True)
    lines = read_lines(out)
    for line in lines:
        assert line.keys() >= CONTRACT_KEYS, line
        assert ("result" in line) != ("outcome" in line), line
    assert {line["stream"] for line in lines} == {"gate"}
    # each frame is answered at most once per model, the frame being submitted when the
    # connection dropped as well
    frames = [(line["frame"], line["model"]) for line in lines]
    assert len(frames) == len(set(frames))
    assert "Traceback" not in log.read_text()


def test_without_a_supervisor_within_wait_s_exit_1(video: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "stream", str(video), "--model", "face",
         "--wait-s", "2", "--socket", str(tmp_path / "none.sock")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert time.monotonic() - started >= 2
    assert "waiting for the supervisor" in run.stderr  # one line per backoff step
    assert "waited 2 s" in run.stderr and "duomo start" in run.stderr
    assert "Traceback" not in run.stderr


def test_sigterm_while_waiting_for_the_supervisor_exit_0(video: Path, tmp_path: Path) -> None:
    log = tmp_path / "stream.log"
    with log.open("w") as log_file:
        source = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "stream", str(video),
             "--model", "face", "--wait-s", "600", "--socket", str(tmp_path / "none.sock")],
            cwd=ROOT, stderr=log_file, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        poll(lambda: "waiting for the supervisor" in log.read_text(), timeout_s=30)
        source.send_signal(signal.SIGTERM)
        assert source.wait(30) == 0, log.read_text()
    finally:
        stop_gracefully(source)
