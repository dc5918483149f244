"""The camera benchmark's part of the report: its targets, its Markdown section, and its place
in the run's ``report.json`` and ``report.md``.

``add_to_report(raw, out)`` adds ``cameras`` (the targets and every raw trial of
``tools.bench.cameras``) to ``out/report.json`` and appends the section to ``out/report.md``
— or writes both, with the machine, when the mixed load did not run (``--cameras-only``) — through
``tools.bench.report.add_part``. Called by ``tools.bench.cameras.bench_cameras``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench.report import add_part, targets_table

PRODUCER_NAMES = {
    "source": "Duomo's video source (`duomo.video`, latest)",
    "naive": "hand-written loop (cv2 + `client.infer`, FIFO)",
    "triton": "Triton 2.51, same loop (`tritonclient.http`)",
}


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def _target(name: str, value: float | None, limit: float, at_least: bool) -> dict[str, Any]:
    held = None if value is None else (value >= limit if at_least else value <= limit)
    return {"target": name, "value": value, "limit": limit, "at_least": at_least, "held": held}


def targets(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets: ``latest`` within its age bound at the overload, even shares between
    equal cameras, and N for the video source against the loop's and Triton's."""
    fresh = raw["freshness"]
    overloaded = next(
        (
            t
            for t in fresh["trials"]
            if "error" not in t and t["policy"] == "latest" and t["fps"] == fresh["overload_fps"]
        ),
        None,
    )
    found: list[dict[str, Any]] = []
    if overloaded is not None:
        answered = overloaded["answered_fps"]  # (the model never idles under overload)
        factor = overloaded["fps"] / answered if answered else 0.0
        found.append(
            _target(
                f"latest at {factor:.1f}× overload: age p99 ÷ bound",
                overloaded["age_ms_p99"] / overloaded["bound_ms"]
                if overloaded["age_ms_p99"] is not None
                else None,
                1.0,
                at_least=False,
            )
        )
    scaling = raw["scaling"]
    source = scaling.get("source")
    if source is not None:
        several = [t["evenness"] for t in source["trials"] if t["cameras"] >= 2]
        found.append(
            _target(
                "video source: least ÷ most kept share, equal cameras (every N ≥ 2)",
                min(several) if several else None,
                0.9,
                at_least=True,
            )
        )
        for other in ("naive", "triton"):
            theirs = scaling.get(other)
            if theirs is None:
                continue
            mine, their_n = source["largest_n"], theirs["largest_n"]
            found.append(
                _target(
                    f"largest N: video source − {other}",
                    None if mine is None or their_n is None else float(mine - their_n),
                    0.0,
                    at_least=True,
                )
            )
    return found


def _busy(server: dict[str, Any], producers: dict[str, Any]) -> str:
    """The machine's cores busy, and (in brackets) those neither the servers' nor the
    producers'."""
    busy = server.get("machine_busy_cores") or 0.0
    return f"{busy:.2f} ({busy - server['cpu_cores'] - producers['cpu_cores']:.2f})"


def markdown(raw: dict[str, Any], found: list[dict[str, Any]]) -> str:
    """The section ``## Cameras`` of report.md."""
    settings, fresh = raw["settings"], raw["freshness"]
    calibration = raw["calibration"]
    cpus = raw["cpus"]
    lines = [
        "## Cameras (issue 34)",
        "",
        f"1280×720 H.264 clips made by `tools.bench.camera_clip` (moving content, one face). "
        f"One camera: {settings['freshness_s']:g} s measured after {settings['warmup_s']:g} s, "
        f"a fresh supervisor per trial; face answered {fresh['capacity_fps']:.1f} frames/s "
        f"under fifo (its capacity here), so the second rate is {fresh['overload_fps']} fps. "
        "Bound: 2 service times (1 ÷ answered rate) + 1 frame period.",
        "",
        "| camera fps | policy | sent /s | answered /s | age p50 / p99 / max ms | bound ms "
        "| superseded | refused | server cores | machine busy (others) |",
        "|--:|---|--:|--:|---|--:|--:|--:|--:|--:|",
    ]
    for t in fresh["trials"]:
        if "error" in t:
            lines.append(f"| {t['fps']} | {t['policy']} | {t['error']} |" + " |" * 7)
            continue
        ages = " / ".join(_fmt(t[k], ".0f") for k in ("age_ms_p50", "age_ms_p99", "age_ms_max"))
        lines.append(
            f"| {t['fps']} | {t['policy']} | {t['sent_fps']:.1f} | {t['answered_fps']:.1f} "
            f"| {ages} | {t['bound_ms']:.0f} | {t['superseded']} | {t['refused']} "
            f"| {t['server']['cpu_cores']:.2f} | {_busy(t['server'], t['producer'])} |"
        )
    lines += [
        "",
        f"N cameras × {settings['many_fps']} fps, all playing one clip, into face + classify; "
        f"{settings['window_s']:g} s measured per trial after {settings['warmup_s']:g} s; N "
        f"rises until a trial fails (a camera keeps < {settings['kept_at_least']:g} of its "
        "frames answered by a model). Decode: frames decoded × one frame's CPU alone "
        f"({calibration['source']['cpu_ms_per_frame']:.2f} ms with PyAV as the video source "
        f"decodes, {calibration['opencv']['cpu_ms_per_frame']:.2f} ms with cv2), in cores of "
        f"the machine's {cpus} and as a share of the cores busy. *Others*: the cores busy "
        "that were neither the servers nor the producers (the machine is shared).",
        "",
        "| producer | N | kept face, least–most | kept classify, least–most | least ÷ most "
        "| passed | age p50 / worst p99 ms | decode cores (of busy) | producer cores "
        "| server cores | machine busy (others) |",
        "|---|--:|---|---|--:|---|---|---|--:|--:|--:|",
    ]
    summary = []
    for kind, part in raw["scaling"].items():
        name = PRODUCER_NAMES.get(kind, kind)
        if part.get("error"):
            lines.append(f"| {name} | — | {part['error']} |" + " |" * 8)
        for t in part["trials"]:
            busy = t["server"].get("machine_busy_cores") or 0.0
            share = f" ({t['decode_cores'] / busy:.0%})" if busy else ""
            kept = [
                f"{t['least'].get(m, 0.0):.2f}–{t['most'].get(m, 0.0):.2f}"
                for m in ("face", "classify")
            ]
            ages = f"{_fmt(t['age_ms_p50_median'], '.0f')} / {_fmt(t['age_ms_p99_worst'], '.0f')}"
            lines.append(
                f"| {name} | {t['cameras']} | {kept[0]} | {kept[1]} | {t['evenness']:.2f} "
                f"| {'yes' if t['passed'] else '**no**'} | {ages} "
                f"| {t['decode_cores']:.3f}{share} | {t['producers']['cpu_cores']:.2f} "
                f"| {t['server']['cpu_cores']:.2f} | {_busy(t['server'], t['producers'])} |"
            )
        summary.append(f"{kind} {_fmt(part['largest_n'], 'd')}")
    lines += ["", "Largest N: " + ", ".join(summary) + "."]
    lines += targets_table(found, ".3f")
    return "\n".join(lines) + "\n"


def add_to_report(raw: dict[str, Any], out: Path) -> str:
    """Add the camera part to ``out``'s report (made if absent); its Markdown section."""
    found = targets(raw)
    section = markdown(raw, found)
    add_part(out, "cameras", {"targets": found, "raw": raw}, section)
    return section
