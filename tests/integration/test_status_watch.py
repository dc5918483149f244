"""``duomo status --watch`` against a real supervisor: in a terminal (tmux), with stdout piped,
and across a supervisor restart on the same socket."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from duomo.ipc.client import Client
from duomo.ipc.errors import NotFoundError
from duomo.ipc.status_records import ModelInfo, ModelStatus, SupervisorStatus
from duomo.supervisor.config import LoadedConfig
from tests.conftest import IMAGES, ROOT
from tests.integration.harness import (
    SupervisorProcess,
    poll,
    running_supervisor,
    short_socket_dir,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WATCH = [sys.executable, "-m", "duomo.supervisor", "status", "--watch"]
MODEL_ROW = re.compile(r"^classify\s+READY\s+\S+\s+\S+\s+(\d+)\s", re.MULTILINE)  # (requests)
FRAME_START = re.compile(r"^(?=-- duomo status at )", re.MULTILINE)


@pytest.fixture(scope="module")
def supervisor(
    tmp_path_factory: pytest.TempPathFactory, demo_config: LoadedConfig
) -> Iterator[SupervisorProcess]:
    config = write_config(tmp_path_factory.mktemp("watch"), ["classify"])
    with running_supervisor(config) as running:
        yield running


def send_requests(sup: SupervisorProcess, count: int) -> None:
    from duomo.supervisor.operators.image_files import read_image

    image = read_image(IMAGES / "coffee.png")
    with Client(sup.socket, timeout_s=60) as client:
        classify = client.model("classify", slots=1)
        for _ in range(count):
            assert classify.infer(image, timeout_s=60)["top"]


def test_the_replies_on_the_wire_are_the_records_exactly(supervisor: SupervisorProcess) -> None:
    """A running supervisor's ``status`` and ``models`` read back key for key (in order), and
    ``status`` for one model answers with that model's status alone."""
    send_requests(supervisor, 2)
    with Client(supervisor.socket, timeout_s=60) as client:
        shown = client.request("status")["status"]  # the JSON on the wire, as it came
        models = client.request("models")["models"]
        records = client.models()  # (what ``Client`` makes of the same reply)
        one = client.request("status", model="classify")
        with pytest.raises(NotFoundError):
            client.request("status", model="no-such-model")
    status = SupervisorStatus.from_dict(shown)
    assert json.dumps(status.to_dict()) == json.dumps(shown)
    assert [json.dumps(ModelInfo.from_dict(m).to_dict()) for m in models] == [
        json.dumps(m) for m in models
    ]
    assert records == [ModelInfo.from_dict(m) for m in models]
    assert "status" not in one
    alone = ModelStatus.from_dict(one["model_status"])
    assert alone.to_dict() == one["model_status"]
    assert alone.requests >= 2 and alone.state == status.models["classify"].state == "READY"


def requests_shown(screen: str) -> int | None:
    """The request count in the classify row, None while there is no such row."""
    found = MODEL_ROW.search(screen)
    return int(found.group(1)) if found else None


def tmux_command() -> list[str]:
    """tmux on a private server socket (no user config), or a skip where tmux is missing;
    CI must have it, so there the test fails instead."""
    tmux = shutil.which("tmux")
    if tmux is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tmux is not installed, and CI must run this test: apt-get install tmux")
        pytest.skip("tmux is not installed")
    return [tmux, "-L", f"duomo-watch-{uuid.uuid4().hex[:12]}", "-f", "/dev/null"]


def test_watch_in_a_terminal_counts_requests_and_quits_on_q(
    supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    tmux = tmux_command()
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}  # a test run inside tmux
    rc_file = tmp_path / "rc"
    watch = shlex.join([*WATCH, "--interval", "0.3", "--socket", str(supervisor.socket)])
    screens = [""]

    def tmux_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*tmux, *args], env=env, capture_output=True, text=True, timeout=10)

    def shows(condition: Callable[[str], bool], what: str, timeout_s: float = 30) -> None:
        def screen_holds() -> bool:
            screens.append(tmux_run("capture-pane", "-p", "-t", "watch").stdout)
            return condition(screens[-1])

        try:
            poll(screen_holds, timeout_s)
        except AssertionError:
            pytest.fail(f"the pane did not show {what}; it showed:\n{screens[-1]}")

    try:
        started = tmux_run(
            "new-session", "-d", "-s", "watch", "-x", "160", "-y", "45", "-c", str(ROOT),
            f"{watch}; echo $? > {shlex.quote(str(rc_file))}",
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        # (a pane captured mid-draw may hold the first rows only: wait for the whole screen)
        shows(
            lambda screen: requests_shown(screen) is not None
            and "every 0.3s" in screen and "device" in screen,
            "the classify row, the devices and the footer",
        )  # fmt: skip
        before = requests_shown(screens[-1])
        assert before is not None
        send_requests(supervisor, 3)
        shows(lambda screen: requests_shown(screen) == before + 3, f"{before + 3} requests")

        assert tmux_run("send-keys", "-t", "watch", "q").returncode == 0
        try:
            poll(lambda: rc_file.is_file() and rc_file.read_text().strip() != "", timeout_s=10)
        except AssertionError:
            shown = tmux_run("capture-pane", "-p", "-t", "watch").stdout
            pytest.fail(f"the view did not quit on q; the pane showed:\n{shown}")
        assert rc_file.read_text().strip() == "0"
    finally:
        tmux_run("kill-server")


class PipedWatch:
    """``duomo status --watch`` with stdout piped, read on a thread so that a test can wait for
    what it prints with a deadline."""

    def __init__(self, socket: Path, stderr: Path) -> None:
        with stderr.open("w") as errors:
            self.process = subprocess.Popen(
                [*WATCH, "--interval", "0.2", "--socket", str(socket)],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=errors, text=True,
            )  # fmt: skip
        self.stderr = stderr
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def frames(self) -> list[str]:
        """The frames printed in full so far (the last one may still be arriving)."""
        return [f for f in FRAME_START.split("".join(self.lines))[:-1] if f]

    def wait_for_frame(self, condition: Callable[[str], bool], what: str, start: int = 0) -> int:
        """The index of the first complete frame from ``start`` on that meets ``condition``."""
        found: list[int] = []

        def printed() -> bool:
            frames = self.frames()
            found[:] = [i for i in range(start, len(frames)) if condition(frames[i])][:1]
            return bool(found)

        try:
            poll(printed, timeout_s=60)
        except AssertionError:
            shown = "".join(self.lines)[-3000:]
            pytest.fail(f"no frame showed {what}; the output ended:\n{shown}")
        return found[0]

    def interrupt(self) -> int:
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(30)
        self._reader.join(10)
        return code

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def piped_watch(tmp_path: Path) -> Iterator[Callable[[Path], PipedWatch]]:
    started: list[PipedWatch] = []

    def start(socket: Path) -> PipedWatch:
        started.append(PipedWatch(socket, tmp_path / f"stderr-{len(started)}"))
        return started[-1]

    yield start
    for watch in started:
        watch.close()


def has_model_row(frame: str) -> bool:
    return requests_shown(frame) is not None


def test_watch_without_a_terminal_prints_plain_frames(
    supervisor: SupervisorProcess, piped_watch: Callable[[Path], PipedWatch]
) -> None:
    watch = piped_watch(supervisor.socket)
    first = watch.wait_for_frame(has_model_row, "the classify row")
    watch.wait_for_frame(has_model_row, "the classify row again", start=first + 1)
    assert watch.interrupt() == 0, watch.stderr.read_text()
    output = "".join(watch.lines)
    assert "\x1b[" not in output
    assert output.startswith("-- duomo status at ")
    assert "q or Ctrl-C" not in output  # the key hint is for terminals only


def test_watch_reconnects_to_a_restarted_supervisor(
    tmp_path: Path, demo_config: LoadedConfig, piped_watch: Callable[[Path], PipedWatch]
) -> None:
    config = write_config(tmp_path, ["classify"])
    folder = short_socket_dir()
    socket = folder / "duomo.sock"
    try:
        with running_supervisor(config, socket_path=socket) as first:
            watch = piped_watch(socket)
            seen = watch.wait_for_frame(has_model_row, "the classify row")
            assert f"pid {first.pid} " in watch.frames()[seen]
            first.process.send_signal(signal.SIGTERM)
            first.process.wait(60)
        lost = watch.wait_for_frame(
            lambda frame: f"reconnecting to {socket} …" in frame, "reconnecting", start=seen + 1
        )
        with running_supervisor(config, socket_path=socket) as second:
            back = watch.wait_for_frame(has_model_row, "the classify row again", start=lost + 1)
            assert f"pid {second.pid} " in watch.frames()[back]
            assert watch.interrupt() == 0, watch.stderr.read_text()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
