"""The report of ``duomo bench``: per mode and model throughput (correct answers per second; a
wrong answer counts as none), p50/p90/p99 latency, errors; the servers' resident memory and CPU;
**work** (Σ over models of answers/s ÷ that model's answers/s alone in-process on one thread);
the per-request overhead (the p50 through a server minus the in-process p50, and the p50 of the
round trip minus the server's own time in the executor: *accounted*), with its two floors
(``tools.bench.floor``: a bare server with one thread, and with the two threads Duomo's design asks
for) next to Duomo's; the targets.
Written into one folder as ``report.json`` (figures and every raw round), ``report.md`` and two
PNG charts (``throughput.png``, ``latency.png``).

Called by ``tools.bench.mixed_load`` with the raw rounds.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

PEERS = ("triton", "mosec")
# issue 45's bars against the peers (each model mixed, the work) and the in-process engine (a
# model alone through Duomo, one client)
PER_MODEL_LIMIT = 1.1
WORK_LIMIT = 1.6
ALONE_LIMIT = 0.97
# the two overhead figures: (name, its key in a probe's figures and in a mode's, the key of the
# floor's in Duomo's, of the design floor's)
OVERHEADS = (
    ("overhead", "overhead_ms", "floor_ms", "design_floor_ms"),
    ("accounted overhead", "accounted_ms", "floor_accounted_ms", "design_floor_accounted_ms"),
)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _probed(rounds: list[dict[str, Any]], probe: str, name: str) -> list[dict[str, Any]]:
    """Every round's ``probe`` ("overhead"; for duomo also "floor", "design_floor") of model
    ``name``."""
    return [r[probe][name] for r in rounds if name in r.get(probe, {})]


def _median(probes: list[dict[str, Any]], key: str) -> float | None:
    """The median over rounds of a probe's ``key`` (rounds without it do not count)."""
    values = [p[key] for p in probes if p.get(key) is not None]
    return statistics.median(values) if values else None


def _pace(probe: dict[str, Any]) -> dict[str, float | None]:
    """A probe's answers/s alone through the server ÷ in-process, one client (the in-process
    p50 ÷ the served p50, measured in the same minutes)."""
    served, direct = probe.get("p50_ms"), probe.get("direct_p50_ms")
    return {"pace": direct / served if served and direct else None}


def _mean_of(values: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over ``values``; None if any lacks it (a report of an older run)."""
    present = [v[key] for v in values if key in v]
    return statistics.fmean(present) if present and len(present) == len(values) else None


def _mode_figures(rounds: list[dict[str, Any]], alone: dict[str, Any]) -> dict[str, Any]:
    models: dict[str, Any] = {}
    work_rounds = [0.0] * len(rounds)
    for name, weight in ((n, a["rps"]) for n, a in alone.items()):
        parts = [r["models"][name] for r in rounds]
        rates = [p["ok"] / r["duration_s"] for p, r in zip(parts, rounds)]
        for i, rate in enumerate(rates):
            work_rounds[i] += rate / weight
        latencies = [x for p in parts for x in p["latencies_ms"]]
        errors: Counter[str] = Counter()
        for p in parts:
            errors.update(p["errors"])
        probes = _probed(rounds, "overhead", name)
        floors = _probed(rounds, "floor", name)
        design_floors = _probed(rounds, "design_floor", name)
        models[name] = {
            "rps": statistics.fmean(rates),
            "rps_rounds": rates,
            "kept": statistics.fmean(rates) / weight,  # its share of its lone pace
            "p50_ms": percentile(latencies, 0.50),
            "p90_ms": percentile(latencies, 0.90),
            "p99_ms": percentile(latencies, 0.99),
            "answers": len(latencies),
            # the overhead probes check their answers too
            "wrong": sum(p["wrong"] for p in (*parts, *probes, *floors, *design_floors)),
            "errors": dict(errors),
        }
        for _, key, floor_key, design_key in OVERHEADS:  # each probe's figure, median of rounds
            models[name][key] = _median(probes, key)
            models[name][floor_key] = _median(floors, key)
            models[name][design_key] = _median(design_floors, key)
        for key, where in (("alone_pace", probes), ("floor_alone_pace", floors)):
            models[name][key] = _median([_pace(p) for p in where], "pace")
    res = [r["resources"] for r in rounds]
    idle = next((r["idle"] for r in rounds if "idle" in r), None)
    return {
        "models": models,
        "work": statistics.fmean(work_rounds),
        # how evenly the models kept their lone pace: the least kept ÷ the most kept
        "kept_evenness": (
            min(m["kept"] for m in models.values()) / max(m["kept"] for m in models.values())
            if models and max(m["kept"] for m in models.values()) > 0
            else None
        ),
        "work_rounds": work_rounds,
        "rss_peak_mib": statistics.fmean(x["rss_peak_mib"] for x in res),
        "rss_peak_mib_rounds": [x["rss_peak_mib"] for x in res],
        "pss_end_mib": statistics.fmean(x["pss_end_mib"] for x in res),
        "processes": max(x["processes"] for x in res),
        "server_cpu_cores": statistics.fmean(x["cpu_cores"] for x in res),
        "client_cpu_cores": statistics.fmean(r["client_cpu_cores"] for r in rounds),
        "machine_busy_cores": _mean_of(res, "machine_busy_cores"),
        "machine_steal_cores": _mean_of(res, "machine_steal_cores"),
        "idle_cpu_percent": 100 * idle["cpu_cores"] if idle else None,
        "start_s": (
            statistics.fmean(r["start_s"] for r in rounds) if "start_s" in rounds[0] else None
        ),
    }


def _target(
    name: str,
    value: float | None,
    limit: float,
    at_least: bool,
    floor: float | None = None,
    design_floor: float | None = None,
    engine: float | None = None,
) -> dict[str, Any]:
    """One target; ``floor`` and ``design_floor`` are the values the one- and two-thread floor
    servers reached, where they were measured; ``engine`` the same ratio for the ``engine`` mode
    (a work target's: the issue's in-process limit, Duomo's executors, thread plan and gate
    without IPC, in this run; a reference, not a bound, since a run's noise can put Duomo
    above it)."""
    held = None if value is None else (value >= limit if at_least else value <= limit)
    return {
        "target": name, "value": value, "limit": limit, "at_least": at_least, "held": held,
        "floor": floor, "design_floor": design_floor, "engine": engine,
    }  # fmt: skip


def targets(modes: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for the modes that ran (ratios within this one run)."""
    duomo = modes.get("duomo")
    if duomo is None:
        return []

    def ratio(key: str, other: str) -> float:
        return float(duomo[key] / modes[other][key])

    def engine_work(other: str) -> float | None:
        return float(modes["engine"]["work"] / modes[other]["work"]) if "engine" in modes else None

    out = []
    if "engine" in modes:
        out.append(_target("duomo work ÷ engine work", ratio("work", "engine"), 0.95, True))
    if "per-model" in modes:
        work = ratio("work", "per-model")
        out.append(_target("duomo work ÷ per-model work", work, 1.2, True,
                           engine=engine_work("per-model")))  # fmt: skip
        memory = ratio("rss_peak_mib", "per-model")
        out.append(_target("duomo memory ÷ per-model memory", memory, 0.6, False))
    if "duomo-scraped" in modes:  # /metrics scraped once a second costs at most 1 %
        scraped = float(modes["duomo-scraped"]["work"] / duomo["work"])
        out.append(_target("duomo work with /metrics scraped ÷ without", scraped, 0.99, True))
    for model, fig in duomo["models"].items():  # alone, one client: served ÷ in-process pace
        if fig.get("alone_pace") is not None:
            name = f"{model} alone: answers/s ÷ in-process (one client)"
            out.append(_target(name, fig["alone_pace"], ALONE_LIMIT, True, fig["floor_alone_pace"]))
    if duomo.get("kept_evenness") is not None:  # fair sharing: no model starved by another
        out.append(_target("duomo kept shares, least ÷ most", duomo["kept_evenness"], 0.6, True))
    peers = [p for p in PEERS if p in modes]
    if peers:
        best = max(peers, key=lambda p: modes[p]["work"])
        out += _per_model_targets(duomo, modes, peers)
        out += _peer_targets("duomo", modes, best, engine_work(best), 0.8, OVERHEADS, 0.25)
        if "duomo-http" in modes:  # through the gateway: accounted overhead only
            out += _peer_targets(
                "duomo-http", modes, best, engine_work(best), 0.6, OVERHEADS[1:], 0.5
            )
    if duomo["idle_cpu_percent"] is not None:
        out.append(_target("idle supervisor CPU %", duomo["idle_cpu_percent"], 1.0, False))
    return out


def _per_model_targets(
    duomo: dict[str, Any], modes: dict[str, Any], peers: list[str]
) -> list[dict[str, Any]]:
    """Each model against the better peer for that model: answers/s ≥ ``PER_MODEL_LIMIT`` × its,
    and for the lightest model (the one a heavy one would starve) p99 ≤ its."""
    out = []
    for model, fig in duomo["models"].items():
        best = max(peers, key=lambda p: modes[p]["models"][model]["rps"])
        theirs = modes[best]["models"][model]["rps"]
        if theirs:
            name = f"{model} answers/s ÷ {best}'s (the better peer for it)"
            out.append(_target(name, fig["rps"] / theirs, PER_MODEL_LIMIT, True))
    lightest = max(duomo["models"], key=lambda m: duomo["models"][m]["rps"])
    p99s = [modes[p]["models"][lightest]["p99_ms"] for p in peers]
    ours = duomo["models"][lightest]["p99_ms"]
    if ours is not None and all(v is not None for v in p99s):
        best_p99 = min(p99s)
        name = f"{lightest} p99 ms (the lightest model) vs the better peer's {best_p99:.0f}"
        out.append(_target(name, ours, best_p99, False))
    return out


def _peer_targets(
    mode: str,
    modes: dict[str, Any],
    best: str,
    engine_work: float | None,
    memory_limit: float,
    overheads: tuple[tuple[str, str, str, str], ...],
    overhead_limit: float,
) -> list[dict[str, Any]]:
    """``mode`` against the better peer ``best``: work (≥ ``WORK_LIMIT`` ×), memory and each
    per-request overhead of ``overheads`` for every probed model (with the floors where ``mode``
    has them)."""
    ours = modes[mode]
    work = ours["work"] / modes[best]["work"]
    memory = ours["rss_peak_mib"] / modes[best]["rss_peak_mib"]
    out = [
        _target(f"{mode} work ÷ {best} work (the better peer)", work, WORK_LIMIT, True,
                engine=engine_work),
        _target(f"{mode} memory ÷ {best} memory", memory, memory_limit, False),
    ]  # fmt: skip
    for model, fig in ours["models"].items():
        for kind, key, floor_key, design_key in overheads:
            theirs, value = modes[best]["models"][model][key], fig[key]
            if value is None or not theirs:
                continue
            floor, design = (
                None if fig[k] is None else fig[k] / theirs for k in (floor_key, design_key)
            )
            through = "" if mode == "duomo" else f" ({mode})"
            name = f"{model} {kind}{through} ÷ {best} {kind}"
            target = _target(name, value / theirs, overhead_limit, False, floor, design)
            if value <= 0:  # faster than in-process: the reference's noise, not a result
                target["held"] = None
            out.append(target)
    return out


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def markdown(report: dict[str, Any]) -> str:
    modes, alone, machine = report["modes"], report["alone"], report["machine"]
    workload = report["workload"]
    names = list(alone)
    engine = modes.get("engine")
    producers = ", ".join(f"{m['name']} {m['producers']}" for m in workload["models"])
    weights = ", ".join(
        f"{n} {a['rps']:.2f}/s (p50 {a['p50_ms']:.1f} ms)" for n, a in alone.items()
    )
    lines = [
        f"# duomo bench — {report['date']}",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine['processor']}), Python {machine['python']}, "
        f"onnxruntime {machine['onnxruntime']}. Workload `{report['workload_file']}`: "
        f"{workload['loop']} loop, {workload['rounds']} interleaved round(s) of "
        f"{workload['duration_s']:g} s after {workload['warmup_s']:g} s warm-up; producers per "
        f"model {producers}.",
        "",
        f"Alone, in-process, one thread (the weights of *work*): {weights}.",
        "",
        "| mode | " + " | ".join(f"{n} answers/s (× engine)" for n in names)
        + " | work (× engine) | p99 ms " + "/".join(names)
        + " | wrong + errors | RSS peak MiB | PSS MiB | procs | cores server + clients "
        "| machine cores busy (stolen) |",
        "|---|" + "--:|" * len(names) + "--:|---|--:|--:|--:|--:|---|---|",
    ]  # fmt: skip
    errors: list[str] = []
    kept: list[str] = []
    for mode, f in modes.items():
        cells = []
        for n in names:
            rps, base = f["models"][n]["rps"], engine["models"][n]["rps"] if engine else 0
            cells.append(f"{rps:.2f}" + (f" ({rps / base:.2f})" if base else ""))
            for kind, count in f["models"][n]["errors"].items():
                errors.append(f"{mode} / {n}: {count} × {kind}")
        work_ratio = f" ({f['work'] / engine['work']:.2f})" if engine else ""
        kept.append(
            f"{mode} " + " / ".join(f"{f['models'][n]['kept']:.2f}" for n in names)
            + (f" (least ÷ most {f['kept_evenness']:.2f})" if f.get("kept_evenness") else "")
        )  # fmt: skip
        bad = sum(m["wrong"] + sum(m["errors"].values()) for m in f["models"].values())
        lines.append(
            f"| {mode} | " + " | ".join(cells) + f" | **{f['work']:.3f}**{work_ratio} | "
            + "/".join(_fmt(f["models"][n]["p99_ms"], ".0f") for n in names)
            + f" | {bad} | {f['rss_peak_mib']:.0f} | {f['pss_end_mib']:.0f} | {f['processes']} "
            f"| {f['server_cpu_cores']:.2f} + {f['client_cpu_cores']:.2f} "
            f"| {_fmt(f.get('machine_busy_cores'), '.2f')} "
            f"({_fmt(f.get('machine_steal_cores'), '.2f')}) |"
        )  # fmt: skip
    lines += ["", f"Kept share of each model's lone pace ({'/'.join(names)}): "
              + "; ".join(kept) + "."]  # fmt: skip
    if errors:
        lines += ["", "Errors: " + "; ".join(errors) + " (first messages in report.json)."]
    probed = workload["overhead_models"]

    def overhead_row(label: str, figures: dict[str, Any], row: int) -> str:
        """Both overheads of every probed model; ``row`` 0: the mode's own, 1: the floor's, 2:
        the design floor's (``OVERHEADS``' keys in that order)."""
        cells = [_fmt(figures[n][keys[row]], ".2f") for _, *keys in OVERHEADS for n in probed]
        return f"| {label} | " + " | ".join(cells) + " |"

    overhead_rows = []
    for mode, f in modes.items():
        if mode == "engine":
            continue
        overhead_rows.append(overhead_row(mode, f["models"], 0))
        if mode == "duomo":  # its floors, probed in the same client
            overhead_rows.append(overhead_row("floor", f["models"], 1))
            overhead_rows.append(overhead_row("design floor", f["models"], 2))
    if probed and overhead_rows and workload["overhead_s"] > 0:
        lines += [
            "",
            "Per-request overhead, ms: p50 with one client and that model alone, minus the p50 "
            "of the same executor called in the client's process; the client sends blocks of "
            "requests in turn in-process and through each server, and counts each block past "
            "its first requests (median over rounds). *floor*: a bare server process "
            "(`tools.bench.floor`: one thread, the image in shared memory, 12 bytes in and 8 "
            "out on a Unix socket, nothing else), probed in the same client as every server: "
            "what no server in another process can avoid on this machine. *design floor*: the "
            "same bare server with the design's two threads (one receives and hands the request "
            "over, the other runs and answers it): what no server of Duomo's design can avoid. "
            "*accounted*: the p50 of each round trip minus the time the server itself says it "
            "spent in the executor for that request (Duomo: the slot's stage timings, which "
            "add up to its time in `prepare` and `execute`; the floors and the peers' apps time "
            "the same `run_one`), so no difference in compute "
            "speed between processes enters it.",
            "",
            "| mode | " + " | ".join([*probed, *(f"{n}, accounted" for n in probed)]) + " |",
            "|---|" + "--:|" * 2 * len(probed),
            *overhead_rows,
        ]
    lines += [
        "",
        "| target | value | limit | held | the floor's value | the design floor's value "
        "| the engine's value |",
        "|---|--:|--:|---|--:|--:|--:|",
    ]
    for t in report["targets"]:
        sign = "≥" if t["at_least"] else "≤"
        held = {True: "yes", False: "**no**", None: "—"}[t["held"]]
        value, floor = _fmt(t["value"], ".3f"), _fmt(t.get("floor"), ".3f")
        design, engine_value = _fmt(t.get("design_floor"), ".3f"), _fmt(t.get("engine"), ".3f")
        lines.append(
            f"| {t['target']} | {value} | {sign} {t['limit']:g} | {held} | {floor} | {design} "
            f"| {engine_value} |"
        )
    per_round = "; ".join(
        f"{mode} " + " / ".join(f"{w:.3f}" for w in f["work_rounds"]) for mode, f in modes.items()
    )
    lines += ["", f"Work per round: {per_round}."]
    return "\n".join(lines) + "\n"


def charts(report: dict[str, Any], out: Path) -> list[str]:
    """throughput.png (work by mode, stacked by model) and latency.png (p50/p90/p99 per model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, names = report["modes"], list(report["alone"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(modes)
    for name in names:
        share = [f["models"][name]["rps"] / report["alone"][name]["rps"] for f in modes.values()]
        ax.bar(list(modes), share, bottom=bottom, label=name)
        bottom = [b + s for b, s in zip(bottom, share)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f}", ha="center", va="bottom")
    ax.set_ylabel("work (single-thread models' worth per second)")
    ax.set_title("Throughput by mode, mixed load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 4.5), squeeze=False)
    width = 0.8 / 3
    for ax, name in zip(axes[0], names):
        for j, q in enumerate(("p50_ms", "p90_ms", "p99_ms")):
            values = [modes[m]["models"][name][q] or 0.0 for m in modes]
            ax.bar([i + (j - 1) * width for i in range(len(modes))], values, width, label=q[:3])
        ax.set_xticks(range(len(modes)), list(modes), rotation=30, ha="right")
        ax.set_title(name)
        ax.set_ylabel("latency, ms")
        ax.legend()
    fig.suptitle("Latency percentiles by model, mixed load")
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close(fig)
    return ["throughput.png", "latency.png"]


def print_and_keep(out: Path | None, result: dict[str, Any], text: str) -> None:
    """A one-off measurement's tables printed, and kept in ``out`` (when given) as
    ``result.json`` (every figure) and ``report.md`` (the tables)."""
    print(text, end="")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "report.md").write_text(text)


def machine() -> dict[str, Any]:
    """The machine a report's figures come from (also ``add_part``'s)."""
    import onnxruntime

    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def targets_table(found: list[dict[str, Any]], spec: str) -> list[str]:
    """The Markdown lines of a benchmark part's targets (value, limit, held), each value formatted
    by ``spec``, after a blank line. Called by ``tools.bench.camera_report`` and
    ``tools.bench.pipeline_report``."""
    lines = ["", "| target | value | limit | held |", "|---|--:|--:|---|"]
    for t in found:
        sign = "≥" if t["at_least"] else "≤"
        held = {True: "yes", False: "**no**", None: "—"}[t["held"]]
        lines.append(
            f"| {t['target']} | {_fmt(t['value'], spec)} | {sign} {t['limit']:g} | {held} |"
        )
    return lines


def add_part(out: Path, key: str, part: dict[str, Any], section: str) -> None:
    """Put one benchmark's ``part`` under ``key`` in ``out/report.json`` and append its Markdown
    ``section`` to ``out/report.md``; where no report is there yet (the benchmark ran alone), both
    are written, with the date and the machine. Called by ``tools.bench.camera_report`` and
    ``tools.bench.pipeline_report``."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "report.json", out / "report.md"
    if json_path.is_file():
        report = json.loads(json_path.read_text(encoding="utf-8"))
        text = md_path.read_text(encoding="utf-8") if md_path.is_file() else ""
    else:
        report = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
        }
        m = report["machine"]
        text = (
            f"# duomo bench — {report['date']}\n\nMachine: {m['cpus']} CPUs ({m['processor']}), "
            f"Python {m['python']}, onnxruntime {m['onnxruntime']}.\n"
        )
    report[key] = part
    json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    md_path.write_text(text.rstrip("\n") + "\n\n" + section, encoding="utf-8")


def write_report(raw: dict[str, Any], out: Path) -> dict[str, Any]:
    modes = {mode: _mode_figures(rounds, raw["alone"]) for mode, rounds in raw["rounds"].items()}
    report = {
        "date": raw["date"],
        "machine": machine(),
        "workload_file": raw["workload_file"],
        "workload": raw["workload"],
        "alone": raw["alone"],
        "modes": modes,
        "targets": targets(modes),
    }
    report["markdown"] = markdown(report)
    report["charts"] = charts(report, out)
    (out / "report.md").write_text(report["markdown"], encoding="utf-8")
    (out / "report.json").write_text(
        json.dumps({**report, "raw_rounds": raw["rounds"]}, indent=1) + "\n", encoding="utf-8"
    )
    return report


def per_round(runs: list[dict[str, Any]], key: str, spec: str) -> str:
    """One figure of each round, ``a / b / …`` (the tables of ``tools.bench.batching`` and
    ``tools.bench.preload``)."""
    return " / ".join(format(run[key], spec) for run in runs)
