"""Sources run by the supervisor (issue 43, item 3): a real supervisor with two source workers and
its gateway; cameras added and removed through ``duomo source`` and ``/v1/sources`` while
another plays, kept across a supervisor restart, moved when their worker is killed, changed by
``duomo reload``; their secrets never shown. The cameras here are looping files (a camera's
network side is ``test_source_health.py``'s); a camera's answers are read the way a user reads
them, ``duomo source tail``'s JSON lines.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from duomo.ipc.runtime_dir import source_tail_path
from tests.conftest import poll
from tests.integration.harness import (
    SupervisorProcess,
    duomo,
    free_port,
    running_supervisor,
    short_socket_dir,
    write_config,
)
from tests.integration.video_fixtures import make_test_video

pytestmark = pytest.mark.integration

PAUSE_BOUND_S = 2.0  # the longest gap between a playing camera's answers while others change
MOVED_WITHIN_S = 10.0  # a killed worker's sources answer again on another within this
SECRET = "hunter2-not-shown"
SECRET_VAR = "DUOMO_TEST_CAMERA_PASSWORD"
FPS = 4


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_video(tmp_path_factory.getbasetemp() / "videos")


EVENTS_FILE = "events.jsonl"  # the file sink "lines", beside the config


def camera(name: str, video: Path, **fields: object) -> dict[str, Any]:
    """A looping file played as a camera into classify at ``FPS``."""
    return {"name": name, "url": str(video), "models": ["classify"], "max_fps": FPS, **fields}


class Fleet:
    """The supervisor under test, its log, its gateway's HTTP address and its metrics port."""

    def __init__(
        self, sup: SupervisorProcess, log: Path, http: str, config: Path, metrics: str
    ) -> None:
        self.sup, self.log, self.http, self.config = sup, log, http, config
        self.metrics = metrics

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30) as reply:
            return str(reply.read().decode())

    def cli(self, *args: str) -> tuple[int, str, str]:
        done = duomo(self.sup.socket, "source", *args)
        return done.returncode, done.stdout, done.stderr

    def sources(self) -> dict[str, dict[str, Any]]:
        code, out, err = self.cli("list", "--json")
        assert code == 0, err
        return {s["name"]: s for s in json.loads(out)}

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        host, port = self.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data)
            response = conn.getresponse()
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
        finally:
            conn.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, video: Path) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("fleet")
    http_at, metrics_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    secret_url = f"rtsp://admin:${{{SECRET_VAR}}}@127.0.0.1:{free_port()}/cam"
    config = write_config(
        folder, ["classify"],
        gateway={"http": http_at, "grpc": None, "workers": 1},
        sources=[
            camera("lobby", video),
            {"name": "locked", "url": secret_url, "models": ["classify"], "failed_after_s": 2},
        ],
        source_workers={"count": 2}, metrics={"http": metrics_at},
        # (a path relative to the config file's folder: a source added over HTTP names it)
        sinks=[{"name": "lines", "kind": "file", "path": EVENTS_FILE}],
    )  # fmt: skip
    log = folder / "supervisor.log"
    os.environ[SECRET_VAR] = SECRET  # (the supervisor and its workers inherit it)
    try:
        with running_supervisor(config, log=log) as sup:
            yield Fleet(sup, log, http_at, config, metrics_at)
    finally:
        del os.environ[SECRET_VAR]


class Tail:
    """A camera's answers as they arrive (``duomo source tail``'s socket), with when each came."""

    def __init__(self, fleet: Fleet, name: str) -> None:
        source = fleet.sources()[name]
        path = source_tail_path(fleet.sup.socket, source["worker_index"])
        self.arrivals: list[float] = []
        self.lines: list[dict[str, Any]] = []
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(str(path))
        self._conn.sendall(json.dumps({"source": name, "count": 1_000_000}).encode() + b"\n")
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError), self._conn.makefile("r") as lines:
            for line in lines:
                self.arrivals.append(time.monotonic())
                self.lines.append(json.loads(line))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        self._thread.join(10)

    def longest_pause_s(self) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return max(gaps, default=float("inf"))


def answered(fleet: Fleet, name: str, at_least: int) -> bool:
    return fleet.sources().get(name, {}).get("answered", 0) >= at_least


def test_sources_come_and_go_through_the_cli_and_http_while_another_plays(
    fleet: Fleet, video: Path
) -> None:
    poll(lambda: answered(fleet, "lobby", 3), timeout_s=60)
    tail = Tail(fleet, "lobby")
    try:
        poll(lambda: len(tail.lines) >= 3, timeout_s=30)
        code, out, err = fleet.cli(
            "add", "dock", str(video), "--model", "classify", "--max-fps", str(FPS)
        )
        assert code == 0 and "source dock added" in out, err
        body = camera("gate", video, policy="fifo", sinks=["lines"], emit="answers")
        status, added = fleet.call("POST", "/v1/sources", body)
        assert status == 201 and added["name"] == "gate" and added["origin"] == "runtime", added
        poll(lambda: answered(fleet, "dock", 3) and answered(fleet, "gate", 3), timeout_s=60)
        # its answers reach the sink it named, as events numbered from 1
        events = fleet.config.parent / EVENTS_FILE

        def gate_events() -> list[dict[str, Any]]:
            lines = events.read_text().splitlines() if events.exists() else []
            return [e for e in map(json.loads, lines) if e["source"] == "gate"]

        poll(lambda: len(gate_events()) >= 3, timeout_s=30)
        first = gate_events()[:3]
        assert [e["seq"] for e in first] == [1, 2, 3] and {e["kind"] for e in first} == {"answer"}
        assert first[0]["id"] == "gate:1" and first[0]["model"] == "classify", first[0]
        status, listed = fleet.call("GET", "/v1/sources")
        assert status == 200 and {s["name"] for s in listed} == {"lobby", "locked", "dock", "gate"}
        status, one = fleet.call("GET", "/v1/sources/dock")
        assert status == 200 and one["state"] == "playing" and one["worker"] is not None
        # spread: the two new cameras went to the worker that had fewer
        workers = {s["name"]: s["worker"] for s in fleet.sources().values()}
        assert len(set(workers.values())) == 2, workers

        assert fleet.cli("remove", "dock")[0] == 0
        assert fleet.call("DELETE", "/v1/sources/gate") == (200, {"removed": "gate"})
        poll(lambda: set(fleet.sources()) == {"lobby", "locked"}, timeout_s=10)
        started = len(tail.lines)
        poll(lambda: len(tail.lines) >= started + 3, timeout_s=30)  # still playing after
    finally:
        tail.close()
    assert tail.longest_pause_s() <= PAUSE_BOUND_S, tail.longest_pause_s()
    line = tail.lines[-1]
    assert line["stream"] == "lobby" and line["model"] == "classify" and "result" in line
    assert line["clock"] == "arrival" and line["captured_at"].endswith("Z")


def test_bad_changes_are_refused_with_the_reason_and_change_nothing(
    fleet: Fleet, video: Path
) -> None:
    before = fleet.sources()
    cases = [
        (camera("lobby", video), 400, "exists already (from the config)"),
        (camera("x", video, models=["nope"]), 404, "no model named 'nope'"),
        ({**camera("y", video), "colour": "red"}, 400, "colour: unknown key (check the spelling)"),
        (camera("z", video, url="ftp://10.0.0.9/x"), 400, "url: 'ftp://10.0.0.9/x' is not"),
        (camera("w", video, weight=5e-324), 400, "weight"),
        (camera("bad name!", video), 400, "name"),
        (camera("v", video, sinks=["nope"]), 400, "sinks: no sink named 'nope'"),
        (camera("u", video, sinks=["nope"], emit="sideways"), 400, "emit"),
    ]
    for body, status, message in cases:
        got, reply = fleet.call("POST", "/v1/sources", body)
        assert got == status and message in reply["error"], (body, got, reply)
    assert fleet.call("DELETE", "/v1/sources/lobby")[0] == 400  # (a config source)
    assert fleet.call("DELETE", "/v1/sources/nobody")[0] == 404
    assert fleet.call("GET", "/v1/sources/nobody")[0] == 404
    assert fleet.call("PUT", "/v1/sources")[0] == 405
    assert fleet.call("POST", "/v1/sources/lobby", {}) == (
        405, {"error": "this endpoint takes GET or DELETE"}
    )  # fmt: skip
    assert fleet.call("GET", "/v1/sources/lobby/x") == (
        404, {"error": "no endpoint: /v1/sources/{name}"}
    )  # fmt: skip
    code, _, err = fleet.cli("remove", "lobby")
    assert code == 2 and "declared in the config" in err
    code, _, err = fleet.cli("add", "lobby2", "gopher://x", "--model", "classify")
    assert code == 2 and "is not a source" in err
    assert set(fleet.sources()) == set(before)


def test_a_killed_source_workers_cameras_play_again_on_another(fleet: Fleet) -> None:
    poll(lambda: answered(fleet, "lobby", 1), timeout_s=60)
    before = fleet.sources()["lobby"]
    os.kill(before["worker"], signal.SIGKILL)
    killed_at = time.monotonic()

    def elsewhere_and_answering() -> bool:
        now = fleet.sources()["lobby"]
        return now["worker"] not in (None, before["worker"]) and now["answered"] >= 2

    poll(elsewhere_and_answering, timeout_s=MOVED_WITHIN_S + 20)
    took_s = time.monotonic() - killed_at
    assert took_s <= MOVED_WITHIN_S, took_s
    assert "its sources move" in fleet.log.read_text()


def test_secrets_are_never_shown(fleet: Fleet) -> None:
    poll(lambda: fleet.sources()["locked"]["state"] == "failed", timeout_s=60)
    locked = fleet.sources()["locked"]
    assert locked["url"].startswith("rtsp://admin:***@") and "Connection refused" in (
        locked["last_error"] or ""
    )
    status = duomo(fleet.sup.socket, "status").stdout
    assert "locked: failed: rtsp://admin:***@127.0.0.1" in status, status  # (its table and error)
    shown = [
        fleet.cli("list")[1], fleet.cli("list", "--json")[1], fleet.cli("show", "locked")[1],
        json.dumps(fleet.call("GET", "/v1/sources")[1]), fleet.log.read_text(), status,
        duomo(fleet.sup.socket, "status", "--json").stdout, fleet.scrape(),
    ]  # fmt: skip
    for text in shown:
        assert SECRET not in text


def test_the_sources_health_is_in_the_metrics(fleet: Fleet) -> None:
    poll(lambda: answered(fleet, "lobby", 2), timeout_s=60)
    poll(lambda: fleet.sources()["locked"]["state"] == "failed", timeout_s=60)
    text = fleet.scrape()
    assert 'duomo_source_state{source="locked",state="failed"} 1.0' in text
    assert 'duomo_source_state{source="locked",state="playing"} 0.0' in text
    assert 'duomo_source_state{source="lobby",state="playing"} 1.0' in text
    decoded = [line for line in text.splitlines() if line.startswith("duomo_source_decoded_total")]
    assert any('source="lobby"' in line and float(line.split()[-1]) > 0 for line in decoded)
    reconnects = [line for line in text.splitlines() if "duomo_source_reconnects_total" in line]
    assert any('source="locked"' in line and float(line.split()[-1]) >= 1 for line in reconnects)


def test_sources_added_at_run_time_outlive_the_supervisor(video: Path) -> None:
    folder = short_socket_dir()
    try:
        config = write_config(folder, ["classify"], source_workers={"count": 1})
        socket_path = folder / "kept.sock"  # (not duomo.sock: the harness keeps the folder)
        with running_supervisor(config, socket_path=socket_path) as sup:
            done = duomo(sup.socket, "source", "add", "kept", str(video), "--model", "classify",
                         "--max-fps", str(FPS))  # fmt: skip
            assert done.returncode == 0, done.stderr
        with running_supervisor(config, socket_path=socket_path) as sup:
            shown = json.loads(duomo(sup.socket, "source", "list", "--json").stdout)
            assert [(s["name"], s["origin"]) for s in shown] == [("kept", "runtime")]

            def playing() -> bool:
                listed = json.loads(duomo(sup.socket, "source", "list", "--json").stdout)
                return listed[0]["answered"] >= 2

            poll(playing, timeout_s=60)
            assert duomo(sup.socket, "source", "remove", "kept").returncode == 0
        with running_supervisor(config, socket_path=socket_path) as sup:
            assert json.loads(duomo(sup.socket, "source", "list", "--json").stdout) == []
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_reload_adds_removes_and_replaces_config_sources_while_others_play(
    fleet: Fleet, video: Path
) -> None:
    raw = yaml.safe_load(fleet.config.read_text())
    original = fleet.config.read_text()
    poll(lambda: answered(fleet, "lobby", 1), timeout_s=60)
    tail = Tail(fleet, "lobby")
    try:
        raw["sources"] = [
            raw["sources"][0],  # lobby: unchanged, keeps playing
            {**raw["sources"][1], "failed_after_s": 3},  # locked: replaced
            camera("yard", video),  # added
        ]
        fleet.config.write_text(yaml.safe_dump(raw))
        done = duomo(fleet.sup.socket, "reload")
        assert done.returncode == 0, done.stderr
        poll(lambda: answered(fleet, "yard", 2), timeout_s=60)
        fleet.config.write_text(original)  # yard removed, locked back
        assert duomo(fleet.sup.socket, "reload").returncode == 0
        poll(lambda: "yard" not in fleet.sources(), timeout_s=10)
        started = len(tail.lines)
        poll(lambda: len(tail.lines) >= started + 3, timeout_s=30)
    finally:
        fleet.config.write_text(original)
        tail.close()
    assert tail.longest_pause_s() <= PAUSE_BOUND_S, tail.longest_pause_s()
    assert "source state" in fleet.log.read_text()
