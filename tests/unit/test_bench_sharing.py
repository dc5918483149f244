"""The shared-weights benchmark's pure parts (``tools.bench.sharing``, ``sharing_report``) and its
options on ``duomo bench``: the derived config, the order of the trials, what the ledger counts,
the figures, ratios and target on figures made up for the purpose (no process, no timing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import DEMO_CONFIG
from tools.bench.run import bench, parse_args
from tools.bench.sharing import ledger, sharing_config, trial_order
from tools.bench.sharing_report import markdown, summary, targets, trial_figures


def test_the_config_has_every_model_at_n_instances_with_sharing_on_or_off(tmp_path: Path) -> None:
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    for share in (True, False):
        raw = yaml.safe_load(sharing_config(DEMO_CONFIG, tmp_path / "c.yaml", share, 2).read_text())
        assert [m["name"] for m in raw["models"]] == [m["name"] for m in demo["models"]]
        networks = [m for m in raw["models"] if m["task"] != "gallery"]
        assert {(m["instances"], m["share_weights"]) for m in networks} == {(2, share)}
        # a gallery's matrix is data each instance builds, not weights: left as it is
        (people,) = [m for m in raw["models"] if m["task"] == "gallery"]
        assert people["instances"] == 1 and "share_weights" not in people
        assert Path(raw["model_root"]).is_absolute()
        assert (Path(raw["model_root"]) / demo["models"][0]["files"]["det"]).is_file()
        assert raw["pipelines"] == demo["pipelines"]


def test_trials_take_turns_on_off_then_off_on() -> None:
    assert trial_order(1) == [(0, "on"), (0, "off")]
    assert trial_order(3) == [
        (0, "on"), (0, "off"), (1, "off"), (1, "on"), (2, "on"), (2, "off"),
    ]  # fmt: skip


def test_the_ledger_counts_a_shared_copy_once_and_each_own_copy() -> None:
    def copy(file: str, nbytes: int, shared_with: list[str]) -> dict[str, Any]:
        return {
            "file": file,
            "device": 0,
            "bytes": nbytes,
            "on_device": False,
            "shared_with": shared_with,
        }

    status = {
        "rss_bytes": 500,
        "devices": [{"id": 0, "used_bytes": 300}],
        "models": {
            # two models on one copy: listed by both, counted once
            "a": {"memory": {"measured": {"host_bytes": 10}, "weights": [copy("x", 40, ["b"])]}},
            "b": {"memory": {"measured": {"host_bytes": 20}, "weights": [copy("x", 40, ["a"])]}},
            # two copies of one file and of the same size, each its own (sharing off)
            "c": {
                "memory": {
                    "measured": {"host_bytes": 5},
                    "weights": [copy("y", 7, []), copy("y", 7, [])],
                }
            },
            "d": {"memory": {"measured": None, "weights": []}},
        },
    }
    found = ledger(status)
    assert found["device_used_bytes"] == 300 and found["rss_bytes"] == 500
    assert found["own_bytes"] == {"a": 10, "b": 20, "c": 5, "d": None}
    assert found["weights_bytes"] == 54 and len(found["weights"]) == 3
    assert {"file": "x", "bytes": 40, "models": ["a", "b"]} in found["weights"]


def _trial(setting: str, r: int, rss: float, peak: float, classify_ok: int) -> dict[str, Any]:
    def tally(ok: int) -> dict[str, Any]:
        return {"ok": ok, "wrong": 0, "errors": {}, "latencies_ms": [10.0] * ok}

    return {
        "sharing": setting,
        "round": r,
        "start_s": 9.0,
        "after_load": {
            "rss_mib": rss,
            "pss_mib": rss - 50,
            "ledger": {
                "device_used_bytes": 2**29,
                "weights_bytes": 2**27,
                "weights": [{}] * (8 if setting == "on" else 16),
            },
        },
        "resources": {
            "rss_peak_mib": peak,
            "pss_end_mib": peak - 60,
            "cpu_cores": 1.5,
            "machine_busy_cores": 2.0,
        },
        "producers": {"cpu_cores": 0.25},
        "models": {"ocr": tally(10), "classify": tally(classify_ok)},
    }


def test_figures_ratios_target_and_section() -> None:
    alone = {"ocr": {"rps": 1.0}, "classify": {"rps": 50.0}}
    trials = [
        _trial("on", 0, 400.0, 500.0, 500),
        _trial("off", 0, 500.0, 625.0, 500),
        _trial("off", 1, 520.0, 625.0, 400),
        _trial("on", 1, 400.0, 500.0, 400),
    ]  # fmt: skip
    figures = [trial_figures(t, alone, 10.0) for t in trials]
    # work: 10 ocr answers in 10 s ÷ 1/s alone + 500 classify answers ÷ (50/s × 10 s)
    assert figures[0]["work"] == pytest.approx(2.0) and figures[2]["work"] == pytest.approx(1.8)
    assert figures[0]["others_cores"] == pytest.approx(0.25)
    assert figures[0]["ledger_used_mib"] == 512 and figures[1]["weight_copies"] == 16
    s = summary(figures)
    assert s["ratios"]["rss_peak_mib"] == pytest.approx(0.8)
    assert s["ratios"]["after_load_rss_mib"] == pytest.approx(400 / 510)
    assert s["ratios_by_round"]["after_load_rss_mib"] == pytest.approx([0.8, 400 / 520])
    assert s["ratios"]["work"] == pytest.approx(1.0)
    assert s["settings"]["on"]["work_spread"] == pytest.approx(2.0 / 1.8 - 1)
    (target,) = targets(s)
    assert target["held"] is True and target["limit"] == 0.95
    raw = {
        "settings": {"instances": 2, "settle_s": 2, "warmup_s": 5, "window_s": 10},
        "alone": alone,
        "trials": [*trials, {"sharing": "off", "round": 2, "error": "start failed"}],
    }
    section = markdown(raw, figures, s)
    assert "## Shared weights" in section and "start failed" in section
    assert "| 1 | on | 400 / 350 | 512 (8, 128) | 500 | 1.00 | 50.00 | 2.000 | 0, 0 |" in section
    assert "| resident memory, peak under load, MiB | 500 | 625 | 0.800 | 0.800 / 0.800 |" in (
        section
    )


def test_the_sharing_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--sharing", "--sharing-only"])
    args = parse_args(["--sharing-only"])
    assert args.sharing_only and args.sharing_window == 20.0 and args.sharing_rounds == 2
    assert bench(parse_args(["--sharing-only", "--sharing-rounds", "0"])) == 2
    assert "--sharing-rounds ≥ 1" in capsys.readouterr().err
