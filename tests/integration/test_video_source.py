"""``duomo stream`` as a user runs it: a real H.264 file (``video_fixtures``) decoded into the
demo's ``face`` and ``ocr`` of a real supervisor, the answers read back from the JSON lines.

The file's frames are known: the face box of frame n is ``face_box(n)`` and the panel reads
``TEXT``, so each answer is checked against its own frame number.
"""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from tests.integration.video_fixtures import FPS, TEXT, face_box, make_test_video

CONTRACT_KEYS = {"stream", "frame", "model", "age_ms", "captured_at", "clock", "pts"}


@pytest.fixture(scope="session")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_video(tmp_path_factory.getbasetemp() / "videos")


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorProcess]:
    config = write_config(tmp_path_factory.mktemp("video-source"), ["face", "ocr"])
    with running_supervisor(config) as sup:
        yield sup


def stream_command(sup: SupervisorProcess, *args: str) -> list[str]:
    cli = [sys.executable, "-m", "duomo.supervisor", "stream"]
    return [*cli, *args, "--socket", str(sup.socket)]


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def check_contract(lines: list[dict[str, Any]]) -> None:
    for line in lines:
        assert line.keys() >= CONTRACT_KEYS, line
        assert ("result" in line) != ("outcome" in line), line
        assert line["age_ms"] >= 0
        captured_at = datetime.datetime.fromisoformat(line["captured_at"].replace("Z", "+00:00"))
        assert line["captured_at"].endswith("Z") and len(line["captured_at"]) == 24, line
        assert abs(captured_at.timestamp() - time.time()) < 3600, line
        assert line["clock"] in ("camera", "arrival"), line
        assert line["pts"] is None or line["pts"] >= 0, line
        if "outcome" in line:
            assert line["outcome"] == "SUPERSEDED" or "error" in line, line


def centre(box: list[float] | tuple[int, ...]) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def test_the_answers_are_right_on_the_frames_they_name(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    duration_s = 8.0
    started = time.monotonic()
    run = subprocess.run(
        stream_command(supervisor, str(video), "--model", "face", "--model", "ocr",
                       "--duration", str(duration_s), "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took_s = time.monotonic() - started
    assert run.returncode == 0, run.stderr
    assert took_s >= duration_s
    lines = read_lines(out)
    check_contract(lines)
    assert {line["stream"] for line in lines} == {"street"}  # the file's stem
    # --duration bounds the run: no frame beyond its time was decoded (paced at the file's rate)
    assert max(line["frame"] for line in lines) <= duration_s * FPS + 2
    faces = [line for line in lines if line["model"] == "face" and "result" in line]
    texts = [line for line in lines if line["model"] == "ocr" and "result" in line]
    assert len(faces) >= 20 and texts, Counter((x["model"], x.get("outcome")) for x in lines)
    for line in faces:
        found = line["result"]["faces"]
        assert len(found) == 1, line
        (x, y), (want_x, want_y) = centre(found[0]["box"]), centre(face_box(line["frame"]))
        assert abs(x - want_x) <= 12 and abs(y - want_y) <= 12, (line["frame"], found[0]["box"])
    for line in texts:
        assert [t["text"] for t in line["result"]["lines"]] == [TEXT], line
    # every frame sent is answered once by each model (OK or SUPERSEDED), nothing twice
    pairs = Counter((line["frame"], line["model"]) for line in lines)
    assert max(pairs.values()) == 1
    assert {f for f, m in pairs if m == "face"} == {f for f, m in pairs if m == "ocr"}


def test_a_file_played_to_its_end_is_every_frame_answered_and_exit_0(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    run = subprocess.run(
        stream_command(supervisor, str(video), "--model", "face", "--as-fast-as-possible",
                       "--name", "fast", "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = read_lines(out)
    check_contract(lines)
    assert sorted(line["frame"] for line in lines) == list(range(20 * FPS))
    assert {line["stream"] for line in lines} == {"fast"}
    outcomes = Counter(line.get("outcome", "OK") for line in lines)
    assert set(outcomes) <= {"OK", "SUPERSEDED"} and outcomes["OK"] >= 1, outcomes


def test_loop_restarts_the_file_and_duration_ends_it(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    run = subprocess.run(
        stream_command(supervisor, str(video), "--model", "face", "--loop",
                       "--as-fast-as-possible", "--duration", "4", "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    frames = [line["frame"] for line in read_lines(out)]
    assert max(frames) >= 20 * FPS  # numbered on past the file's end: it played again
    assert len(frames) == len(set(frames))


def test_sigterm_stops_cleanly_and_ends_the_stream(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    process = subprocess.Popen(
        stream_command(supervisor, str(video), "--model", "face", "--loop", "--name", "door",
                       "--out", str(out)),
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        poll(lambda: len(read_lines(out)) >= 5, timeout_s=60)
        assert stream_state(supervisor, "door") in ("running", "blocked")  # (face may lag)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, process.stderr.read() if process.stderr else ""
    finally:
        stop_gracefully(process)
    check_contract(read_lines(out))
    assert stream_state(supervisor, "door") in (None, "ended")


def stream_state(sup: SupervisorProcess, name: str) -> str | None:
    """The stream's state in ``duomo status --json`` (None: not listed)."""
    shown = duomo(sup.socket, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    states = {s["name"]: s["state"] for s in json.loads(shown.stdout).get("streams", [])}
    return states.get(name)


def test_a_bad_source_or_model_is_a_message_and_exit_2(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    cases = {
        "no such file": [str(tmp_path / "missing.mp4"), "--model", "face"],
        "unknown scheme": ["gopher://camera/1", "--model", "face"],
        "nope": [str(video), "--model", "nope"],
    }
    (tmp_path / "notes.mp4").write_text("not a video")
    cases["not a video"] = [str(tmp_path / "notes.mp4"), "--model", "face"]
    for said, args in cases.items():
        run = subprocess.run(
            stream_command(supervisor, *args), cwd=ROOT, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert run.returncode == 2, (said, run.stderr)
        assert said in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert run.stderr.startswith("duomo stream: "), run.stderr


def test_every_source_failed_permanently_is_exit_3_with_the_reasons(
    supervisor: SupervisorProcess,
) -> None:
    """Issue 43: a camera URL with a typo was retried forever at warning level and the command
    exited 0. A host name that does not resolve is a permanent error: failed after three
    attempts (0.5 + 1 + 2 s), and with every source failed the command ends, exit 3."""
    started = time.monotonic()
    run = subprocess.run(
        stream_command(
            supervisor, "rtsp://no-such-camera.invalid/main", "rtsp://also-not.invalid/x",
            "--model", "face", "--name", "typo", "other",
        ),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 3, run.stderr
    assert time.monotonic() - started < 30  # (not --failed-after's 30 s: a permanent error)
    for name, host in (("typo", "no-such-camera.invalid"), ("other", "also-not.invalid")):
        assert f"duomo stream: {name}: failed: its host name {host!r} does not resolve" in (
            run.stderr
        ), run.stderr


def test_without_a_supervisor_exit_1(video: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "stream", str(video), "--model", "face",
         "--socket", str(tmp_path / "none.sock")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "duomo start" in run.stderr and "Traceback" not in run.stderr


def test_several_sources_from_a_sources_file_play_in_one_process(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"- {{name: north, url: {video}, models: [face]}}\n"
        f"- {{name: south, url: {video}, max_fps: 5}}\n"
    )
    out = tmp_path / "answers.jsonl"
    run = subprocess.run(
        stream_command(supervisor, "--sources", str(sources), "--model", "ocr",
                       "--duration", "4", "--out", str(out)),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = read_lines(out)
    check_contract(lines)
    by_stream = Counter((line["stream"], line["model"]) for line in lines)
    assert set(by_stream) == {("north", "face"), ("south", "ocr")}, by_stream
    south = sorted({line["frame"] for line in lines if line["stream"] == "south"})
    assert len(south) <= 4 * 5 + 2  # max_fps 5: most of the 15 fps were dropped at the source


def test_a_bad_sources_file_names_the_entry_and_field(
    supervisor: SupervisorProcess, video: Path, tmp_path: Path
) -> None:
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"- {{name: a, url: {video}, models: [face], colour: red}}\n")
    run = subprocess.run(
        stream_command(supervisor, "--sources", str(sources)),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "[0].colour" in run.stderr, run.stderr
