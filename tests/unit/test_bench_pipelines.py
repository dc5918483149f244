"""The pipeline benchmark's pure parts (``tools.bench.pipelines``, ``pipeline_producer``,
``pipeline_report``): the frames, the derived configs, what counts as an answer, the counts over
a window, the ratios and the targets, on figures made up for the purpose (no process, no
timing)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tools.bench.pipeline_producer import check_answer, moving_frame
from tools.bench.pipeline_report import (
    markdown,
    ratios,
    targets,
    tracker_figures,
    tracker_summary,
)
from tools.bench.pipelines import (
    CONFIG,
    count_delta,
    derived_config,
    make_frames,
    mean_batch,
    step_counts_from_metrics,
    triton_faces_repository,
)


def test_frames_are_one_face_and_a_mosaic_of_four() -> None:
    face = np.arange(100 * 100 * 3, dtype=np.uint8).reshape(100, 100, 3)
    frames = make_frames(face, side=64)
    assert frames[1].shape == frames[4].shape == (64, 64, 3)
    mosaic = frames[4]
    assert np.array_equal(mosaic[:32, :32], mosaic[32:, 32:])  # the same tile twice
    assert np.array_equal(mosaic[:32, 32:], mosaic[:32, :32][:, ::-1])  # and mirrored twice


def test_a_moving_frame_shifts_by_a_pixel_and_stays_in_bounds() -> None:
    base = np.zeros((40, 50, 3), np.uint8)
    base[20, 25] = 255
    spots = []
    for i in range(200):
        frame = moving_frame(base, i, amplitude=5)
        assert frame.shape == base.shape and frame.flags["C_CONTIGUOUS"]
        ys, xs = np.nonzero(frame[:, :, 0])
        spots.append((int(ys[0]), int(xs[0])))
    steps = [abs(a[1] - b[1]) + abs(a[0] - b[0]) for a, b in itertools.pairwise(spots)]
    assert max(steps) <= 2  # a pixel or two a frame: a tracker keeps the object
    assert {x for _, x in spots} == set(range(20, 31))  # ±5 px across
    assert {y for y, _ in spots} == set(range(15, 26))  # ±5 px down


def test_an_answer_counts_with_every_face_and_both_sub_results() -> None:
    face = {"box": [0, 0, 1, 1], "embedding": {"embedding": [1.0]}, "attributes": {"age": 3}}
    assert check_answer({"faces": [face, face]}, 2)
    assert not check_answer({"faces": [face]}, 2)
    assert not check_answer({"faces": [{**face, "attributes": {"error": {"code": "X"}}}]}, 1)
    assert not check_answer({"faces": [{"box": [0, 0, 1, 1]}]}, 1)
    assert not check_answer(None, 0) and check_answer({"faces": []}, 0)


def test_derived_configs(tmp_path: Path) -> None:
    plain = yaml.safe_load(derived_config(CONFIG, tmp_path / "a.yaml", pipelines=False).read_text())
    assert "pipelines" not in plain and Path(plain["model_root"]).is_absolute()
    every = derived_config(CONFIG, tmp_path / "b.yaml", reinfer_every=10)
    steps = yaml.safe_load(every.read_text())["pipelines"][0]["steps"]
    assert [s.get("reinfer_every") for s in steps] == [None, 10, 10]


def test_counts_over_a_window() -> None:
    before = {"models": {"e": {"requests": 5, "batch_sizes": {"1": 5}}}}
    after = {"models": {"e": {"requests": 17, "batch_sizes": {"1": 6, "4": 2, "3": 1}}}}
    delta = count_delta(before, after)
    assert delta == {"models": {"e": {"requests": 12, "batch_sizes": {"1": 1, "4": 2, "3": 1}}}}
    assert mean_batch(delta["models"]["e"]["batch_sizes"]) == 3.0
    assert mean_batch({}) is None


def test_the_triton_repository(tmp_path: Path) -> None:
    config = derived_config(CONFIG, tmp_path / "c.yaml", pipelines=False)
    triton_faces_repository(tmp_path / "repo", config, bls_instances=3)
    names = sorted(p.name for p in (tmp_path / "repo").iterdir())
    assert names == ["face", "face_attributes", "face_embedding", "faces"]
    chip = (tmp_path / "repo" / "face_embedding" / "config.pbtxt").read_text()
    assert "max_batch_size: 8" in chip and "max_queue_delay_microseconds: 2000" in chip
    assert "count: 3" in (tmp_path / "repo" / "faces" / "config.pbtxt").read_text()
    assert (tmp_path / "repo" / "faces" / "1" / "model.py").is_file()


def _trial(variant: str, faces: int, fps: float, **more: Any) -> dict[str, Any]:
    resources = {"cpu_cores": 0.5, "machine_busy_cores": 1.5}  # others: 0.5 cores
    return {"variant": variant, "faces": faces, "fps": fps, "frames": int(fps * 10), "wrong": 0,
            "errors": {}, "latency_ms_p50": 100.0, "latency_ms_p99": 200.0,
            "server": resources, "producers": resources, **more}  # fmt: skip


def test_ratios_targets_and_the_section() -> None:
    def counts(runs: int, reused: int) -> dict[str, Any]:
        return {
            "models": {"face_embedding": {"requests": runs}, "face_attributes": {"requests": runs}},
            "pipeline": {"steps": {"embedding": {"runs": runs, "reused": reused},
                                   "attributes": {"runs": runs, "reused": reused}}},
        }  # fmt: skip

    quiet = {"cpu_cores": 0.5, "machine_busy_cores": 1.0}  # no other work
    raw: dict[str, Any] = {
        "settings": {"faces": [1, 4], "variants": ["pipeline", "client", "triton"],
                     "producers": 4, "warmup_s": 3, "window_s": 10, "clip_frames": 300,
                     "reinfer_every": [1, 10]},
        "config": "configs/pipelines-bench.yaml",
        "frames": {"1": {"shape": [640, 640, 3]}, "4": {"shape": [640, 640, 3]}},
        "chain": {"trials": [_trial("pipeline", 1, 20.0), _trial("client", 1, 10.0),
                             _trial("pipeline", 4, 12.0), _trial("client", 4, 4.0),
                             _trial("client", 4, 6.0, round=1, server=quiet),
                             {"variant": "triton", "faces": 4, "error": "no Triton"}]},
        "tracker": {"trials": [
            _trial("stream", 4, 5.0, reinfer_every=1, counts=counts(200, 0)),
            _trial("stream", 4, 10.0, reinfer_every=10, counts=counts(60, 340)),
        ]},
    }  # fmt: skip
    # of the two rounds of client at 4 faces, the one with no other work on the machine
    assert ratios(raw) == {
        "1": {"client": 2.0, "triton": None},
        "4": {"client": 2.0, "triton": None},
    }
    found = {t["target"]: t["held"] for t in targets(raw)}
    assert list(found.values()) == [True, None]
    per_frame = tracker_figures(raw["tracker"]["trials"][1])
    assert per_frame["sub_runs_per_frame"] == 1.2 and per_frame["sub_reused_per_frame"] == 6.8
    summary = tracker_summary(raw)
    assert summary is not None and summary["fps_ratio"] == 2.0
    assert summary["second_stage_requests_per_frame"] == [8.0, 1.2] and summary["saved"] == 0.85
    section = markdown(raw, targets(raw))
    assert (
        "## Pipelines" in section and "no Triton" in section and "| 10 | 1 | **10.00** |" in section
    )
    assert "(85% saved)" in section


def test_step_counts_from_a_metrics_page() -> None:
    page = (
        "# TYPE duomo_pipeline_step_runs counter\n"
        'duomo_pipeline_step_runs_total{pipeline="faces",step="embedding",model="e"} 12\n'
        'duomo_pipeline_step_runs_total{pipeline="other",step="embedding",model="e"} 99\n'
        "# TYPE duomo_pipeline_step_reused counter\n"
        'duomo_pipeline_step_reused_total{pipeline="faces",step="embedding"} 30\n'
    )
    steps = step_counts_from_metrics(page)
    assert steps == {"embedding": {"runs": 12, "skipped": 0, "reused": 30, "errors": 0}}
    assert step_counts_from_metrics("") == {}
