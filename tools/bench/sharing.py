"""The shared-weights benchmark of ``duomo bench --sharing`` (issue 36): the workload's supervisor
config (the demo's, ``configs/default.yaml``) with ``instances: 2`` on every model, once with
weight sharing on (the default) and once with ``share_weights: false`` on every model, under the
mixed load.

Each trial starts a fresh supervisor with every model of the config (``DuomoServers``: no gateway,
no ``/metrics``, a private socket), and once it is ready (loaded and warmed up) and has settled
for ``settle_s``, reads its resident and proportional memory and what its ledger says
(``status``: the device's charge, the copies of weights and their sizes). Then the workload's
producers (``tools.bench.producer``, the same as the mixed load's: every workload model, its
producers, closed loop, answers checked) run a ``warmup_s`` warm-up and a ``window_s`` window,
while ``TreeSampler`` samples the supervisor's peak resident memory and CPU; the answers give each
model's answers/s and the run's *work* (Σ answers/s ÷ that model's answers/s alone). The trials
take turns, on, off, then off, on (``rounds`` times, the order reversed every other time), so
the shared machine's drift hits both settings alike; before each, the run waits up to
``quiet_wait_s`` for the machine's other work to fall below ``quiet_below`` cores and records
what it saw.

The report's section is ``tools.bench.sharing_report``'s. Called by ``tools.bench.run``
(``--sharing``, ``--sharing-only``).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from tools.bench.children import open_window
from tools.bench.mixed_load import model_specs, producer_children, run_alone
from tools.bench.sampler import TreeSampler, tree_pss, tree_rss, wait_quiet
from tools.bench.servers import DuomoServers
from tools.bench.tally import merge
from tools.bench.workload import Workload

SHARING = {"on": True, "off": False}
MIB = 2**20


@dataclass(frozen=True)
class SharingSettings:
    """What the sharing benchmark runs (``duomo bench --sharing-*`` options)."""

    window_s: float = 20.0
    warmup_s: float = 5.0
    rounds: int = 2  # on, off, then off, on, …
    instances: int = 2  # on every model of the config
    settle_s: float = 2.0  # after the supervisor is ready, before the after-load reading
    quiet_below: float = 0.3  # before a trial, wait (≤ quiet_wait_s) for others' cores below this
    quiet_wait_s: float = 20.0


def _log(message: str) -> None:
    print(f"duomo bench: sharing: {message}", file=sys.stderr, flush=True)


def sharing_config(base: Path, out: Path, share: bool, instances: int) -> Path:
    """``base`` with an absolute ``model_root`` and, on every model, ``instances`` and
    ``share_weights: share``; written to ``out``. A gallery is left as it is: its matrix is
    data each instance builds for itself, never a file's weights to share."""
    raw = yaml.safe_load(base.read_text(encoding="utf-8"))
    root = raw.get("model_root")
    raw["model_root"] = str((base.parent / root).resolve()) if root else str(base.parent)
    for model in raw["models"]:
        if model.get("task") == "gallery":
            continue
        model["instances"] = instances
        model["share_weights"] = share
    out.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return out


def trial_order(rounds: int) -> list[tuple[int, str]]:
    """(round, setting) in the order they run: on, off, then off, on, and so on."""
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        order += [(r, s) for s in (("on", "off") if r % 2 == 0 else ("off", "on"))]
    return order


def ledger(status: dict[str, Any]) -> dict[str, Any]:
    """What the supervisor's ledger says of its memory: the devices' charge, its own resident
    reading, each model's measured own bytes and every copy of weights it counts (a copy that
    several models use is listed by each of them and counted once)."""
    copies: dict[tuple[str, int, int, tuple[str, ...]], dict[str, Any]] = {}
    own: dict[str, int | None] = {}
    for name, model in (status.get("models") or {}).items():
        memory = model.get("memory") or {}
        own[name] = (memory.get("measured") or {}).get("host_bytes")
        for i, w in enumerate(memory.get("weights") or []):
            users = tuple(sorted({name, *w.get("shared_with", [])}))
            # a copy of this model's alone is its own entry; a shared one, one for all users
            mine = (f"{name}#{i}",) if len(users) == 1 else users
            key = (str(w["file"]), int(w["device"]), int(w["bytes"]), mine)
            copies[key] = {"file": w["file"], "bytes": int(w["bytes"]), "models": list(users)}
    return {
        "device_used_bytes": sum(int(d.get("used_bytes") or 0) for d in status.get("devices", [])),
        "rss_bytes": status.get("rss_bytes"),
        "own_bytes": own,
        "weights": list(copies.values()),
        "weights_bytes": sum(c["bytes"] for c in copies.values()),
    }


def _status(servers: DuomoServers) -> dict[str, Any]:
    from duomo.ipc.client import Client

    socket = next(iter(servers.sockets.values()))
    with Client(socket, timeout_s=30) as client:
        return client.status().to_dict()  # (the JSON ``duomo status --json`` prints)


def trial(
    setting: str,
    workload: Workload,
    models: list[dict[str, Any]],
    settings: SharingSettings,
    workdir: Path,
) -> dict[str, Any]:
    """One supervisor with sharing ``setting`` ("on" or "off"): its memory after load and under
    the mixed load, and the load's answers."""
    workdir.mkdir(parents=True)
    config = sharing_config(
        workload.config, workdir / "sharing.yaml", SHARING[setting], settings.instances
    )
    every = [m["name"] for m in yaml.safe_load(config.read_text(encoding="utf-8"))["models"]]
    servers = DuomoServers(config, [every], workdir)
    started = time.monotonic()
    servers.start()
    try:
        start_s = time.monotonic() - started
        time.sleep(settings.settle_s)
        pids = servers.pids()
        after_load = {
            "rss_mib": tree_rss(pids) / MIB,
            "pss_mib": tree_pss(pids) / MIB,
            "ledger": ledger(_status(servers)),
        }
        producers = {m.name: m.producers for m in workload.models}
        children = producer_children(workload, servers, models, producers)
        start_at, end_at = open_window(children, settings.warmup_s, settings.window_s)
        time.sleep(max(0.0, start_at - time.time()))
        server = TreeSampler(pids).start()
        clients = TreeSampler([c.process.pid for c in children]).start()
        time.sleep(max(0.0, end_at - time.time()))
        resources, client_resources = server.stop(), clients.stop()
        tallies = [child.result() for child in children]
    finally:
        servers.stop()
    return {
        "sharing": setting,
        "start_s": start_s,
        "after_load": after_load,
        "resources": resources,
        "producers": client_resources,
        "models": {
            m["name"]: merge([t for t in tallies if t["model"] == m["name"]]) for m in models
        },
    }


def run_sharing(
    workload: Workload, settings: SharingSettings, workdir: Path, alone: dict[str, Any] | None
) -> dict[str, Any]:
    """Every trial, in turn; the raw figures ``tools.bench.sharing_report`` reports. ``alone``:
    the run's alone phase (each model's answers/s alone and expected answers), measured here
    when not given."""
    started = time.monotonic()
    if alone is None:
        _log(f"alone, in-process, one thread ({workload.alone_s:g} s each)")
        alone = run_alone(workload)
    models = model_specs(workload, alone)
    trials: list[dict[str, Any]] = []
    for r, setting in trial_order(settings.rounds):
        quiet = wait_quiet(settings.quiet_below, settings.quiet_wait_s)
        _log(f"round {r + 1}/{settings.rounds}: sharing {setting}, instances "
             f"{settings.instances} on every model")  # fmt: skip
        try:
            figures = trial(setting, workload, models, settings, workdir / f"{setting}-{r}")
        except (RuntimeError, OSError) as err:
            _log(f"sharing {setting}: {err}")
            figures = {"sharing": setting, "error": str(err)[:2000]}
        trials.append({**figures, "round": r, "quiet": quiet})
    return {
        "settings": asdict(settings),
        "config": str(workload.config),
        "window_s": settings.window_s,
        "alone": {n: {k: v for k, v in a.items() if k != "expected"} for n, a in alone.items()},
        "trials": trials,
        "elapsed_s": time.monotonic() - started,
    }


def bench_sharing(
    workload: Workload,
    out: Path,
    window_s: float,
    rounds: int,
    alone: dict[str, Any] | None = None,
) -> str:
    """``duomo bench --sharing``: run the part and add it to the report in ``out``; the report's
    Markdown section."""
    from tools.bench.sharing_report import add_to_report

    settings = SharingSettings(window_s=window_s, rounds=rounds)
    with tempfile.TemporaryDirectory(prefix="duomo-bench-sharing-") as tmp:
        raw = run_sharing(workload, settings, Path(tmp), alone)
    return add_to_report(raw, out)
