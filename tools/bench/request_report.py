"""The figures and the report of ``tools.bench.request_breakdown``: one round's raw records
reduced to its figures (``reduce_round``: the stage breakdown of the traced supervisor, every
kind's round trips and answers, the probe's and py-spy's view of the interpreter lock, the
Triton-style totals), and the Markdown of every round (``markdown``). The arithmetic is
``tools.bench.request_stages``'."""

from __future__ import annotations

import math
import statistics
from typing import Any

from tools.bench.request_stages import (
    CALLS,
    STAGES,
    gil_samples,
    gil_wait,
    join,
    probe_window,
    quantile,
    server_records,
    summarize,
)

KINDS = ("traced", "plain", "probed")
SMALL = ("classify", "face")
TOTAL_KINDS = ("queue", "compute_input", "compute_infer", "compute_output", "success")
# the trace's stages that make up each Triton-style total (its mean, for the check)
TOTAL_STAGES = {
    "queue": ("queue wait", "batch formation"),
    "compute_input": ("preprocess",),
    "compute_infer": ("infer",),
    "compute_output": ("postprocess",),
}


def _by_model(phase: dict[str, Any]) -> dict[str, list[list[Any]]]:
    records: dict[str, list[list[Any]]] = {}
    for p in phase["producers"]:
        records.setdefault(p["model"], []).extend(p["records"])
    return records


def _round_trips(records: list[list[Any]], window_s: float) -> dict[str, float]:
    trips = [r[-1] - r[3] for r in records]
    return {
        "requests": len(trips),
        "answers_per_s": len(trips) / window_s,
        "p50_ms": quantile(trips, 0.5) * 1e3,
        "p90_ms": quantile(trips, 0.9) * 1e3,
    }


def reduce_round(raw: dict[str, Any]) -> dict[str, Any]:
    """One round's figures from its raw results (``request_breakdown.measure``'s ``raw``)."""
    out: dict[str, Any] = {"inprocess": {n: {k: v for k, v in f.items() if k != "answers"}
                                         for n, f in raw["inprocess"].items()}}  # fmt: skip
    answers: dict[str, dict[str, set[str]]] = {}
    differing = 0
    for name, figures in raw["inprocess"].items():
        for k, text in figures["answers"].items():
            answers.setdefault(name, {}).setdefault(str(k), set()).add(text)
    traced = server_records(raw["traced"]["server"]) if "traced" in raw else []
    for kind in KINDS:
        if kind not in raw:
            continue
        out[kind] = {}
        for phase, figures in raw[kind].items():
            if phase == "server":
                continue
            start_s, end_s = figures["window_monotonic_s"]
            window_s = end_s - start_s
            by_model = _by_model(figures)
            fig: dict[str, Any] = {
                "round_trip": {m: _round_trips(r, window_s) for m, r in by_model.items()},
                "totals": figures["totals"],
                "cores_used": figures["cores_used"],
            }
            for p in figures["producers"]:
                differing += p["differing"]
                for k, text in p["answers"].items():
                    answers.setdefault(p["model"], {}).setdefault(str(k), set()).add(text)
            if kind == "traced":
                fig["stages"] = {m: summarize(join(r, traced)) for m, r in by_model.items()}
            if kind == "probed":
                probe = probe_window(raw["probed"]["server"], start_s, end_s)
                twin_fig = probe_window(figures["twin"], start_s, end_s)
                fig["gil"] = {"probe": probe, "twin": twin_fig, "wait": gil_wait(probe, twin_fig)}
                spy = figures.get("py_spy")
                if spy is not None:
                    fig["gil"]["py_spy"] = {
                        **gil_samples(spy["raw"], 100, spy["seconds"]),
                        "stderr_tail": spy["stderr"][-300:],
                    }
            out[kind][phase] = fig
    out["answers"] = {
        "same_everywhere": all(len(t) == 1 for per in answers.values() for t in per.values()),
        "distinct": {m: {k: len(t) for k, t in per.items()} for m, per in answers.items()},
        "changed_within_a_producer": differing,
    }
    return out


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return (
        "–"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else format(value, spec)
    )


def _cells(values: list[float | None], spec: str = ".2f") -> str:
    return " / ".join(_fmt(v, spec) for v in values)


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(kept) if kept else None


def _phase_name(model: str, phase: str) -> str:
    return f"{model} alone" if phase == f"{model} alone" else f"{model} under the mixed load"


def breakdown_table(rounds: list[dict[str, Any]], model: str, phase: str) -> list[str]:
    """The stage table of ``model`` in ``phase`` ("classify alone", "mixed"): per stage its p50,
    p90 and mean in ms, each round's (r1 / r2 / …)."""
    figs = [r["traced"][phase]["stages"][model] for r in rounds]
    rows = [
        f"**{_phase_name(model, phase)}** — requests: {_cells([f['requests'] for f in figs], 'd')}",
        "",
        "| stage | p50 ms | p90 ms | mean ms |",
        "|---|--:|--:|--:|",
    ]

    def row(stage: str, label: str) -> str:
        cells = [[f["stages"][stage][k] for f in figs] for k in ("p50_ms", "p90_ms", "mean_ms")]
        return f"| {label} | " + " | ".join(_cells(c) for c in cells) + " |"

    rows += [row(stage, stage) for stage in STAGES]
    rows.append(row("round trip", "**round trip**"))
    rows.append(
        "| Σ stages | "
        + _cells([f["sum_of_p50_ms"] for f in figs])
        + " | | "
        + _cells([f["sum_of_mean_ms"] for f in figs])
        + " |"
    )
    rows += [row(call, f"*{call}* (beside)") for call in CALLS]
    return rows


def markdown(result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    n = len(rounds)
    rows = [
        f"request breakdown, {result['date']}, {n} round(s) of {result['window_s']:g} s windows "
        f"(+{result['warmup_s']:g} s warm-up), niceness {result['niceness']}; "
        f"{result['machine']}",
        "",
        f"`{result['command']}`; each cell: round 1 / round 2 / …",
        "",
    ]
    for model in SMALL:
        for phase in (f"{model} alone", "mixed"):
            rows += [*breakdown_table(rounds, model, phase), ""]
    rows += [
        "in-process (the same executor, one thread, no IPC), p50 ms",
        "",
        "| model | preprocess | infer | postprocess | total |",
        "|---|--:|--:|--:|--:|",
    ]
    for model in SMALL:
        p50 = [r["inprocess"][model]["p50_ms"] for r in rounds]
        columns = ("preprocess", "infer", "postprocess", "total")
        joined = " | ".join(_cells([p[c] for p in p50]) for c in columns)
        rows.append(f"| {model} | {joined} |")
    rows += [
        "",
        "round trip by kind of supervisor: p50 ms (answers/s); traced: the trace on, plain: no "
        "instrument, probed: the lock probe and py-spy",
        "",
        "| phase | model | " + " | ".join(KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    for phase in ("classify alone", "face alone", "mixed"):
        for model in rounds[0]["plain"][phase]["round_trip"]:
            cells = []
            for kind in KINDS:
                trips = [r[kind][phase]["round_trip"][model] for r in rounds]
                cells.append(
                    _cells([t["p50_ms"] for t in trips])
                    + " ("
                    + _cells([t["answers_per_s"] for t in trips], ".1f")
                    + ")"
                )
            rows.append(f"| {phase} | {model} | " + " | ".join(cells) + " |")
    rows += [
        "",
        "cores used over the window (of 2), supervisor / every process, by kind of supervisor",
        "",
        "| phase | " + " | ".join(KINDS) + " |",
        "|---|" + "---|" * len(KINDS),
    ]
    for phase in ("classify alone", "face alone", "mixed"):
        cells = [
            "; ".join(
                _cells([r[kind][phase]["cores_used"][k] for k in ("supervisor", "machine")])
                for r in rounds
            )
            for kind in KINDS
        ]
        rows.append(f"| {phase} | " + " | ".join(cells) + " |")
    rows += [
        "",
        "the interpreter lock (probed supervisor): the probe's lateness at a 1 ms sleep, µs "
        "(p50 / p90 / p99 / mean), its run-queue wait per wake, the twin's mean lateness and "
        "run-queue wait; the lock's wait per wake (mean less the twin's; less the run-queue wait "
        "and the slack); py-spy: share of samples with the lock held",
        "",
        "| phase | probe p50 / p90 / p99 / mean | probe run-queue | twin mean / run-queue "
        "| lock wait (less twin / less run-queue+slack) | py-spy held | held by thread |",
        "|---|---|--:|---|---|--:|---|",
    ]
    for phase in ("classify alone", "face alone", "mixed"):
        for i, r in enumerate(rounds):
            g = r["probed"][phase]["gil"]
            p, t, w = g["probe"], g["twin"], g["wait"]
            spy = g.get("py_spy")
            held = _fmt(spy["held"] * 100, ".0f") + " %" if spy else "–"
            threads = (
                ", ".join(
                    f"{k} {v * 100:.0f} %"
                    for k, v in sorted(spy["by_thread"].items(), key=lambda kv: -kv[1])
                )
                if spy
                else "–"
            )
            rows.append(
                f"| {phase} (r{i + 1}) | "
                + _cells([p["p50_us"], p["p90_us"], p["p99_us"], p["mean_us"]], ".0f")
                + f" | {_fmt(p['runqueue_mean_us'], '.0f')} | "
                + _cells([t["mean_us"], t["runqueue_mean_us"]], ".0f")
                + " | "
                + _cells([w["mean_less_twin_us"], w["mean_less_runqueue_and_slack_us"]], ".0f")
                + f" | {held} | {threads} |"
            )
    rows += [
        "",
        "check: the Triton-style totals of each window (`status`), mean ms, against the trace's "
        "means of the same stages (traced supervisor, median of the rounds)",
        "",
        "| phase | model | " + " | ".join(f"{k} (totals / trace)" for k in TOTAL_STAGES) + " |",
        "|---|---|" + "---|" * len(TOTAL_STAGES),
    ]
    for phase in ("classify alone", "face alone", "mixed"):
        for model in SMALL:
            if model not in rounds[0]["traced"][phase]["totals"] or (
                phase != "mixed" and not phase.startswith(model)
            ):
                continue
            cells = []
            for kind, stages in TOTAL_STAGES.items():
                totals = _median([r["traced"][phase]["totals"][model][kind] for r in rounds])
                traced = _median([
                    sum(r["traced"][phase]["stages"][model]["stages"][s]["mean_ms"] for s in stages)
                    for r in rounds
                ])  # fmt: skip
                cells.append(f"{_fmt(totals)} / {_fmt(traced)}")
            rows.append(f"| {phase} | {model} | " + " | ".join(cells) + " |")
    same = all(r["answers"]["same_everywhere"] for r in rounds)
    changed = sum(r["answers"]["changed_within_a_producer"] for r in rounds)
    rows += [
        "",
        f"answers: the same for every image in every kind of supervisor and in-process: {same}; "
        f"answers that changed within a producer: {changed}",
    ]
    return "\n".join(rows) + "\n"
