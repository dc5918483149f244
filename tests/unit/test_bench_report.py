"""The benchmark's arithmetic: what counts as a correct answer, the window, the work metric and
the targets, on figures made up for the purpose (no process, no timing)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tools.bench.answers import is_correct, summary
from tools.bench.report import _mode_figures, markdown, targets
from tools.bench.sampler import machine_cores, machine_cpu
from tools.bench.tally import Tally, merge
from tools.bench.workload import load_workload

ROOT = Path(__file__).resolve().parents[2]


def test_answers_compare_the_summary_only() -> None:
    top = {"top": [{"index": 967, "label": "espresso", "score": 0.9}]}
    assert summary(top) == 967
    assert is_correct({"top": [{"index": 967, "label": "x", "score": 0.1}]}, 967)
    assert not is_correct({"top": [{"index": 1, "label": "x", "score": 0.9}]}, 967)
    assert is_correct({"faces": [{}, {}]}, 2) and not is_correct({"faces": [{}]}, 2)
    lines = {"lines": [{"text": "a"}, {"text": "b"}]}
    assert is_correct(lines, ["a", "b"]) and not is_correct(lines, ["b", "a"])
    assert not is_correct({"unexpected": 1}, 1)  # garbage is wrong, never an exception


def test_tally_counts_only_answers_inside_the_window() -> None:
    tally = Tally()
    tally.add(9.0, 9.5, 10.0, 20.0, {"faces": []}, 0)  # warm-up
    tally.add(10.0, 10.5, 10.0, 20.0, {"faces": []}, 0)
    tally.add(11.0, 11.5, 10.0, 20.0, {"faces": [{}]}, 0)  # wrong
    tally.add(12.0, 12.5, 10.0, 20.0, error="UNAVAILABLE")
    tally.add(19.9, 20.5, 10.0, 20.0, {"faces": []}, 0)  # after the window
    assert (tally.ok, tally.wrong, dict(tally.errors)) == (1, 1, {"UNAVAILABLE": 1})
    assert tally.latencies_ms == [500.0, 500.0, 500.0]
    both = merge([tally.as_dict(), tally.as_dict()])
    assert (both["ok"], both["wrong"], both["errors"], len(both["latencies_ms"])) == (
        2, 2, {"UNAVAILABLE": 2}, 6,
    )  # fmt: skip


def _round(
    rps: dict[str, float],
    rss: float,
    overhead: dict[str, float] | None = None,
    floor: dict[str, float] | None = None,
    design_floor: dict[str, float] | None = None,
) -> dict:
    """One round; each probe's accounted overhead is made up as half its overhead."""
    probes = {  # served p50 = the in-process 10 ms + the overhead
        probe: {
            n: {"overhead_ms": ms, "accounted_ms": ms / 2, "wrong": 0,
                "p50_ms": 10.0 + ms, "direct_p50_ms": 10.0}
            for n, ms in (figures or {}).items()
        }
        for probe, figures in (
            ("overhead", overhead), ("floor", floor), ("design_floor", design_floor)
        )
    }  # fmt: skip
    return {
        "duration_s": 10.0,
        "models": {
            n: {"ok": int(r * 10), "wrong": 0, "errors": {}, "latencies_ms": [1.0, 2.0, 3.0]}
            for n, r in rps.items()
        },
        "resources": {"rss_peak_mib": rss, "pss_end_mib": rss, "processes": 1, "cpu_cores": 2.0},
        "client_cpu_cores": 0.1,
        **probes,
    }


def test_work_weights_each_model_by_its_rate_alone_and_targets_are_ratios() -> None:
    alone = {"a": {"rps": 100.0, "p50_ms": 10.0}, "b": {"rps": 10.0, "p50_ms": 100.0}}
    modes = {
        "engine": _mode_figures([_round({"a": 50, "b": 5}, 1000)], alone),
        "duomo": _mode_figures(
            [
                _round({"a": 60, "b": 4}, 500, {"a": 0.2}, {"a": 0.1}, {"a": 0.15}),
                _round({"a": 60, "b": 4}, 500, {"a": 0.4}, {"a": 0.3}, {"a": 0.35}),
                _round({"a": 60, "b": 4}, 500, {"a": 0.3}, {"a": 0.5}, {"a": 0.4}),
            ],
            alone,
        ),
        "per-model": _mode_figures([_round({"a": 40, "b": 3}, 1000)], alone),
        "triton": _mode_figures([_round({"a": 40, "b": 4}, 800, {"a": 1.0})], alone),
        "mosec": _mode_figures([_round({"a": 30, "b": 4}, 700, {"a": 0.8})], alone),
    }
    assert modes["engine"]["work"] == pytest.approx(0.5 + 0.5)
    assert modes["duomo"]["work"] == pytest.approx(0.6 + 0.4)
    # the probes' medians over rounds, Duomo's and its floors'
    assert modes["duomo"]["models"]["a"]["overhead_ms"] == pytest.approx(0.3)
    assert modes["duomo"]["models"]["a"]["floor_ms"] == pytest.approx(0.3)
    assert modes["duomo"]["models"]["a"]["design_floor_ms"] == pytest.approx(0.35)
    assert modes["duomo"]["models"]["a"]["accounted_ms"] == pytest.approx(0.15)
    assert modes["duomo"]["models"]["a"]["floor_accounted_ms"] == pytest.approx(0.15)
    assert modes["duomo"]["models"]["a"]["design_floor_accounted_ms"] == pytest.approx(0.175)
    assert modes["triton"]["models"]["a"]["floor_ms"] is None
    assert modes["triton"]["models"]["a"]["design_floor_ms"] is None
    got = {t["target"]: (round(t["value"], 3), t["held"]) for t in targets(modes)}
    assert got["duomo work ÷ engine work"] == (1.0, True)
    assert got["duomo work ÷ per-model work"] == (1.429, True)
    assert got["duomo memory ÷ per-model memory"] == (0.5, True)
    # the better peer is the one with more work: triton (0.8) over mosec (0.7); issue 45's bar
    # is 1.6 ×
    assert got["duomo work ÷ triton work (the better peer)"] == (1.25, False)
    # alone, one client: the in-process p50 ÷ the served one, the median of the rounds
    assert got["a alone: answers/s ÷ in-process (one client)"] == (round(10 / 10.3, 3), True)
    floors_alone = {t["target"]: t["floor"] for t in targets(modes)}
    assert floors_alone["a alone: answers/s ÷ in-process (one client)"] == pytest.approx(10 / 10.3)
    assert "b alone: answers/s ÷ in-process (one client)" not in got  # b was not probed
    assert got["duomo memory ÷ triton memory"] == (0.625, True)
    assert got["a overhead ÷ triton overhead"] == (0.3, False)
    assert got["a accounted overhead ÷ triton accounted overhead"] == (0.3, False)  # 0.15 / 0.5
    floors = {t["target"]: (t["floor"], t["design_floor"]) for t in targets(modes)}
    assert floors["a overhead ÷ triton overhead"] == pytest.approx((0.3, 0.35))
    assert floors["a accounted overhead ÷ triton accounted overhead"] == pytest.approx((0.3, 0.35))
    assert floors["duomo work ÷ engine work"] == (None, None)
    # what the engine itself reached against the same mode: the most Duomo's design could
    engines = {t["target"]: t["engine"] for t in targets(modes)}
    assert engines["duomo work ÷ triton work (the better peer)"] == pytest.approx(1.0 / 0.8)
    assert engines["duomo work ÷ per-model work"] == pytest.approx(1.0 / 0.7)
    assert engines["duomo work ÷ engine work"] is None
    assert engines["a overhead ÷ triton overhead"] is None
    # an overhead below zero (served faster than in-process) is noise: no verdict
    modes["duomo"] = _mode_figures([_round({"a": 60, "b": 4}, 500, {"a": -0.2})], alone)
    noisy = {t["target"]: (round(t["value"], 3), t["held"]) for t in targets(modes)}
    assert noisy["a overhead ÷ triton overhead"] == (-0.2, None)
    assert noisy["a accounted overhead ÷ triton accounted overhead"] == (-0.2, None)


def test_machine_cores_are_busy_and_stolen_shares_of_all_cpus_time() -> None:
    cpus = psutil.cpu_count()
    # 10 s of every CPU's time in all: 6 busy, 1 stolen, 3 idle
    got = machine_cores((100.0, 5.0, 1000.0), (106.0, 6.0, 1010.0))
    assert got == pytest.approx(
        {"machine_busy_cores": 0.6 * cpus, "machine_steal_cores": 0.1 * cpus}
    )
    assert machine_cores((1.0, 0.0, 5.0), (1.0, 0.0, 5.0))["machine_busy_cores"] == 0.0
    busy, steal, total = machine_cpu()  # the real counters: consistent, and moving forward
    assert 0 <= busy <= total and 0 <= steal <= total
    assert machine_cpu()[2] >= total


def test_machine_cores_are_averaged_over_rounds_and_absent_from_older_rounds() -> None:
    alone = {"a": {"rps": 100.0, "p50_ms": 10.0}}
    rounds = [_round({"a": 50}, 500), _round({"a": 50}, 500)]
    for r, busy in zip(rounds, (1.9, 2.0)):
        r["resources"].update(machine_busy_cores=busy, machine_steal_cores=0.1)
    figures = _mode_figures(rounds, alone)
    assert figures["machine_busy_cores"] == pytest.approx(1.95)
    assert figures["machine_steal_cores"] == pytest.approx(0.1)
    lines = markdown(_report({"duomo": figures}, []))
    assert "| 2.00 + 0.10 | 1.95 (0.10) |" in lines
    older = _mode_figures([_round({"a": 50}, 500), rounds[0]], alone)  # one round lacks them
    assert older["machine_busy_cores"] is None
    assert "| 2.00 + 0.10 | — (—) |" in markdown(_report({"duomo": older}, []))


def _report(modes: dict, overhead_models: list[str]) -> dict:
    workload = {
        "models": [{"name": "a", "producers": 1}], "loop": "closed", "rounds": 1,
        "duration_s": 10.0, "warmup_s": 1.0, "overhead_s": 5.0, "overhead_models": overhead_models,
    }  # fmt: skip
    return {
        "date": "today", "workload_file": "w.yaml", "workload": workload, "modes": modes,
        "alone": {"a": {"rps": 100.0, "p50_ms": 10.0}}, "targets": targets(modes),
        "machine": {"cpus": 2, "processor": "x86_64", "python": "3", "onnxruntime": "1"},
    }  # fmt: skip


def test_overhead_table_has_the_floors_under_duomo_and_none_when_nothing_is_probed() -> None:
    alone = {"a": {"rps": 100.0, "p50_ms": 10.0}}
    modes = {  # the workload's order, which need not start with duomo
        "triton": _mode_figures([_round({"a": 40}, 800, {"a": 1.0})], alone),
        "duomo": _mode_figures(
            [_round({"a": 60}, 500, {"a": 0.2}, {"a": 0.1}, {"a": 0.15})], alone
        ),
    }
    lines = markdown(_report(modes, ["a"])).splitlines()
    assert "| mode | a | a, accounted |" in lines
    rows = [line for line in lines if line.startswith(("| triton | 1.00", "| duomo | 0.20"))]
    assert rows == ["| triton | 1.00 | 0.50 |", "| duomo | 0.20 | 0.10 |"]
    below = lines.index("| duomo | 0.20 | 0.10 |")
    assert lines[below + 1 : below + 3] == [
        "| floor | 0.10 | 0.05 |",
        "| design floor | 0.15 | 0.07 |",
    ]
    assert "| a overhead ÷ triton overhead | 0.200 | ≤ 0.25 | yes | 0.100 | 0.150 | — |" in lines
    assert (
        "| a accounted overhead ÷ triton accounted overhead | 0.200 | ≤ 0.25 | yes | 0.100 "
        "| 0.150 | — |"
    ) in lines
    unprobed = markdown(_report(modes, []))
    assert "Per-request overhead" not in unprobed and "| floor |" not in unprobed


def test_workload_files_validate_and_resolve_paths(tmp_path: Path) -> None:
    for shipped in (ROOT / "configs" / "bench").glob("*.yaml"):
        workload = load_workload(shipped)
        assert workload.config.is_file()
        assert all(p.is_file() for m in workload.models for p in m.images)
    bad = tmp_path / "open.yaml"
    bad.write_text(
        "config: x.yaml\nmodels: [{name: a, images: [a.png]}]\nloop: open\noverhead_models: []\n"
    )
    with pytest.raises(ValueError, match="loop: open needs rate_per_s"):
        load_workload(bad)
    with pytest.raises(ValueError, match="modes"):
        load_workload(ROOT / "configs" / "bench" / "smoke.yaml", modes=["engine", "nope"])


def test_the_gateway_mode_is_held_to_its_own_targets() -> None:
    """duomo-http against the better peer: work ≥ 1.6 × (issue 45's bar), memory ≤ 0.6 ×,
    accounted overhead ≤ 0.5 × (the raw overhead is not a target through the gateway)."""
    alone = {"a": {"rps": 100.0, "p50_ms": 10.0}}
    modes = {
        "duomo": _mode_figures([_round({"a": 110}, 500, overhead={"a": 0.4})], alone),
        "duomo-http": _mode_figures([_round({"a": 108}, 590, overhead={"a": 1.2})], alone),
        "triton": _mode_figures([_round({"a": 100}, 1000, overhead={"a": 2.0})], alone),
    }
    shown = {t["target"]: (round(t["value"], 3), t["held"]) for t in targets(modes)}
    assert shown["duomo-http work ÷ triton work (the better peer)"] == (1.08, False)
    assert shown["duomo-http memory ÷ triton memory"] == (0.59, True)
    assert shown["a accounted overhead (duomo-http) ÷ triton accounted overhead"] == (0.6, False)
    assert "a overhead (duomo-http) ÷ triton overhead" not in shown


def test_fair_sharing_targets_kept_shares_each_model_and_the_lightest_p99() -> None:
    alone = {"heavy": {"rps": 1.0, "p50_ms": 900.0}, "light": {"rps": 100.0, "p50_ms": 9.0}}
    duomo_round = _round({"heavy": 0.8, "light": 20}, 500)
    duomo_round["models"]["light"]["latencies_ms"] = [10.0] * 99 + [120.0]
    mosec_round = _round({"heavy": 0.6, "light": 60}, 1000)
    mosec_round["models"]["light"]["latencies_ms"] = [10.0] * 99 + [40.0]
    modes = {
        "duomo": _mode_figures([duomo_round], alone),
        "mosec": _mode_figures([mosec_round], alone),
    }
    assert modes["duomo"]["models"]["light"]["kept"] == pytest.approx(0.2)
    assert modes["duomo"]["kept_evenness"] == pytest.approx(0.25)  # 0.2 ÷ 0.8
    shown = {t["target"]: (round(t["value"], 3), t["held"]) for t in targets(modes)}
    assert shown["duomo kept shares, least ÷ most"] == (0.25, False)
    assert shown["heavy answers/s ÷ mosec's (the better peer for it)"] == (1.333, True)
    assert shown["light answers/s ÷ mosec's (the better peer for it)"] == (0.333, False)
    assert shown["light p99 ms (the lightest model) vs the better peer's 40"] == (120.0, False)
