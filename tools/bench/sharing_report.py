"""The shared-weights benchmark's part of the report: each trial's figures, the ratios sharing on
÷ off, the target, its Markdown section, and its place in the run's ``report.json`` and
``report.md``.

``add_to_report(raw, out)`` adds ``sharing`` (the trials' figures, the summary and every raw
trial of ``tools.bench.sharing``) to ``out/report.json`` and appends the section to
``out/report.md`` — or writes both, with the machine, when nothing else ran
(``--sharing-only``) — through ``tools.bench.report.add_part``. Called by
``tools.bench.sharing.bench_sharing``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from tools.bench.report import add_part, percentile, targets_table

MIB = 2**20
SETTINGS = ("on", "off")
# the mixed load's work "the same within noise": sharing on ÷ off at least this
WORK_LIMIT = 0.95


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def trial_figures(t: dict[str, Any], alone: dict[str, Any], window_s: float) -> dict[str, Any]:
    """One trial's figures: memory after load (RSS, PSS, the ledger's charge and weights) and
    under the load (peak RSS, PSS at the end), each model's answers/s and p99, the work, and
    the cores busy that were neither the supervisor's nor the producers' (*others*)."""
    rps = {name: m["ok"] / window_s for name, m in t["models"].items()}
    server, producers = t["resources"], t["producers"]
    busy = server.get("machine_busy_cores") or 0.0
    led = t["after_load"]["ledger"]
    return {
        "sharing": t["sharing"],
        "round": t["round"],
        "after_load_rss_mib": t["after_load"]["rss_mib"],
        "after_load_pss_mib": t["after_load"]["pss_mib"],
        "ledger_used_mib": led["device_used_bytes"] / MIB,
        "weights_mib": led["weights_bytes"] / MIB,
        "weight_copies": len(led["weights"]),
        "rss_peak_mib": server["rss_peak_mib"],
        "pss_end_mib": server["pss_end_mib"],
        "rps": rps,
        "p99_ms": {n: percentile(m["latencies_ms"], 0.99) for n, m in t["models"].items()},
        "wrong": sum(m["wrong"] for m in t["models"].values()),
        "errors": sum(sum(m["errors"].values()) for m in t["models"].values()),
        "work": sum(r / alone[n]["rps"] for n, r in rps.items()),
        "server_cores": server["cpu_cores"],
        "others_cores": busy - server["cpu_cores"] - producers["cpu_cores"],
        "start_s": t["start_s"],
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


KEYS = ("after_load_rss_mib", "rss_peak_mib", "pss_end_mib", "ledger_used_mib", "work")


def summary(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting the mean of each figure of ``KEYS`` and its rounds' values; the ratios on ÷
    off of the means, and of each round's pair (round r's on ÷ round r's off); the spread of
    the work between rounds of one setting (max ÷ min − 1: what noise alone does here)."""
    by = {s: [f for f in figures if f["sharing"] == s] for s in SETTINGS}
    out: dict[str, Any] = {"settings": {}, "ratios": {}, "ratios_by_round": {}}
    for setting, runs in by.items():
        out["settings"][setting] = {
            key: {"mean": _mean([f[key] for f in runs]), "rounds": [f[key] for f in runs]}
            for key in KEYS
        }
        works = [f["work"] for f in runs]
        out["settings"][setting]["work_spread"] = (
            max(works) / min(works) - 1 if len(works) > 1 and min(works) > 0 else None
        )
    for key in KEYS:
        on, off = (out["settings"][s][key]["mean"] for s in SETTINGS)
        out["ratios"][key] = _ratio(on, off)
        rounds = sorted({f["round"] for f in figures})
        pairs = [
            (
                next((f[key] for f in by["on"] if f["round"] == r), None),
                next((f[key] for f in by["off"] if f["round"] == r), None),
            )
            for r in rounds
        ]
        out["ratios_by_round"][key] = [_ratio(a, b) for a, b in pairs]
    return out


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The part's target: the mixed load's work with sharing on ÷ off (the same within noise)."""
    value = s["ratios"]["work"]
    held = None if value is None else value >= WORK_LIMIT
    return [{"target": "work, sharing on ÷ off (the same within noise)", "value": value,
             "limit": WORK_LIMIT, "at_least": True, "held": held}]  # fmt: skip


def markdown(raw: dict[str, Any], figures: list[dict[str, Any]], s: dict[str, Any]) -> str:
    """The section ``## Shared weights`` of report.md."""
    settings = raw["settings"]
    names = list(raw["alone"])
    lines = [
        "## Shared weights (issue 36)",
        "",
        f"The config's every model with `instances: {settings['instances']}`, weight sharing on "
        "(the default) and off (`share_weights: false` on every model), a fresh supervisor per "
        f"trial, in turn (on, off, off, on, …). *After load*: {settings['settle_s']:g} s after "
        f"the supervisor is ready (every model loaded and warmed up). Then the mixed load's "
        f"producers, {settings['warmup_s']:g} s warm-up and {settings['window_s']:g} s measured: "
        "*peak* is the supervisor's resident memory at its highest. *Ledger*: what "
        "`duomo status` charges the device, and the copies of weights it counts. *Others*: the "
        "cores busy that were neither the supervisor's nor the producers' (the machine is "
        "shared).",
        "",
        "| round | sharing | after load RSS / PSS MiB | ledger MiB (weights: copies, MiB) "
        "| peak RSS MiB | "
        + " | ".join(f"{n} answers/s" for n in names)
        + " | work | wrong, errors | others' cores |",
        "|--:|---|--:|--:|--:|" + "--:|" * len(names) + "--:|--:|--:|",
    ]
    for t in raw["trials"]:
        if "error" in t:
            lines.append(f"| {t['round'] + 1} | {t['sharing']} | {t['error'][:200]} |")
    for f in figures:
        answers = " | ".join(f"{f['rps'].get(n, 0.0):.2f}" for n in names)
        lines.append(
            f"| {f['round'] + 1} | {f['sharing']} | {f['after_load_rss_mib']:.0f} / "
            f"{f['after_load_pss_mib']:.0f} | {f['ledger_used_mib']:.0f} ({f['weight_copies']}, "
            f"{f['weights_mib']:.0f}) | {f['rss_peak_mib']:.0f} | {answers} | {f['work']:.3f} "
            f"| {f['wrong']}, {f['errors']} | {f['others_cores']:.2f} |"
        )
    lines += ["", "| figure | on | off | on ÷ off | by round |", "|---|--:|--:|--:|---|"]
    labels = {
        "after_load_rss_mib": ("resident memory after load, MiB", ".0f"),
        "rss_peak_mib": ("resident memory, peak under load, MiB", ".0f"),
        "pss_end_mib": ("proportional memory at the window's end, MiB", ".0f"),
        "ledger_used_mib": ("ledger's charge to the device, MiB", ".0f"),
        "work": ("work", ".3f"),
    }
    for key, (label, spec) in labels.items():
        on, off = (s["settings"][x][key]["mean"] for x in SETTINGS)
        rounds = " / ".join(_fmt(r, ".3f") for r in s["ratios_by_round"][key])
        lines.append(
            f"| {label} | {_fmt(on, spec)} | {_fmt(off, spec)} | {_fmt(s['ratios'][key], '.3f')} "
            f"| {rounds} |"
        )
    spreads = [s["settings"][x]["work_spread"] for x in SETTINGS]
    if any(v is not None for v in spreads):
        lines += [
            "",
            "Noise: the work of one setting moved by "
            + " and ".join(
                f"{_fmt(None if v is None else 100 * v, '.1f')}% ({x})"
                for x, v in zip(SETTINGS, spreads)
            )
            + " between its rounds.",
        ]
    lines += targets_table(targets(s), ".3f")
    return "\n".join(lines) + "\n"


def add_to_report(raw: dict[str, Any], out: Path) -> str:
    """Add the sharing part to ``out``'s report (made if absent); its Markdown section."""
    figures = [
        trial_figures(t, raw["alone"], raw["window_s"]) for t in raw["trials"] if "error" not in t
    ]
    s = summary(figures)
    section = markdown(raw, figures, s)
    part = {"targets": targets(s), "summary": s, "trials": figures, "raw": raw}
    add_part(out, "sharing", part, section)
    return section
