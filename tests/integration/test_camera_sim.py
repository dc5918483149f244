"""``duomo camera-sim``, read as a camera's client reads it: PyAV over RTSP, real processes.

The cameras are two short clips made here: ``steady.mp4``, already what a camera sends (H.264,
one slice per frame, no B-frames: passed through unchanged) and ``sliced.mp4`` (four slices per
frame: re-encoded with one), served with ``--fps 30`` (they are made at 15). Each path plays in
real time at 30 fps as one slice per frame, its timestamps counting on across the loops; a path
not served answers 404; ``/<stem>/corrupt`` has exactly its damaged frames flagged corrupt by
FFmpeg; RTCP sender reports give ``start_time_realtime`` on the host's clock plus
``--clock-offset-s`` (within 50 ms), and none without sender reports; a camera stopped (SIGTERM
or SIGKILL) starts again on the same port at once; bad input and a taken port exit non-zero
with a clear message.

The clients open with ``probesize=32``: the SDP's parameter sets give the picture's size, and
FFmpeg's default probing would first buffer about a second of frames, which the pacing and clock
checks would see arrive in a burst.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import pytest

from duomo.video import camera_sim as camera_sim_command
from duomo.video.camera_sim_server import DAMAGE_EVERY, DAMAGED_PHASE, slice_types
from tests.conftest import ROOT
from tests.integration.harness import stop_gracefully
from tests.integration.video_fixtures import (
    CameraSim,
    camera_sim,
    make_clip,
    require_camera_sim,
    start_camera_sim,
)

pytestmark = pytest.mark.integration
CLIP_FPS, CLIP_FRAMES = 15, 15  # each clip: 1 s at 15 fps, one key frame (its first)
SERVED_FPS = 30
RTSP_OPTIONS = {"rtsp_transport": "tcp", "probesize": "32"}
CLOCK_FPS = 50  # FFmpeg hands a frame over when the next one begins: 20 ms late at 50 fps
CLOCK_OFFSET_S = -3600.0
CLOCK_BOUND_S = 0.050


@dataclass(frozen=True)
class Received:
    """One decoded frame as the client saw it."""

    arrived: float  # time.time() when it was decoded
    pts_s: float | None
    corrupt: bool
    slices: int  # slices in the packet that carried it
    size: tuple[int, int]
    realtime_us: int | None  # the container's start_time_realtime then


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("camera-sim")
    return {
        "steady": make_clip(folder / "steady.mp4", fps=CLIP_FPS, slices=1),
        "sliced": make_clip(folder / "sliced.mp4", fps=CLIP_FPS, slices=4),
    }


@pytest.fixture(scope="module")
def sim(clips: dict[str, Path]) -> Iterator[CameraSim]:
    require_camera_sim()
    with camera_sim([clips["steady"], clips["sliced"]], "--fps", str(SERVED_FPS)) as running:
        yield running


def receive(url: str, count: int) -> list[Received]:
    """The first ``count`` frames of ``url``, decoded as PyAV decodes a live stream."""
    frames: list[Received] = []
    with av.open(url, options=RTSP_OPTIONS, timeout=10) as container:
        stream = container.streams.video[0]
        for packet in container.demux(stream):
            slices = len(slice_types(bytes(packet)))
            for frame in packet.decode():
                frames.append(
                    Received(
                        time.time(), frame.time, frame.is_corrupt, slices,
                        (frame.width, frame.height), container.start_time_realtime,
                    )
                )  # fmt: skip
            if len(frames) >= count:
                return frames
    raise AssertionError(f"{url} ended after {len(frames)} frames")


def frame_index(frame: Received) -> int:
    assert frame.pts_s is not None
    return round(frame.pts_s * SERVED_FPS)


def test_each_file_plays_at_its_path_looping_in_real_time_one_slice_a_frame(
    sim: CameraSim,
) -> None:
    base = sim.url("")
    assert sim.urls == [
        f"{base}/steady", f"{base}/steady/corrupt", f"{base}/sliced", f"{base}/sliced/corrupt"
    ]  # fmt: skip
    assert len(sim.lines) == 4 and all(
        line.startswith(url) for line, url in zip(sim.lines, sim.urls)
    )
    assert "passed through" in sim.lines[0] and "re-encoded" in sim.lines[2]
    for path in ("/steady", "/sliced"):
        frames = receive(sim.url(path), 2 * CLIP_FRAMES + 10)  # past the end: two loops
        assert {frame.size for frame in frames} == {(320, 240)}
        assert {frame.slices for frame in frames} == {1}, "one slice per frame"
        assert not any(frame.corrupt for frame in frames)
        # timestamps count on across the loops, a frame every 1/30 s (--fps re-times 15 fps)
        timed = [frame for frame in frames if frame.pts_s is not None]
        indexes = [frame_index(frame) for frame in timed]
        assert indexes == list(range(indexes[0], indexes[0] + len(timed)))
        # paced in real time: the frames arrive as fast as their timestamps run, not in a burst
        wall_s = timed[-1].arrived - timed[5].arrived
        media_s = (indexes[-1] - indexes[5]) / SERVED_FPS
        assert 0.8 * media_s < wall_s < 1.25 * media_s, (wall_s, media_s)


@pytest.mark.parametrize("path", ["/nothing", "/steady/other", "/steady.mp4"])
def test_a_path_not_served_is_a_404(sim: CameraSim, path: str) -> None:
    with pytest.raises(av.error.HTTPNotFoundError, match="Server returned 404 Not Found"):
        av.open(sim.url(path), options=RTSP_OPTIONS, timeout=10)


@pytest.mark.parametrize("stem", ["steady", "sliced"])
def test_the_corrupt_path_has_exactly_its_damaged_frames_flagged(sim: CameraSim, stem: str) -> None:
    frames = receive(sim.url(f"/{stem}/corrupt"), 2 * CLIP_FRAMES + 10)
    timed = [frame for frame in frames if frame.pts_s is not None]
    damaged = {
        frame_index(frame) for frame in timed
        if frame_index(frame) % CLIP_FRAMES % DAMAGE_EVERY == DAMAGED_PHASE
    }  # fmt: skip
    flagged = {frame_index(frame) for frame in timed if frame.corrupt}
    assert len(damaged) >= 6 and flagged == damaged
    assert {frame.size for frame in frames} == {(320, 240)}, "concealed, not dropped"


@pytest.mark.serial  # the camera's clock against arrival, within 50 ms
def test_sender_reports_give_the_hosts_clock_plus_the_offset_within_50_ms(
    clips: dict[str, Path],
) -> None:
    require_camera_sim()
    offset = ("--clock-offset-s", str(CLOCK_OFFSET_S), "--fps", str(CLOCK_FPS))
    with camera_sim([clips["steady"]], *offset) as sim:
        frames = receive(sim.url("/steady"), 2 * CLOCK_FPS)  # reports come every second or so
    timed = [f for f in frames if f.realtime_us is not None and f.pts_s is not None]
    assert len(timed) >= CLOCK_FPS // 2, "the first sender report within about a second"
    assert len({f.realtime_us for f in timed}) == 1, "start_time_realtime is set once"
    for frame in timed:
        assert frame.realtime_us is not None and frame.pts_s is not None
        camera_s = frame.realtime_us / 1e6 + frame.pts_s  # the frame's time on the camera
        assert abs(camera_s - (frame.arrived + CLOCK_OFFSET_S)) < CLOCK_BOUND_S


def test_without_sender_reports_a_client_has_no_camera_time(clips: dict[str, Path]) -> None:
    require_camera_sim()
    options = ("--no-sender-reports", "--fps", str(CLOCK_FPS))
    with camera_sim([clips["steady"]], *options) as sim:
        assert "no RTCP" in sim.lines[0]
        frames = receive(sim.url("/steady"), 2 * CLOCK_FPS)  # 2 s: reports would have come
    assert len(frames) == 2 * CLOCK_FPS
    assert {frame.realtime_us for frame in frames} == {None}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_camera_starts_again_on_the_same_port(
    clips: dict[str, Path], stop: signal.Signals
) -> None:
    require_camera_sim()
    first = start_camera_sim([clips["steady"]])
    try:
        assert len(receive(first.url("/steady"), 5)) == 5
        first.process.send_signal(stop)
        assert first.process.wait(30) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
        with pytest.raises(av.error.ConnectionRefusedError):
            av.open(first.url("/steady"), options=RTSP_OPTIONS, timeout=10)
        with camera_sim([clips["steady"]], port=first.port) as again:
            assert again.urls == first.urls
            assert len(receive(again.url("/steady"), 5)) == 5
    finally:
        stop_gracefully(first.process)


def camera_sim_exit(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "camera-sim", *arguments],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_missing_file_a_file_that_is_no_video_and_a_taken_port_exit_non_zero(
    clips: dict[str, Path], tmp_path: Path
) -> None:
    require_camera_sim()
    missing = camera_sim_exit(str(tmp_path / "absent.mp4"), "--port", "0")
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr == f"duomo camera-sim: {tmp_path / 'absent.mp4'}: no such file\n"

    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n")
    not_video = camera_sim_exit(str(clips["steady"]), str(text), "--port", "0")
    assert (not_video.returncode, not_video.stdout) == (2, "")
    assert f"{text}: not a video GStreamer can decode" in not_video.stderr

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = camera_sim_exit(str(clips["steady"]), "--port", str(port))
    assert (busy.returncode, busy.stdout) == (1, "")
    assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert "Address already in use" in busy.stderr


def test_without_debians_gstreamer_it_says_what_to_install(
    clips: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a python without site-packages has no gi: the server program itself says what is missing
    server = subprocess.run(
        [sys.executable, "-I", "-S", str(camera_sim_command.SERVER), str(clips["steady"]),
         "--host", "127.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert server.returncode == 1
    assert "GStreamer's RTSP server is missing" in server.stderr
    assert "gir1.2-gst-rtsp-server-1.0" in server.stderr and "gstreamer1.0-plugins-ugly" in (
        server.stderr
    )
    # no Debian python3 at all: duomo camera-sim says so before anything starts
    monkeypatch.setattr(camera_sim_command, "DEBIAN_PYTHON", Path("/nonexistent/python3"))
    args = Namespace(
        files=[clips["steady"]], host="127.0.0.1", port=0, fps=None, clock_offset_s=0.0,
        no_sender_reports=False,
    )  # fmt: skip
    assert camera_sim_command.run(args) == 1
    said = capsys.readouterr().err
    assert "/nonexistent/python3, which is missing" in said and "python3-gi" in said
