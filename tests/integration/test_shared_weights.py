"""Shared weights on real ONNX Runtime sessions (issue 36): four instances of the demo's
classifier and two replicas of it under other names keep one copy of its weights; with
``share_weights: false`` each keeps its own. Measured twice, each in a supervisor of its own
(real processes, requests through the CLI over the control socket and shared memory): by the
ledger (``duomo status --json``) and by the supervisor's resident memory (psutil).

Measured on the 2-vCPU dev VM (growth of the supervisor's RSS from before the first load to
after every instance answered, MiB): one instance 63; four instances and two replicas sharing
47–79; the same with ``share_weights: false`` 145–197. The ledger measured each of those six
copies at 18.6–19.8 MiB, one instance's at 19.8 (at 28–45 while a model's instances started
together: a copy then held another instance's warm-up), and charged the device 21, 25 and 121
MiB against RSS growths of 42, 48 and 145 (which also hold the libraries' pages first touched
and ONNX Runtime's one-time set-up). The bounds below hold with room for that spread and fail
without sharing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import yaml

from tests.conftest import ROOT
from tests.integration.harness import duomo, running_supervisor, write_config

IMAGE = ROOT / "tests" / "fixtures" / "images" / "chelsea.png"
MIB = 2**20
REPLICAS = ("classify_b", "classify_c")
WEIGHTS = 18 * 10**6  # EfficientNet-Lite0's float32 weights in the file


def _growth(tmp_path: Path, instances: int, replicas: bool, share: bool) -> dict[str, Any]:
    """Start a supervisor with classify (``instances``) and, if ``replicas``, two more models
    on the same file, nothing preloaded; load and ask each; return its RSS growth and status."""
    tmp_path.mkdir()
    entry = {"instances": instances, "preload": False, "share_weights": share}
    config = write_config(tmp_path, ["classify"], overrides={"classify": entry})
    if replicas:
        data = yaml.safe_load(config.read_text())
        classify = data["models"][0]
        data["models"] += [{**classify, "name": n, "instances": 1} for n in REPLICAS]
        config.write_text(yaml.safe_dump(data))
    names = ["classify", *(REPLICAS if replicas else ())]
    with running_supervisor(config) as sup:
        process = psutil.Process(sup.pid)
        before = process.memory_info().rss
        for name in names:
            loaded = duomo(sup.socket, "load", name)
            assert loaded.returncode == 0, loaded.stderr
        for name in names:  # every instance answers (requests go to whichever is free)
            for _ in range(instances if name == "classify" else 1):
                answer = duomo(sup.socket, "infer", name, str(IMAGE), "--json")
                assert answer.returncode == 0, answer.stderr
                assert (
                    json.loads(answer.stdout.splitlines()[0])["result"]["top"][0]["label"]
                    == "Egyptian cat"
                ), answer.stdout
        status = json.loads(duomo(sup.socket, "status", "--json").stdout)
        grown = process.memory_info().rss - before
    return {"grown": grown, "status": status, "names": names}


def test_instances_and_replicas_share_one_copy_of_the_weights(tmp_path: Path) -> None:
    one = _growth(tmp_path / "one", 1, replicas=False, share=True)
    shared = _growth(tmp_path / "shared", 4, replicas=True, share=True)
    copies = _growth(tmp_path / "copies", 4, replicas=True, share=False)

    (weights,) = one["status"]["models"]["classify"]["memory"]["weights"]
    assert weights["file"] == "efficientnet_lite0.onnx" and weights["shared_with"] == []

    # the ledger: one copy for all three models, charged to the device once
    models = shared["status"]["models"]
    sizes = set()
    for name in shared["names"]:
        (copy,) = models[name]["memory"]["weights"]
        assert copy["file"] == "efficientnet_lite0.onnx"
        assert sorted([name, *copy["shared_with"]]) == sorted(shared["names"])
        sizes.add(copy["bytes"])
    assert len(sizes) == 1
    used = shared["status"]["devices"][0]["used_bytes"]
    own = {n: models[n]["memory"]["measured"]["host_bytes"] for n in shared["names"]}
    assert used == sum(own.values()) + sizes.pop()

    # resident memory: one instance (its weights and activations) plus the activations of the
    # five others (a replica's own bytes: one instance's activations and buffers), within 1.1
    activations = max(own["classify_b"], own["classify_c"])
    bound = 1.1 * (one["grown"] + 5 * activations)
    assert shared["grown"] <= bound, (shared["grown"] / MIB, one["grown"] / MIB, activations)

    # share_weights: false: six copies, each charged on its own and each at least the file's
    # 18 MB of weights; the process holds them (at least three of the five extra visible)
    models = copies["status"]["models"]
    held = [c for n in copies["names"] for c in models[n]["memory"]["weights"]]
    assert len(held) == 6 and all(c["shared_with"] == [] for c in held)
    assert all(c["bytes"] >= WEIGHTS for c in held), [c["bytes"] / MIB for c in held]
    # each copy measured alone: as large as one instance's, within 10 %
    assert all(abs(c["bytes"] - weights["bytes"]) <= 0.1 * weights["bytes"] for c in held), [
        c["bytes"] / MIB for c in held
    ]
    for run in (one, shared, copies):  # the ledger never charges more than the process grew
        assert run["status"]["devices"][0]["used_bytes"] <= run["grown"], run["grown"] / MIB
    assert copies["grown"] - shared["grown"] >= 3 * WEIGHTS, (copies["grown"], shared["grown"])
    assert shared["grown"] <= one["grown"] + (copies["grown"] - one["grown"]) / 2
