"""``duomo infer`` as a user runs it: a real process, the demo config, the fixture images."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import DEMO_CONFIG, IMAGES, ROOT


def duomo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_infer_json_on_the_four_fixture_images(demo_config: object) -> None:
    expectations = {
        "classify": ["coffee.png", "chelsea.png"],
        "face": ["astronaut.png"],
        "ocr": ["page.png"],
    }
    for model, names in expectations.items():
        paths = [str(IMAGES / n) for n in names]
        run = duomo("infer", "-c", str(DEMO_CONFIG), model, *paths, "--json")
        assert run.returncode == 0, run.stderr
        rows = [json.loads(line) for line in run.stdout.splitlines()]
        assert [r["image"] for r in rows] == paths
        assert all(r["model"] == model for r in rows)
        if model == "classify":
            assert rows[0]["result"]["top"][0]["label"] == "espresso"
            assert {t["index"] for t in rows[1]["result"]["top"][:3]} & {281, 282, 283, 284, 285}
        elif model == "face":
            assert len(rows[0]["result"]["faces"]) == 1
        else:
            assert rows[0]["result"]["lines"][0]["text"] == "Region-based segmentation"


def test_a_file_that_is_not_an_image_is_a_clear_error(tmp_path: Path, demo_config: object) -> None:
    junk = tmp_path / "notes.png"
    junk.write_text("not a picture")
    good = str(IMAGES / "coffee.png")
    run = duomo("infer", "-c", str(DEMO_CONFIG), "classify", str(junk), good, "--json")
    assert run.returncode == 1
    assert "not an image" in run.stderr and "Traceback" not in run.stderr
    assert json.loads(run.stdout)["image"] == good  # the good image was still answered


def test_unknown_model_exits_2(demo_config: object) -> None:
    run = duomo("infer", "-c", str(DEMO_CONFIG), "nope", str(IMAGES / "coffee.png"))
    assert run.returncode == 2
    assert "no model named 'nope'" in run.stderr


def test_a_model_that_fails_to_load_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken.onnx").write_bytes(b"this is not onnx")
    config = tmp_path / "broken.yaml"
    config.write_text("models:\n  - {name: b, task: classification, file: broken.onnx}\n")
    run = duomo("infer", "-c", str(config), "b", str(IMAGES / "coffee.png"))
    assert run.returncode == 2
    assert "model 'b' failed to load" in run.stderr and "Traceback" not in run.stderr


def test_inspect_describes_a_demo_model(demo_config: object) -> None:
    run = duomo("inspect", str(ROOT / "models" / "classify" / "efficientnet_lite0.onnx"))
    assert run.returncode == 0, run.stderr
    inputs = json.loads(run.stdout)["inputs"]
    assert inputs == [{"name": "input", "dtype": "float32", "dims": ["?", 3, 224, 224]}]


def test_check_opens_every_model_file_of_the_demo(demo_config: object) -> None:
    run = duomo("check", "-c", str(DEMO_CONFIG))
    assert run.returncode == 0, run.stderr
    # ocr's three, face, classify, face_embedding, face_attributes' two
    assert run.stdout.count("loads in onnxruntime") == 8
    assert "faces: pipeline detect(face) → embedding(face_embedding for each detect)" in run.stdout
