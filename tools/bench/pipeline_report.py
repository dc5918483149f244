"""The pipeline benchmark's part of the report: its targets, its Markdown section, and its place
in the run's ``report.json`` and ``report.md``.

``add_to_report(raw, out)`` adds ``pipelines`` (the targets, the ratios and every raw trial of
``tools.bench.pipelines``) to ``out/report.json`` and appends the section to ``out/report.md``
— or writes both, with the machine, when nothing else ran (``--pipelines-only``) — through
``tools.bench.report.add_part``. Called by ``tools.bench.pipelines.bench_pipelines``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench.report import add_part, targets_table

VARIANT_NAMES = {
    "pipeline": "(a) Duomo pipeline `faces`",
    "client": "(b) client-driven chain, per-face requests in flight together",
    "client-seq": "(b') client-driven chain, per-face requests one by one",
    "triton": "(c) Triton 2.51 BLS `faces`",
}
SUB_STEPS = ("embedding", "attributes")


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def others(t: dict[str, Any]) -> float:
    """The cores a trial's machine kept busy that were neither its servers nor its producers
    (the machine is shared)."""
    busy = t["server"].get("machine_busy_cores") or 0.0
    return float(busy - t["server"]["cpu_cores"] - t["producers"]["cpu_cores"])


def least_disturbed(trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of ``trials`` (each round's), the one that ran with the fewest cores of others' work:
    the one the ratios use."""
    ran = [t for t in trials if "error" not in t]
    return min(ran, key=others) if ran else None


def cpu_ms_per_frame(t: dict[str, Any]) -> float | None:
    """The server's and producers' CPU per frame answered, in ms: what a frame costs, which
    others' work on a shared machine changes far less than the frames/s."""
    cores = t["server"]["cpu_cores"] + t["producers"]["cpu_cores"]
    return cores * 1e3 / t["fps"] if t["fps"] else None


def _trial(raw: dict[str, Any], variant: str, faces: int) -> dict[str, Any] | None:
    return least_disturbed(
        [t for t in raw["chain"]["trials"] if t["variant"] == variant and t["faces"] == faces]
    )


def _every(raw: dict[str, Any], every: int) -> dict[str, Any] | None:
    return least_disturbed([t for t in raw["tracker"]["trials"] if t["reinfer_every"] == every])


def ratios(raw: dict[str, Any], cpu: bool = False) -> dict[str, dict[str, float | None]]:
    """Per face count, the pipeline's frames/s ÷ each other variant's (same run); with ``cpu``,
    each other variant's CPU per frame ÷ the pipeline's (above 1: the pipeline costs less)."""
    found: dict[str, dict[str, float | None]] = {}
    for faces in raw["settings"]["faces"]:
        mine = _trial(raw, "pipeline", faces)
        per: dict[str, float | None] = {}
        for other in raw["settings"]["variants"]:
            if other == "pipeline":
                continue
            theirs = _trial(raw, other, faces)
            if mine is None or theirs is None:
                per[other] = None
            elif cpu:
                a, b = cpu_ms_per_frame(mine), cpu_ms_per_frame(theirs)
                per[other] = b / a if a and b else None
            else:
                per[other] = mine["fps"] / theirs["fps"] if theirs["fps"] else None
        found[str(faces)] = per
    return found


def _target(name: str, value: float | None, limit: float) -> dict[str, Any]:
    held = None if value is None else value >= limit
    return {"target": name, "value": value, "limit": limit, "at_least": True, "held": held}


def targets(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets on 4-face frames: (a) ≥ 2× (b) in frames/s, and ahead of (c)."""
    four = ratios(raw).get("4", {})
    found = []
    if "client" in four:
        found.append(
            _target("4 faces: pipeline ÷ client-driven chain, frames/s", four["client"], 2.0)
        )
    if "triton" in four:
        found.append(_target("4 faces: pipeline ÷ Triton BLS, frames/s", four["triton"], 1.0))
    return found


def tracker_figures(trial: dict[str, Any]) -> dict[str, Any]:
    """Per frame answered in the window: sub-step runs and reuses (the pipeline's status), and
    the second-stage models' requests."""
    counts = trial.get("counts") or {}
    steps = counts.get("pipeline", {}).get("steps", {})
    frames = trial["frames"] or None
    runs = sum(steps.get(s, {}).get("runs", 0) for s in SUB_STEPS)
    reused = sum(steps.get(s, {}).get("reused", 0) for s in SUB_STEPS)
    models = counts.get("models", {})
    requests = sum(
        models.get(m, {}).get("requests", 0) for m in ("face_embedding", "face_attributes")
    )
    per = (lambda n: n / frames) if frames else (lambda n: None)
    return {
        "sub_runs": runs,
        "sub_reused": reused,
        "second_stage_requests": requests,
        "sub_runs_per_frame": per(runs),
        "sub_reused_per_frame": per(reused),
        "second_stage_requests_per_frame": per(requests),
        "reused_in_answers": trial.get("reused_sub_results"),
    }


def _cores(t: dict[str, Any]) -> str:
    """Server / producers / the rest of the machine (cores busy that were neither)."""
    server, producers = t["server"]["cpu_cores"], t["producers"]["cpu_cores"]
    return f"{server:.2f} / {producers:.2f} / {others(t):.2f}"


def tracker_summary(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``reinfer_every`` 10 against 1 (each its least disturbed trial): frames/s ratio, and the
    second-stage requests per frame each sent and the share saved."""
    every = raw["settings"]["reinfer_every"]
    if "tracker" not in raw or len(every) < 2:
        return None
    base, reuse = _every(raw, min(every)), _every(raw, max(every))
    if base is None or reuse is None:
        return None
    a, b = tracker_figures(base), tracker_figures(reuse)
    before, after = a["second_stage_requests_per_frame"], b["second_stage_requests_per_frame"]
    return {
        "reinfer_every": [min(every), max(every)],
        "fps": [base["fps"], reuse["fps"]],
        "fps_ratio": reuse["fps"] / base["fps"] if base["fps"] else None,
        "latency_ms_p99": [base["latency_ms_p99"], reuse["latency_ms_p99"]],
        "second_stage_requests_per_frame": [before, after],
        "saved": 1 - after / before if before and after is not None else None,
        "reused_per_frame": b["sub_reused_per_frame"],
    }


def _batches(t: dict[str, Any]) -> str:
    models = (t.get("counts") or {}).get("models", {})
    means = [models.get(m, {}).get("mean_batch") for m in ("face_embedding", "face_attributes")]
    return " / ".join(_fmt(v, ".2f") for v in means) if any(means) else "—"


def markdown(raw: dict[str, Any], found: list[dict[str, Any]]) -> str:
    """The section ``## Pipelines`` of report.md."""
    s = raw["settings"]
    lines = [
        "## Pipelines (issue 35)",
        "",
        f"The chain face → per face `face_embedding` + `face_attributes` on "
        f"{raw['frames']['1']['shape'][1]}×{raw['frames']['1']['shape'][0]} frames with 1 face "
        f"(astronaut.png) and 4 faces (a 2×2 mosaic of it), `{Path(raw['config']).name}`; "
        f"{s['producers']} producer processes closed loop, {s['warmup_s']:g} s warm-up, "
        f"{s['window_s']:g} s measured per trial; a fresh supervisor per Duomo trial, one "
        "Triton for the part. Frames/s: frames answered in the window with every face's two "
        "sub-results. Latency: send → the frame's last answer. (b) sends, for every face the "
        'detector found, `{"image": frame, "landmarks": face\'s 5 points}` to each '
        "second-stage model (their slots hold the frame and one face's landmarks; the "
        "supervisor aligns the chip); (c) is a Python-backend BLS model over Python-backend "
        "models running the same executors (one ONNX Runtime thread each), the second stage on "
        "Triton's dynamic batcher with the same max batch and window. Mean batch: the "
        "second-stage models' batches over the window (Duomo's status). Cores: server / "
        "producers / others (the rest of the machine's busy cores: it is shared).",
        "",
        "| variant | faces | round | frames/s | p50 / p99 ms | CPU ms / frame | wrong | errors "
        "| mean batch emb / attr | cores |",
        "|---|--:|--:|--:|---|--:|--:|--:|---|---|",
    ]
    chosen = {id(_trial(raw, v, f)) for v in s["variants"] for f in s["faces"]}
    trials = sorted(
        raw["chain"]["trials"],
        key=lambda t: (t["faces"], list(VARIANT_NAMES).index(t["variant"]), t.get("round") or 0),
    )
    for t in trials:
        name = VARIANT_NAMES.get(t["variant"], t["variant"])
        if "error" in t:
            lines.append(f"| {name} | {t['faces']} | — | {str(t['error'])[:120]} |" + " |" * 6)
            continue
        lat = f"{_fmt(t['latency_ms_p50'], '.0f')} / {_fmt(t['latency_ms_p99'], '.0f')}"
        fps = f"**{t['fps']:.2f}**" if id(t) in chosen else f"{t['fps']:.2f}"
        lines.append(
            f"| {name} | {t['faces']} | {(t.get('round') or 0) + 1} | {fps} | {lat} "
            f"| {_fmt(cpu_ms_per_frame(t), '.0f')} | {t['wrong']} | {sum(t['errors'].values())} "
            f"| {_batches(t)} | {_cores(t)} |"
        )
    lines += [
        "",
        "Pipeline ÷ each other variant, frames/s, same run (of each variant's trials, the one "
        "with the fewest cores of others' work beside it, in bold above; a variant whose every "
        "trial ran beside others' work is tried again, twice at most). CPU ms / frame: the "
        "server's and producers' cores × 1000 ÷ frames/s, what a frame costs, which others' "
        "work changes much less than it changes frames/s:",
        "",
    ]
    cpu = ratios(raw, cpu=True)
    for faces, per in ratios(raw).items():
        parts = [f"{other} {_fmt(v, '.2f')}×" for other, v in per.items()]
        costs = [f"{other} {_fmt(v, '.2f')}×" for other, v in cpu[faces].items()]
        lines.append(
            f"- {faces} face(s): " + (", ".join(parts) or "—") + "; CPU per frame, each "
            "÷ the pipeline's: " + (", ".join(costs) or "—")
        )
    if "tracker" in raw:
        lines += [
            "",
            f"Tracker: {s['producers']} streams (`client.stream`, fifo, one frame in flight "
            f"each) of a {s['clip_frames']}-frame clip of the 4-face mosaic shifted a pixel a "
            "frame (the faces persist), into `faces` with the tracker on; the sub-steps' "
            "`reinfer_every` 1, then 10. Per frame answered: sub-step runs and reuses over "
            "the window (`duomo_pipeline_step_runs_total`, `_reused_total`), and the "
            "second-stage models' requests.",
            "",
            "| reinfer_every | round | frames/s | p50 / p99 ms | sub-step runs / frame "
            "| reused / frame | 2nd-stage requests / frame | cores |",
            "|--:|--:|--:|---|--:|--:|--:|---|",
        ]
        picked = {id(_every(raw, e)) for e in s["reinfer_every"]}
        for t in sorted(raw["tracker"]["trials"], key=lambda t: t["reinfer_every"]):
            if "error" in t:
                lines.append(f"| {t['reinfer_every']} | {str(t['error'])[:120]} |" + " |" * 6)
                continue
            f = tracker_figures(t)
            lat = f"{_fmt(t['latency_ms_p50'], '.0f')} / {_fmt(t['latency_ms_p99'], '.0f')}"
            fps = f"**{t['fps']:.2f}**" if id(t) in picked else f"{t['fps']:.2f}"
            lines.append(
                f"| {t['reinfer_every']} | {(t.get('round') or 0) + 1} | {fps} | {lat} "
                f"| {_fmt(f['sub_runs_per_frame'], '.2f')} "
                f"| {_fmt(f['sub_reused_per_frame'], '.2f')} "
                f"| {_fmt(f['second_stage_requests_per_frame'], '.2f')} | {_cores(t)} |"
            )
        summary = tracker_summary(raw)
        if summary is not None:
            lo, hi = summary["reinfer_every"]
            req = summary["second_stage_requests_per_frame"]
            lines += [
                "",
                f"`reinfer_every: {hi}` against `{lo}` (bold trials): "
                f"{_fmt(summary['fps_ratio'], '.2f')}× the frames/s, p99 "
                f"{_fmt(summary['latency_ms_p99'][0], '.0f')} → "
                f"{_fmt(summary['latency_ms_p99'][1], '.0f')} ms, second-stage requests per "
                f"frame {_fmt(req[0], '.2f')} → {_fmt(req[1], '.2f')} "
                f"({_fmt(None if summary['saved'] is None else 100 * summary['saved'], '.0f')}% "
                "saved).",
            ]
    if found:
        lines += targets_table(found, ".2f")
    return "\n".join(lines) + "\n"


def add_to_report(raw: dict[str, Any], out: Path) -> str:
    """Add the pipeline part to ``out``'s report (made if absent); its Markdown section."""
    found = targets(raw)
    section = markdown(raw, found)
    part = {
        "targets": found,
        "ratios": ratios(raw),
        "cpu_ratios": ratios(raw, cpu=True),
        "tracker": tracker_summary(raw),
        "raw": raw,
    }
    add_part(out, "pipelines", part, section)
    return section
