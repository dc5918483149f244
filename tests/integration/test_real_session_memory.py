"""Memory budgets, eviction and loads on demand on real ONNX Runtime sessions of the demo models,
in a real supervisor process, measured from outside by the supervisor's resident memory.

What the ledger charges a model (``status``'s ``memory.charged_bytes``) is what its unload gives
back and what loading it again takes: after an unload (``duomo unload``) or an eviction, the
supervisor's RSS (psutil on its pid, read once it has settled) falls by the charge, and a load
raises it by the same, within ``TOLERANCE_MIB + TOLERANCE_SHARE`` × the charge — a load on demand
too: every figure checked against a charge is the process's own, never one the ledger measured,
which would only compare the ledger with itself. Requests through
producer processes and the test's client (real shared memory) are answered correctly after their
model was evicted and loaded again on demand; each eviction takes the least recently used idle
evictable model; the device's charged memory never goes over its budget; a model that cannot fit
is refused RESOURCE_EXHAUSTED; ``/metrics`` shows what ``status`` shows. Defaults throughout:
the shared CPU arena, memory patterns, glibc's tuned heap.

The tolerance, measured on a 2-core machine shared with other work (MiB: the charge, the RSS
fall on unload, the RSS rise on load; the spread over 8 runs of this test):

    ocr              67.1–69.1 / 62.3–63.2 / 63.8–66.7
    face             14.3–16.1 / 13.5–14.4 / 13.1–14.9  (evicted 13.0–13.7, on demand 12.8–13.1)
    classify         18.1–20.0 / 18.2–19.4 / 18.1–18.9
    face_embedding   38.0–39.6 / 37.8–38.1 / 37.8–38.1
    face_attributes  11.3–12.2 / 11.3–11.5 / 11.1–11.4

A model's first load in a process measures a little more than later ones (OCR's, the first of
all, by up to 6 MiB), and the charge keeps the largest; the worst gap, 6.8 MiB of 69.1 here and
8.3 of 69.0 in 6 more unload/load rounds (12 %), sets the bound at 3 MiB + 12 % of the charge.
Where one RSS move holds two models' (a load that evicts another), the other's part is what the
process gave back or took for that model in step 1, and its own 12 % is added to the bound:
unload falls and load rises of one model in one process agree within 0.4 MiB above (11.1–11.5
for face_attributes, 18.1–19.4 for classify), well inside that share. A load on demand is
measured between two reloads of the same config, each of which gives back what requests left in
the shared arena: face's first frames of 512×512 leave some 50 MiB of activations there, which
no load is charged (the ledger gives them back before it measures a load, too).
Before the ledger measured a load once the warm-up's memory had gone back, and a copy of weights
once its session's making had, the charges were 2 to 7 times what an unload gave back (face: 92
MiB charged, 13 to 40 back; OCR: 207 charged, 97 back).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from duomo.ipc.client import Client
from duomo.ipc.errors import ErrorCode, ResourceExhaustedError
from tests.conftest import IMAGES, ROOT, fixture_image
from tests.integration.harness import (
    SupervisorProcess,
    free_port,
    poll,
    running_supervisor,
    write_config,
)
from tests.integration.test_metrics import scrape, value

pytestmark = pytest.mark.integration
MiB = 1 << 20
TOLERANCE_MIB = 3.0
TOLERANCE_SHARE = 0.12
MODELS = ["ocr", "face", "classify", "face_embedding", "face_attributes"]  # the demo's order
PINNED = "face_embedding"  # evictable: false (the others are evictable)
EVICTABLE = ["face", "classify", "face_attributes"]  # under the budget: the LRU's candidates
IMAGE_FOR = {"classify": "coffee.png", "face": "astronaut.png"}


def tolerance(charged: int) -> float:
    return TOLERANCE_MIB * MiB + TOLERANCE_SHARE * charged


def _ring_inodes(pid: int) -> set[str]:
    """The client rings (``memfd:duomo-ring``) mapped in ``pid``, by inode."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[4] for line in maps if "/memfd:duomo-ring" in line}


@dataclass
class Observed:
    """The supervisor under test: its lifecycle calls, its status, its RSS, its producers."""

    sup: SupervisorProcess
    client: Client
    process: psutil.Process = field(init=False)

    def __post_init__(self) -> None:
        self.process = psutil.Process(self.sup.pid)

    def status(self) -> dict[str, Any]:
        """The supervisor's status, as its JSON."""
        return self.client.status().to_dict()

    def memory(self, name: str) -> dict[str, Any]:
        return dict(self.status()["models"][name]["memory"])

    def charged(self, name: str) -> int:
        return int(self.memory(name)["charged_bytes"])

    def states(self) -> dict[str, str]:
        return {n: m["state"] for n, m in self.status()["models"].items()}

    def evictions(self) -> dict[str, int]:
        return {n: m["evictions"] for n, m in self.status()["models"].items()}

    def unload(self, name: str) -> None:
        self.client.request("unload", model=name)
        shown = self.status()["models"][name]
        assert shown["state"] == "UNLOADED" and not shown["memory"]["loaded"], shown

    def load(self, name: str) -> None:
        self.client.request("load", model=name)
        shown = self.status()["models"][name]
        assert shown["state"] == "READY" and shown["memory"]["loaded"], shown

    def rss(self) -> int:
        """The supervisor's RSS once settled: the rings mapped are those of this test's own
        client (a producer that has left is detached), and two reads 100 ms apart agree within
        a quarter MiB."""
        mine = _ring_inodes(psutil.Process().pid)
        poll(lambda: _ring_inodes(self.sup.pid) <= mine, timeout_s=10)
        last = self.process.memory_info().rss
        deadline = time.monotonic() + 5
        while True:
            time.sleep(0.1)
            now = self.process.memory_info().rss
            if abs(now - last) < MiB // 4 or time.monotonic() > deadline:
                return now
            last = now

    def produce(self, model: str, count: int) -> None:
        """A producer process sends ``count`` requests to ``model``, one at a time; every one
        is answered, correctly."""
        done = subprocess.run(
            [
                sys.executable, "-m", "tests.integration.producer", str(self.sup.socket), model,
                str(IMAGES / IMAGE_FOR[model]), "--count", str(count), "--seconds", "120",
                "--slots", "1",
            ],
            cwd=ROOT, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report.get("ok") == count == report["sent"], (model, report)


def check_near(what: str, got: int, charged: int, beside: int = 0) -> None:
    """``got``, the process's own figure, is ``charged`` within the tolerance; ``beside``: the
    bytes of another model's move in ``got`` (taken from an earlier measurement of the process),
    whose own share of error is added to the bound."""
    bound = tolerance(charged) + TOLERANCE_SHARE * abs(beside)
    print(f"{what}: {got / MiB:.1f} MiB, charged {charged / MiB:.1f}")  # (shown with -s)
    assert abs(got - charged) <= bound, (
        f"{what}: {got / MiB:.1f} MiB against {charged / MiB:.1f} MiB charged "
        f"(tolerance {bound / MiB:.1f})"
    )


@contextmanager
def budget_watch(s: Observed) -> Iterator[list[tuple[int, int]]]:
    """Device 0's (used, budget) read from ``status`` every 20 ms by another client while the
    block runs."""
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def watch() -> None:
        with Client(s.sup.socket, timeout_s=60) as client:
            while not stop.is_set():
                device = client.status().devices[0]
                seen.append((device.used_bytes, device.budget_bytes))
                stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join(30)


def test_unloads_evictions_and_loads_on_demand_move_resident_memory_by_the_charge(
    tmp_path: Path, demo_config: object
) -> None:
    overrides: dict[str, dict[str, object]] = {
        n: {"preload": True, "evictable": n != PINNED} for n in MODELS
    }
    port = free_port()
    config = write_config(
        tmp_path, MODELS, overrides=overrides, metrics={"http": f"127.0.0.1:{port}"}
    )
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=120) as client:
        s = Observed(sup, client)
        assert set(s.states().values()) == {"READY"}

        # 1. an unload gives back the charge, a load takes it again (no budget yet)
        fell: dict[str, int] = {}  # what the process gave back on each model's unload
        rose: dict[str, int] = {}  # and took on its load
        for name in MODELS:
            charged = s.charged(name)
            before = s.rss()
            s.unload(name)
            unloaded = s.rss()
            s.load(name)
            fell[name], rose[name] = before - unloaded, s.rss() - unloaded
            check_near(f"{name}'s RSS fall on unload", fell[name], charged)
            check_near(f"{name}'s RSS rise on load", rose[name], s.charged(name))

        # 2. three of four fit the budget: the pinned model and any two of the evictable ones
        charges = {n: s.charged(n) for n in MODELS}
        fitted = [PINNED, *EVICTABLE]
        smallest = min(charges[n] for n in fitted)
        budget_mb = int((sum(charges[n] for n in fitted) - smallest / 2) // MiB)
        assert charges["ocr"] > budget_mb * MiB - charges[PINNED], "ocr must not fit: the test"
        s.unload("ocr")
        s.unload("classify")
        # the last uses, oldest first: face_embedding (pinned), face, face_attributes
        face = {"image": fixture_image("astronaut.png")}
        found = client.model("face").infer(face["image"])["faces"]
        face["landmarks"] = np.asarray(found[0]["landmarks"], dtype=np.float32)
        embedder, judge = client.model("face_embedding"), client.model("face_attributes")
        embedding = np.asarray(embedder.infer(face)["embedding"])
        s.produce("face", 2)
        attributes = judge.infer(face)
        write_config(
            tmp_path, MODELS, overrides=overrides, metrics={"http": f"127.0.0.1:{port}"},
            devices=[{"id": 0, "kind": "cpu", "memory_budget_mb": budget_mb}],
        )  # fmt: skip
        client.request("reload")  # (and it gives back what requests left in the arena)
        assert s.status()["devices"][0]["budget_bytes"] == budget_mb * MiB

        with budget_watch(s) as seen:
            # 3. a load under the budget evicts the least recently used idle evictable model
            # (face: face_embedding is older but pinned); face's memory goes back
            before = s.rss()
            s.load("classify")
            after = s.rss()
            states, evictions = s.states(), s.evictions()
            assert states["face"] == "UNLOADED" and evictions["face"] == 1, states
            assert states["face_embedding"] == states["face_attributes"] == "READY", states
            grown = rose["classify"]  # its load, after the eviction (the process's, step 1)
            check_near(
                "face's RSS fall on eviction", before - (after - grown), charges["face"], grown
            )

            # 4. a request for the evicted face loads it on demand and is answered; that load
            # evicts face_attributes (classify has served since)
            # (measured between reloads of the same config, each of which gives back what
            # requests left in the arena: what is left is what the models hold)
            s.produce("classify", 2)
            client.request("reload")
            before = s.rss()
            s.produce("face", 3)
            client.request("reload")
            after = s.rss()
            states, evictions = s.states(), s.evictions()
            assert states["face_attributes"] == "UNLOADED" and evictions["face_attributes"] == 1
            assert states["classify"] == states["face"] == "READY", states
            given = fell["face_attributes"]  # its eviction (the process's, step 1)
            check_near("face's load on demand", after - before + given, charges["face"], given)

            # 5. and once more: face_attributes asked for evicts classify, answers the same
            again = judge.infer(face)
            assert again["gender"] == attributes["gender"], (again, attributes)
            assert abs(again["age"] - attributes["age"]) < 1e-3, (again, attributes)
            assert s.states()["classify"] == "UNLOADED" and s.evictions()["classify"] == 1
            assert np.allclose(embedder.infer(face)["embedding"], embedding, atol=1e-5)

            # 6. a model that cannot fit however many idle models go is refused, nothing evicted
            states = s.states()
            with pytest.raises(ResourceExhaustedError, match=r"'ocr' needs .* budget is") as err:
                client.request("load", model="ocr")
            assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED
            assert s.states() == states
        assert seen and all(used <= budget for used, budget in seen), max(seen)

        # /metrics shows what status shows
        shown, samples = s.status(), scrape(port)
        device = shown["devices"][0]
        assert value(samples, "duomo_device_memory_used_bytes", device="0") == device["used_bytes"]
        for name, model in shown["models"].items():
            memory, labels = model["memory"], {"model": name, "device": "0"}
            charged = memory["charged_bytes"] if memory["loaded"] else 0
            weights = sum(c["bytes"] for c in memory["weights"]) if memory["loaded"] else 0
            assert value(samples, "duomo_model_memory_bytes", **labels) == charged, name
            assert value(samples, "duomo_model_weights_bytes", **labels) == weights, name
