"""The sinks guide runs as written (issue 46): the one bash block of ``docs/sinks.md`` ("Try it")
that starts its own mosquitto and redis-server, a ``duomo camera-sim`` camera and a supervisor
with an MQTT and a Redis sink, plays the camera into ``faces`` and reads the events on both
brokers, run whole by ``bash -euo pipefail`` as a reader would paste it.

What is the test's own, as in ``test_doc_commands.test_the_streams_guide_example``: the guide's
``/tmp/`` files go into the test's folder, its fixed ports (MQTT 18830, Redis 16379, RTSP 18554)
become free ones, and its supervisor listens on a socket of the test's (``DUOMO_SOCKET``). The
block runs in a session of its own, so whatever it left running when it failed (its brokers,
its camera, its subscribers) is ended with it; its supervisor, which runs in a session of its
own too, is stopped through its socket.

Checked: the block exits 0; the MQTT subscriber it started recorded each event under
``duomo/street/<kind>`` with ids and seqs contiguous from 1 in order, answers and the face's
visit among them; the ``object_left`` it waited for is a whole visit; what it printed from Redis
(XLEN, XREAD) is the same source's events; and ``duomo status`` showed both sinks connected.
The Chinese twin carries the same block (``tests/unit/test_docs.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from duomo.sinks.events import decode_event
from tests.conftest import require_tool
from tests.integration.harness import ROOT, duomo, free_port, short_socket_dir
from tests.integration.video_fixtures import require_camera_sim

pytestmark = pytest.mark.integration

GUIDE = ROOT / "docs" / "sinks.md"
FENCE = re.compile(r"^```bash\n(.*?)^```[ \t]*$", re.S | re.M)
FOLDER = "/tmp/duomo-sinks"  # the guide's files
PORTS = ("18830", "16379", "18554")  # the guide's MQTT, Redis and RTSP ports
RUN_S = 300  # a supervisor of three models, a camera, two brokers: about 15 s on two cores


def guide_block() -> str:
    """The guide's bash block (the one that keeps its files in ``FOLDER``)."""
    (block,) = [
        m.group(1) for m in FENCE.finditer(GUIDE.read_text("utf-8")) if FOLDER in m.group(1)
    ]
    return block


def own(block: str, folder: Path) -> str:
    """``block`` with its files in ``folder`` and its ports free ones."""
    block = block.replace("/tmp/", f"{folder}/")
    for port in PORTS:
        assert re.search(rf"\b{port}\b", block), f"the guide no longer uses port {port}"
        block = re.sub(rf"\b{port}\b", str(free_port()), block)
    return block


def require_programs() -> None:
    """The brokers and their clients (Debian's, as ``make test`` installs them) and the
    camera simulator; without one the test skips (a failure with CI=true)."""
    if not os.access("/usr/sbin/mosquitto", os.X_OK):
        pytest.skip("/usr/sbin/mosquitto is missing: apt-get install mosquitto")
    for program, package in (
        ("mosquitto_sub", "mosquitto-clients"),
        ("redis-server", "redis-server"),
        ("redis-cli", "redis-tools"),
    ):
        require_tool(program, f"the sinks guide runs it (apt-get install {package})")
    require_camera_sim()


def end_session(process: subprocess.Popen[str]) -> None:
    """SIGTERM to what is left of the block's own session (the block's shell is its leader),
    then SIGKILL."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)


def run_guide(folder: Path, socket_path: Path) -> tuple[int, str, str]:
    """Run the guide's block whole; (exit code, stdout, stderr). Whatever it leaves running is
    stopped: its supervisor through ``socket_path``, the rest with its session."""
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", own(guide_block(), folder)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DUOMO_SOCKET": str(socket_path)}, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        end_session(process)
        out, err = process.communicate()
        err += f"\n(the block ran past {RUN_S} s)"
    finally:
        if socket_path.exists():  # the block failed before its `duomo stop`
            duomo(socket_path, "stop")
        end_session(process)
    return process.returncode, out, err


def events_of(lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(topic, event) of each line ``mosquitto_sub -v`` wrote."""
    out = []
    for line in lines:
        topic, _, body = line.partition(" ")
        out.append((topic, decode_event(body)))
    return out


def test_the_sinks_guide_runs_as_written(tmp_path: Path, demo_config: object) -> None:
    require_programs()
    sockets = short_socket_dir()
    try:
        code, out, err = run_guide(tmp_path, sockets / "duomo.sock")
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    files = tmp_path / "duomo-sinks"
    assert code == 0, f"the guide's block exited {code}:\n{err[-4000:]}\n{out[-2000:]}"

    # MQTT: every event the subscriber saw, in order, each on its topic, seqs from 1, no gap
    received = events_of((files / "mqtt.log").read_text().splitlines())
    assert received, "no event reached mosquitto"
    for topic, event in received:
        assert topic == f"duomo/street/{event['kind']}", (topic, event["id"])
        assert event["id"] == f"street:{event['seq']}" and event["pipeline"] == "faces"
    seqs = [event["seq"] for _, event in received]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    kinds = [event["kind"] for _, event in received]
    assert {"answer", "object_appeared", "object_left"} <= set(kinds), kinds
    assert all(e["result"]["faces"] for _, e in received if e["kind"] == "answer")

    # the visit the guide waited for: a whole one, as the event reference says
    left = decode_event((files / "left.json").read_text())
    assert left["kind"] == "object_left" and left["source"] == "street"
    gone = left["object"]
    assert gone["frames"] >= 2 and gone["first_seen"] <= gone["last_seen"]
    assert {"embedding", "attributes"} <= set(gone["results"])

    # what the block printed: the face's object_appeared (from the foreground subscriber), the
    # counts on both brokers, Redis's first entry (field `event`), and the sinks in the status
    lines = out.splitlines()
    appeared = [decode_event(line) for line in lines if '"kind":"object_appeared"' in line]
    assert appeared and appeared[0]["object"]["track"] >= 1
    after = lines.index(next(line for line in lines if '"kind":"object_left"' in line))
    counted_mqtt, counted_redis = (int(n) for n in lines[after + 1 : after + 3])
    # (each broker's count when the block asked: the last events may still have been on the way)
    assert 1 <= counted_mqtt <= len(received) and 1 <= counted_redis <= len(received)
    at = lines.index("duomo:street")
    assert lines[at + 2] == "event", lines[at : at + 4]
    first = decode_event(lines[at + 3])
    assert (first["id"], first["kind"]) == ("street:1", "answer")
    for sink, kind in (("broker", "mqtt"), ("lake", "redis")):
        assert re.search(rf"^{sink} +connected +{kind} +[1-9]", out, re.M), out[-3000:]
