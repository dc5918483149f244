"""Lifecycle and resilience with real supervisor processes and real shared memory: reload under
load, load/unload, memory budgets with LRU eviction, the watchdog (failing and hanging models),
priorities with aging, and graceful shutdown."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError, UnavailableError
from tests.conftest import IMAGES, ROOT
from tests.integration.harness import (
    SupervisorProcess,
    affine_model,
    duomo,
    faulty_model,
    poll,
    running_supervisor,
    write_config,
)

IMAGE_FOR = {"classify": "coffee.png", "face": "astronaut.png", "ocr": "page.png"}
X = np.array([[1, 2, 3, 4]], dtype=np.float32)
FAST_WATCHDOG = {"period_ms": 100}


def models_status(sup: SupervisorProcess) -> dict[str, Any]:
    """Each model's status by name, as its JSON."""
    with Client(sup.socket) as client:
        return client.status().to_dict()["models"]


def state_of(sup: SupervisorProcess, name: str) -> str:
    return str(models_status(sup)[name]["state"])


def requests_of(sup: SupervisorProcess) -> dict[str, int]:
    """Each model's requests answered so far."""
    return {name: int(shown["requests"]) for name, shown in models_status(sup).items()}


def producer(
    sup: SupervisorProcess, model: str, seconds: float, kind: str | None = None, slots: int = 2
) -> subprocess.Popen[str]:
    kind = kind or model
    image = IMAGES / IMAGE_FOR.get(kind, "coffee.png")
    return subprocess.Popen(
        [
            sys.executable, "-m", "tests.integration.producer", str(sup.socket), model,
            str(image), "--count", "1000000", "--seconds", str(seconds), "--slots", str(slots),
            "--kind", kind,
        ],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def summary(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    return dict(json.loads(out.strip().splitlines()[-1]))


def answered(report: dict[str, Any]) -> int:
    return int(report.get("ok", 0) + report.get("wrong", 0) + sum(report["errors"].values()))


def test_reload_under_load_loses_nothing(tmp_path: Path, demo_config: object) -> None:
    """Producers on three models while the config changes twice: a batch size and an added
    model (`duomo reload`), then a removed model (SIGHUP)."""
    affine_model(tmp_path / "affine.onnx")
    affine = {
        "name": "affine",
        "task": "raw",
        "file": str(tmp_path / "affine.onnx"),
        "max_batch": 4,
    }
    config = write_config(tmp_path, ["face", "classify"], extra=[affine])
    with running_supervisor(config) as sup:
        producers = {
            "classify": producer(sup, "classify", 12),
            "face": producer(sup, "face", 12),
            "affine": producer(sup, "affine", 12, kind="affine"),
        }
        # every producer is served: the changes below come under load
        poll(lambda: min(requests_of(sup).get(m, 0) for m in producers) >= 5, timeout_s=60)
        added = {**affine, "name": "affine2"}
        write_config(
            tmp_path, ["face", "classify"], extra=[affine, added],
            overrides={"classify": {"max_batch": 4}},
        )  # fmt: skip
        reloaded = duomo(sup.socket, "reload")
        assert reloaded.returncode == 0, reloaded.stderr
        assert "added: affine2" in reloaded.stdout and "replaced: classify" in reloaded.stdout
        reloaded_at = requests_of(sup)  # served on the new config before the next change
        poll(lambda: all(requests_of(sup)[m] >= reloaded_at[m] + 5 for m in producers))
        write_config(
            tmp_path, ["classify"], extra=[affine, added], overrides={"classify": {"max_batch": 4}}
        )
        sup.process.send_signal(signal.SIGHUP)
        poll(lambda: "face" not in models_status(sup), timeout_s=60)
        shown = models_status(sup)
        assert shown["classify"]["max_batch"] == 4 and shown["affine2"]["state"] == "READY"
        with Client(sup.socket) as client:
            assert client.model("affine2").infer(X)["y"][0, 3] == 9.0
        reports = {name: summary(p) for name, p in producers.items()}
    for name, report in reports.items():
        assert report["sent"] > 10, (name, report)
        assert report.get("wrong", 0) == 0, (name, report)
        assert answered(report) == report["sent"], (name, report)  # nothing lost
    for name in ("classify", "affine"):
        assert reports[name]["ok"] == reports[name]["sent"], (name, reports[name])
    face = reports["face"]
    assert face["ok"] > 0 and set(face["errors"]) <= {"NotFoundError"}, face  # removed: typed


def test_load_unload_and_a_model_loaded_on_first_request(tmp_path: Path) -> None:
    lazy = faulty_model("lazy", preload=False, params={"offset": 5.0, "ballast_mb": 40})
    config = write_config(tmp_path, ["classify"], extra=[lazy])
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        shown = models_status(sup)
        assert shown["lazy"]["state"] == "UNLOADED" and not shown["lazy"]["memory"]["loaded"]
        measured = shown["classify"]["memory"]["measured"]
        assert measured["host_bytes"] + measured["weights_bytes"] > 1 << 20  # its whole load
        handle = client.model("lazy")  # the first attach loads it
        assert handle.infer(X)["y"][0, 0] == 7.0
        lazy_memory = models_status(sup)["lazy"]["memory"]
        assert lazy_memory["measured"]["host_bytes"] > 30 << 20  # the 40 MB ballast
        unloaded = duomo(sup.socket, "unload", "lazy")
        assert unloaded.returncode == 0 and "UNLOADED" in unloaded.stdout, unloaded.stderr
        assert state_of(sup, "lazy") == "UNLOADED"
        with pytest.raises(UnavailableError, match="duomo load lazy"):
            handle.infer(X)  # unloaded by an operator: it stays unloaded
        loaded = duomo(sup.socket, "load", "lazy")
        assert loaded.returncode == 0 and "READY" in loaded.stdout, loaded.stderr
        assert handle.infer(X)["y"][0, 0] == 7.0  # the same attachment serves again
        missing = duomo(sup.socket, "load", "nope")
        assert missing.returncode == 2 and "no model named 'nope'" in missing.stderr


def evictable(name: str, offset: float, **params: object) -> dict[str, object]:
    """A 60 MB evictable test model answering y = 2x + offset (c is not preloaded)."""
    params = {"ballast_mb": 60, "offset": offset, **params}
    return faulty_model(name, evictable=True, preload=name != "c", params=params)


BUDGET_FOR_TWO = {"id": 0, "kind": "cpu", "memory_budget_mb": 150}


def test_eviction_keeps_two_of_three_loaded_and_every_answer_correct(tmp_path: Path) -> None:
    """Three 60 MB models, a budget for two: requests alternating between them evict the least
    recently used idle one and load the next."""
    models = [evictable("a", 1.0), evictable("b", 2.0), evictable("c", 3.0)]
    config = write_config(tmp_path, [], extra=models, devices=[BUDGET_FOR_TWO])
    offsets = {"a": 1.0, "b": 2.0, "c": 3.0}
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        assert {n: s["state"] for n, s in models_status(sup).items()} == {
            "a": "READY", "b": "READY", "c": "UNLOADED",
        }  # fmt: skip
        handles = {name: client.model(name) for name in ("a", "b", "c")}
        for _ in range(4):
            for name in ("a", "b", "c"):
                assert handles[name].infer(X)["y"][0, 0] == 2.0 + offsets[name], name
        shown = models_status(sup)
        assert sum(s["state"] == "READY" for s in shown.values()) == 2
        assert sum(s["evictions"] for s in shown.values()) >= 10
        big = faulty_model("big", params={"ballast_mb": 200})
        write_config(tmp_path, [], extra=[*models, big], devices=[BUDGET_FOR_TWO])
        refused = duomo(sup.socket, "reload", "big")
        assert refused.returncode == 1, refused.stdout
        assert "'big' needs" in refused.stderr and "budget is 150 MB" in refused.stderr
        assert "big" not in models_status(sup)  # nothing changed


def test_eviction_never_takes_a_model_with_work_in_flight(tmp_path: Path) -> None:
    models = [evictable("a", 1.0, work_ms=1500), evictable("b", 2.0), evictable("c", 3.0)]
    config = write_config(tmp_path, [], extra=models, devices=[BUDGET_FOR_TWO])
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        a, b = client.model("a"), client.model("b")
        a_done: Future[Any] = a.infer_async(X)  # a: least recently used, but busy for 1.5 s
        poll(lambda: models_status(sup)["a"]["in_flight"] == 1)
        assert b.infer(X)["y"][0, 0] == 4.0
        assert client.model("c").infer(X)["y"][0, 0] == 5.0  # room made by evicting b
        shown = models_status(sup)
        assert shown["b"]["state"] == "UNLOADED" and shown["b"]["evictions"] == 1
        assert shown["a"]["evictions"] == 0
        assert a_done.result(30)["y"][0, 0] == 3.0


def test_a_failing_model_is_reinitialized_and_the_others_keep_serving(
    tmp_path: Path, demo_config: object
) -> None:
    """A model that fails every batch is degraded and reinitialized again and again (each load
    takes 1 s); the other models keep answering, correctly and without an error, and answer
    requests *while* it reinitializes: the reinitialization holds nothing they need. (Counts of
    answers, not latencies: what this costs in latency is the benchmark's to measure.)"""
    control = tmp_path / "flaky.fault"
    control.write_text("none")
    flaky = faulty_model(
        "flaky",
        params={"control_file": str(control), "offset": 1.0, "load_s": 1.0},
        health={"max_consecutive_failures": 3, "backoff_ms": 100, "max_restarts": 50},
    )
    others = ("classify", "face")
    config = write_config(tmp_path, ["face", "classify"], extra=[flaky], watchdog=FAST_WATCHDOG)
    with running_supervisor(config) as sup:
        during = {m: producer(sup, m, 20.0, slots=1) for m in others}
        poll(lambda: all(requests_of(sup)[m] > 0 for m in others))  # both producers serve
        control.write_text("raise")
        failures: list[str] = []
        stop = threading.Event()

        def stream() -> None:  # a steady stream into the failing model
            with Client(sup.socket) as client:
                handle = client.model("flaky")
                while not stop.is_set():
                    try:
                        handle.infer(X, timeout_s=10)
                    except DuomoError as err:
                        failures.append(err.code.name)
                    stop.wait(0.02)  # the stream's pace

        streamer = threading.Thread(target=stream)
        streamer.start()
        episode: dict[str, Any] = {}  # the reinitialization watched: its restart, the counts

        def others_served_while_it_reinitializes() -> bool:
            shown = models_status(sup)
            if shown["flaky"]["state"] != "REINITIALIZING":
                episode.clear()
                return False
            restart = shown["flaky"]["restarts_in_window"]
            counts = {m: shown[m]["requests"] for m in others}
            if episode.get("restart") != restart:  # a new reinitialization: count from here
                episode.update(restart=restart, counts=counts)
                return False
            return all(counts[m] > episode["counts"][m] for m in others)

        try:
            poll(others_served_while_it_reinitializes, timeout_s=60)
        finally:
            stop.set()
            streamer.join(30)
        shown = models_status(sup)["flaky"]
        assert shown["restarts_in_window"] >= 1, shown
        states = [h["state"] for h in shown["history"]]
        assert "DEGRADED" in states and "REINITIALIZING" in states, states
        control.write_text("none")
        poll(lambda: state_of(sup, "flaky") == "READY", timeout_s=60)
        with Client(sup.socket) as client:
            assert client.model("flaky").infer(X, timeout_s=10)["y"][0, 0] == 3.0  # it serves
        incident = {m: summary(p) for m, p in during.items()}
    assert set(failures) <= {"INTERNAL", "UNAVAILABLE"} and "INTERNAL" in failures
    for m in others:
        assert incident[m]["ok"] > 0, incident[m]
        assert incident[m].get("wrong", 0) == 0 and not incident[m]["errors"], incident[m]


def test_a_hung_model_is_degraded_answered_and_replaced(tmp_path: Path) -> None:
    control = tmp_path / "stuck.fault"
    control.write_text("hang")
    stuck = faulty_model(
        "stuck",
        max_batch=1,
        params={"control_file": str(control)},
        health={"exec_timeout_ms": 500, "backoff_ms": 0},
    )
    config = write_config(tmp_path, ["classify"], extra=[stuck], watchdog=FAST_WATCHDOG)
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=30) as client:
        handle = client.model("stuck", slots=4)
        slots = [handle.slot() for _ in range(4)]
        started = time.time()
        for slot in slots:  # the first runs (and hangs), three queue behind it
            slot.write(X)
            slot.submit()
        for slot in slots:
            with pytest.raises(UnavailableError):
                slot.wait(timeout_s=10)
        shown = models_status(sup)["stuck"]
        degraded = next(h for h in shown["history"] if h["state"] == "DEGRADED")
        assert "exec_timeout_ms" in degraded["reason"]
        # not before its batch had run exec_timeout_ms (0.5 s); the slots' answers above came
        # within their 10 s, long before the hang's own end (an hour): the watchdog ended it
        assert degraded["at"] - started >= 0.5
        hung = slots[0]  # its abandoned batch may still write into it: the slot stays reserved
        hung.submit()
        with pytest.raises(UnavailableError, match="still held"):
            hung.wait(timeout_s=10)
        control.write_text("none")
        # the hung thread ends
        poll(lambda: models_status(sup)["stuck"]["abandoned_workers"] == 0, timeout_s=60)
        poll(lambda: state_of(sup, "stuck") == "READY", timeout_s=60)
        hung.submit()
        assert hung.wait(timeout_s=10)["y"][0, 0] == 3.0  # released, served by the replacement
        for slot in slots:
            slot.release()
        assert handle.infer(X, timeout_s=10)["y"][0, 0] == 3.0
        assert client.model("classify").infer(np.zeros((8, 8, 3), np.uint8))["top"]


def test_low_priority_is_served_within_the_aging_bound(tmp_path: Path) -> None:
    """Four threads keep a 20 ms model saturated at priority 10; a request at priority 0 is
    still served, overtaken only by the high-priority requests that arrive within
    (10 - 0) / aging = 0.2 s after it. Counted, not timed: requests are numbered as they are
    sent (one connection keeps that order) and listed as they are answered, and the requests
    sent after the low one but answered before it are at most those that could arrive in
    0.2 s — each flooder sends one when one of its own is answered, and the model answers at
    most one per 20 ms: 0.2 / 0.020 + 1 answers, plus one per flooder for an answer just
    before. A slower machine answers fewer in 0.2 s, so it can only lower the count; without
    aging the low request would wait for as long as the flood lasts."""
    aging, work_s, flooders_n = 50.0, 0.020, 4
    busy = faulty_model(
        "busy", max_batch=1, queue_size=256, priority_aging_per_s=aging,
        params={"work_ms": work_s * 1e3},
    )  # fmt: skip
    config = write_config(tmp_path, [], extra=[busy])
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=30) as client:
        handle = client.model("busy", slots=16)
        stop = threading.Event()
        high_done: list[int] = []
        sending = threading.Lock()
        numbers = itertools.count()
        answered: list[int] = []  # request numbers, in the order they were answered

        def send(priority: int) -> tuple[int, Future[Any]]:
            with sending:  # numbered in the order they go out
                number = next(numbers)
                future = handle.infer_async(X, priority=priority)
            future.add_done_callback(lambda _f: answered.append(number))
            return number, future

        def flood() -> None:
            futures: list[Future[Any]] = []
            while not stop.is_set():
                futures.append(send(10)[1])
                if len(futures) >= 3:
                    futures.pop(0).result(30)
                    high_done.append(1)
            for future in futures:
                future.result(30)

        flooders = [threading.Thread(target=flood) for _ in range(flooders_n)]
        for thread in flooders:
            thread.start()
        poll(lambda: models_status(sup)["busy"]["queue_depth"] >= 8)  # saturated
        overtaken = []
        for _ in range(10):
            number, future = send(0)
            assert future.result(30)["y"][0, 0] == 3.0
            poll(lambda n=number: n in answered)
            before = answered[: answered.index(number)]
            overtaken.append(sum(1 for n in before if n > number))
        stop.set()
        for thread in flooders:
            thread.join(30)
    bound = round(10 / aging / work_s) + 1 + flooders_n
    assert len(high_done) > 50  # the model really was saturated by high priority
    assert max(overtaken) <= bound, (overtaken, bound)


def test_stop_says_when_its_grace_period_cut_requests(tmp_path: Path) -> None:
    slow = faulty_model("slow", max_batch=1, params={"work_ms": 5000})
    config = write_config(tmp_path, ["classify"], extra=[slow], shutdown_grace_s=0.5)
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=30) as client:
        future = client.model("slow").infer_async(X)
        poll(lambda: models_status(sup)["slow"]["in_flight"] == 1)  # running: the stop cuts it
        stopped = duomo(sup.socket, "stop")
        assert stopped.returncode == 3, (stopped.stdout, stopped.stderr)
        assert "cut 1 request" in stopped.stdout
        with pytest.raises(UnavailableError):
            future.result(10)
        assert sup.process.wait(30) == 3
