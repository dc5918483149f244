"""The live preview page of ``duomo stream --preview`` (video/preview.py, issue 34 item 8).

A real browser: Debian's ``chromium`` headless, driven over its DevTools pipe
(``--remote-debugging-pipe``: the DevTools protocol as NUL-terminated JSON on fds 3 and 4), opens
the page of a ``PreviewServer`` running in this process, waits (polling the page, no sleep) until
the canvas shows the frame with the face answer drawn, and takes a screenshot: the box colour
(#00ff00) lies on the answer's box in the PNG and nowhere else. A hostile stream name is shown as
text, never as markup. A client that stops reading blocks neither ``frame()`` nor other clients.
And the page as a user gets it: the ``duomo stream --preview`` command itself, a real H.264 clip
decoded into the face model of a real supervisor, the box the model answered drawn on the face.
(A screenshot by ``chromium --screenshot --virtual-time-budget`` never comes: virtual time waits
for the event stream, which never ends.)
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import av
import numpy as np
import pytest
from PIL import Image

from duomo.ipc.stream import StreamAnswer
from duomo.video.preview import PreviewServer
from tests.conftest import ROOT, fixture_image, poll, require_tool
from tests.integration.harness import SupervisorProcess, running_supervisor, write_config

FACE_BOX = (180, 62, 271, 178)  # the face model's box on astronaut.png (video_fixtures.py)
LANDMARKS = [[205.0, 105.0], [245.0, 105.0], [225.0, 130.0], [208.0, 155.0], [242.0, 155.0]]
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">&amp;\"'/?#%25\\</script> 门"
VIEWPORT = (1280, 900)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
]


class Browser:
    """Chromium headless over its DevTools pipe: one page target at a time."""

    def __init__(self, chromium: str, profile: Path) -> None:
        commands_r, self._commands = os.pipe()  # chromium reads its fd 3
        self._replies, replies_w = os.pipe()  # chromium writes its fd 4
        argv = [chromium, *CHROMIUM_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}"]
        self.log = (profile.parent / "chromium.log").open("wb")
        self.process = subprocess.Popen(  # bash: its redirections take fds above 9
            ["bash", "-c", f'exec "$@" 3<&{commands_r} 4>&{replies_w}', "bash", *argv],
            pass_fds=(commands_r, replies_w),
            stdout=self.log,
            stderr=self.log,
        )
        os.close(commands_r)
        os.close(replies_w)
        self._buffer = b""
        self._next_id = 0
        self.session: str | None = None

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one command (to the attached page, if any) and return its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return dict(reply["result"])
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} in {timeout_s} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited (see {self.log.name})")
            self._buffer += chunk

    def open(self, url: str) -> None:
        """Open ``url`` in a new page and talk to that page from now on."""
        self.session = None
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=VIEWPORT[0],
            height=VIEWPORT[1],
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able)."""
        reply = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self) -> np.ndarray:
        """The page's viewport, RGB."""
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=10.0)
            self.process.wait(timeout=10.0)
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            os.close(self._commands)
            os.close(self._replies)
            self.log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    chromium = require_tool("chromium", "the preview page's test runs it headless (apt chromium)")
    running = Browser(chromium, tmp_path_factory.mktemp("chromium") / "profile")
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def preview() -> Iterator[PreviewServer]:
    server = PreviewServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def face_answer(stream: str, frame: int) -> StreamAnswer:
    face = {"box": [float(v) for v in FACE_BOX], "score": 0.93, "landmarks": LANDMARKS}
    return StreamAnswer(stream, frame, "face", 41.5, "OK", result={"faces": [face]})


def card_ready(browser: Browser, models: str) -> bool:
    """The page's first card shows a frame with ``models``' results drawn on it."""
    shown = browser.evaluate(
        "(() => { const c = document.querySelector('.card');"
        " return c ? [c.dataset.seq || '0', c.dataset.models || ''] : null; })()"
    )
    return shown is not None and int(shown[0]) >= 1 and shown[1] == models


def rect(browser: Browser, selector: str) -> tuple[float, float, float, float]:
    """``selector``'s box in the viewport: left, top, width, height."""
    found = browser.evaluate(
        f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
        ".getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })()"
    )
    return tuple(found)


def box_drawn(browser: Browser, box: Sequence[float]) -> np.ndarray:
    """A screenshot in which the face colour (#00ff00) lies on ``box``'s outline on the first
    card's canvas and nowhere else (the legend, which names the colour in the colour, left out),
    and each side of the box is drawn; the screenshot (RGB, int)."""
    left, top, _, _ = rect(browser, ".card canvas")
    legend = rect(browser, ".legend")  # names the colour, in the colour: left out below
    shot = browser.screenshot().astype(int)
    green = (shot[..., 1] >= 230) & (shot[..., 0] <= 40) & (shot[..., 2] <= 40)
    green[: int(legend[1] + legend[3]) + 1, :] = False
    ys, xs = np.nonzero(green)
    assert len(xs) > 0, "the box colour #00ff00 is nowhere in the screenshot"

    x1, y1 = round(left + box[0]), round(top + box[1])
    x2, y2 = round(left + box[2]), round(top + box[3])
    # every pixel of the colour is on the box's outline (±3 px: the 3 px stroke, antialiasing)
    near_outline = (xs >= x1 - 3) & (xs <= x2 + 3) & (ys >= y1 - 3) & (ys <= y2 + 3)
    inside = (xs > x1 + 3) & (xs < x2 - 3) & (ys > y1 + 3) & (ys < y2 - 3)
    stray = near_outline & ~inside
    assert stray.all(), f"#00ff00 away from the box: {list(zip(xs[~stray], ys[~stray]))[:10]}"
    # and the outline is drawn: each side nearly all of the colour
    for side in (green[y1, x1:x2], green[y2, x1:x2], green[y1:y2, x1], green[y1:y2, x2]):
        assert side.mean() > 0.9, f"a side of the box is {side.mean():.0%} drawn"
    return shot


def test_the_face_box_is_drawn_where_the_face_is(browser: Browser, preview: PreviewServer) -> None:
    astronaut = fixture_image("astronaut.png")
    preview.frame("gate-3", astronaut, 17)
    preview.answer("gate-3", face_answer("gate-3", 17))
    preview.figures("gate-3", {"state": "running", "input_fps": 30.0, "answered_fps": 9.5})
    browser.open(preview.url)
    poll(lambda: card_ready(browser, "face"), timeout_s=30.0)

    left, top, width, height = rect(browser, ".card canvas")
    assert (width, height) == (astronaut.shape[1], astronaut.shape[0])  # drawn 1:1, unscaled
    shot = box_drawn(browser, FACE_BOX)
    # the landmarks are dots of their own colour (#ff00ff) where they are
    for x, y in LANDMARKS:
        dot = shot[round(top + y), round(left + x)]
        assert dot[0] >= 230 and dot[1] <= 40 and dot[2] >= 230, f"landmark {x},{y}: {dot}"
    # state and rates are shown
    figures = browser.evaluate("document.querySelector('.card .figures').textContent")
    assert "30.0 fps" in figures and "9.5 fps" in figures
    assert browser.evaluate("document.querySelector('.card .state').textContent") == "running"


def test_a_hostile_stream_name_is_shown_as_text(browser: Browser, preview: PreviewServer) -> None:
    image = np.full((120, 160, 3), 90, np.uint8)
    preview.frame(HOSTILE, image, 3)
    preview.answer(HOSTILE, face_answer(HOSTILE, 3))
    line = {"text": "<b>bold</b>", "score": 0.9, "box": [[10, 10], [90, 10], [90, 30], [10, 30]]}
    preview.answer(HOSTILE, StreamAnswer(HOSTILE, 4, "ocr", 12.0, "OK", {"lines": [line]}))
    browser.open(preview.url)
    poll(lambda: card_ready(browser, "face ocr"), timeout_s=30.0)  # its frame URL worked too

    shown = browser.evaluate(
        "[document.querySelector('.card h2 .name').textContent, document.title,"
        " document.querySelectorAll('img, b, script:not([src])').length,"
        " document.querySelector('.card .models').textContent]"
    )
    assert shown[0] == HOSTILE
    assert shown[1] == "Duomo · live preview"
    assert shown[2] == 0  # no element made of the name or the text
    assert '"<b>bold</b>"' in shown[3]
    # and the server finds the stream under its percent-encoded name
    address = urlsplit(preview.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    connection.request("GET", f"/frame/{quote(HOSTILE, safe='')}.jpg")
    reply = connection.getresponse()
    assert reply.status == 200 and reply.read()[:2] == b"\xff\xd8"
    connection.close()


def test_a_client_that_stops_reading_blocks_nothing(preview: PreviewServer) -> None:
    address = urlsplit(preview.url)
    rng = np.random.default_rng(34)
    noise = [rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8) for _ in range(4)]

    def latest() -> tuple[int, int]:
        """The stream's latest JPEG's seq and size, from a client that reads."""
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.request("GET", "/frame/cam.jpg")
        reply = connection.getresponse()
        body = reply.read()
        connection.close()
        return (
            (int(reply.getheader("X-Frame-Seq") or 0), len(body)) if reply.status == 200 else (0, 0)
        )

    preview.frame("cam", noise[0], 0)
    poll(lambda: latest()[0] >= 1, timeout_s=10.0)
    first_seq, jpeg_bytes = latest()
    assert jpeg_bytes > 500_000  # noise hardly compresses

    # two clients that never read: the MJPEG of that stream and the event stream
    stuck = []
    for path in ("/mjpeg/cam", "/events"):
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((address.hostname, address.port))
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        stuck.append(client)
    try:
        slowest = 0.0
        started = time.monotonic()
        while time.monotonic() - started < 4.0:  # 60 frames a second, as a camera sends them
            for index in range(4):
                t0 = time.perf_counter()
                preview.frame("cam", noise[index], index)
                preview.answer("cam", face_answer("cam", index))
                preview.figures("cam", {"state": "running", "input_fps": 60.0})
                slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(1 / 60)
        elapsed = time.monotonic() - started
        assert slowest < 0.25, f"a frame()/answer()/figures() took {slowest * 1000:.0f} ms"
        # another client is served meanwhile, and the frames went on being encoded, ≤ 5 fps
        encoded = latest()[0] - first_seq
        assert encoded >= 5, f"only {encoded} JPEGs in {elapsed:.1f} s behind the stuck clients"
        assert encoded <= 5.0 * elapsed + 2, f"{encoded} JPEGs in {elapsed:.1f} s: over 5 fps"
        # the stuck MJPEG client was offered more than its socket's buffers hold
        assert encoded * jpeg_bytes > 8_000_000
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        connection.request("GET", "/state")
        board = json.loads(connection.getresponse().read())
        connection.close()
        [cam] = board["streams"]
        assert cam["answers"]["face"]["result"]["faces"][0]["box"] == list(FACE_BOX)
        assert cam["answers"]["face"]["frame"] == 3
        assert cam["image"]["width"] == 1280 and cam["figures"]["input_fps"] == 60.0
    finally:
        for client in stuck:
            client.close()


# -- the page of the real command -------------------------------------------------------------


@pytest.fixture(scope="module")
def face_supervisor(
    tmp_path_factory: pytest.TempPathFactory, demo_config: object
) -> Iterator[SupervisorProcess]:
    with running_supervisor(write_config(tmp_path_factory.mktemp("preview"), ["face"])) as sup:
        yield sup


def still_clip(path: Path, image: np.ndarray, frames: int = 10, fps: int = 5) -> Path:
    """H.264 of ``image`` standing still, every frame a key frame: each decodes to the same
    picture, so the face model answers the same box whichever frame the page shows."""
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = image.shape[1], image.shape[0], "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        stream.options = {"crf": "18", "g": "1", "bf": "0"}
        for _ in range(frames):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def board(url: str) -> dict[str, Any]:
    """The page's board (``/state``), as the page's events carry it."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
    try:
        connection.request("GET", "/state")
        return dict(json.loads(connection.getresponse().read()))
    finally:
        connection.close()


def test_duomo_stream_preview_draws_the_answers_on_the_frames(
    browser: Browser, face_supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """``duomo stream CLIP --model face --loop --preview 127.0.0.1:0`` as a user runs it: the
    command says where its page is (a port of its own), the page shows the clip's stream under
    the file's stem with the supervisor's state, and the box the face model answered, which is
    where the face is, drawn on the face in the screenshot; SIGINT ends the command (exit 0)
    with the same answers in its JSON lines."""
    astronaut = np.ascontiguousarray(fixture_image("astronaut.png")[..., :3])
    clip = still_clip(tmp_path / "gate.mp4", astronaut)
    out, log = tmp_path / "answers.jsonl", tmp_path / "stream.log"
    with log.open("wb") as stderr:
        command = subprocess.Popen(
            [sys.executable, "-m", "duomo.supervisor", "stream", str(clip), "--model", "face",
             "--loop", "--preview", "127.0.0.1:0", "--out", str(out),
             "--socket", str(face_supervisor.socket)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        poll(lambda: "preview at http://" in log.read_text() or command.poll() is not None, 60)
        said = [line for line in log.read_text().splitlines() if "preview at " in line]
        assert said, f"no preview address (exit {command.poll()}): {log.read_text()}"
        url = said[0].split("preview at ", 1)[1].strip()
        assert urlsplit(url).port not in (None, 0), url
        browser.open(url)
        poll(lambda: card_ready(browser, "face"), timeout_s=60.0)
        poll(lambda: browser.evaluate("document.querySelector('.card .state').textContent")
             == "running")  # fmt: skip
        assert browser.evaluate("document.querySelector('.card h2 .name').textContent") == "gate"

        [gate] = board(url)["streams"]
        [face] = gate["answers"]["face"]["result"]["faces"]
        box = face["box"]
        assert all(abs(got - want) <= 4 for got, want in zip(box, FACE_BOX)), box
        _, _, width, height = rect(browser, ".card canvas")
        assert (width, height) == (astronaut.shape[1], astronaut.shape[0])  # drawn 1:1
        box_drawn(browser, box)
    finally:
        command.send_signal(signal.SIGINT)
        try:
            exited = command.wait(60)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait()
            raise
    assert exited == 0, log.read_text()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(line["stream"], line["model"]) for line in lines} == {("gate", "face")}
    answered = [line["result"]["faces"] for line in lines if "result" in line]
    assert answered, lines[:5]  # (a frame may be superseded: policy latest)
    for faces in answered:
        [found] = faces
        assert all(abs(got - want) <= 4 for got, want in zip(found["box"], FACE_BOX)), faces
