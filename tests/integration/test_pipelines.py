"""Pipelines on the real models (issue 35): the demo's ``faces`` (face → embedding + attributes)
in process (an ``Engine``) and through a real supervisor — its slots, its producers, its
streams, ``duomo infer`` and ``duomo status``. The KServe gateway's side is
tests/integration/test_pipeline_gateway.py; what a config may say, tests/unit.

Images: the fixtures' faces (astronaut.png, its mirror image, camera.png's) and a mosaic of the
three side by side at half size (three faces a frame). A test-only image executor
(``tests.fakes.faulty_executor:FaultyImageExecutor``) stands in as a second-stage model that
answers what it was handed (``probe``) or fails every batch (``broken``).

Run as ``python -m tests.integration.test_pipelines SOCKET PIPELINE FACES SECONDS SLOTS`` it is
the producer process of the load tests: it sends the image with FACES faces to PIPELINE for
SECONDS, SLOTS requests in flight, checks every answer and prints a JSON summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import yaml

from duomo.ipc.client import Client
from duomo.ipc.errors import DuomoError, UnavailableError
from duomo.ipc.status_records import ModelStatus
from duomo.supervisor.config import load_config
from duomo.supervisor.core.engine import Engine
from duomo.worker.galleries.store import GalleryStore
from tests.conftest import DEMO_CONFIG, IMAGES, ROOT, fixture_image
from tests.integration.harness import (
    SupervisorProcess,
    duomo,
    poll,
    running_supervisor,
    write_config,
)

FACE_MODELS = ["face", "face_embedding", "face_attributes", "people"]
IMAGE_TASK = "tests.fakes.faulty_executor:FaultyImageExecutor"
NEVER_RESTARTED = {"max_consecutive_failures": 1_000_000}  # (the watchdog leaves it failing)
PROBE = {"name": "probe", "task": IMAGE_TASK, "files": {}, "max_batch": 8, "max_delay_ms": 0}
BROKEN = {**PROBE, "name": "broken", "params": {"fault": "raise"}, "health": NEVER_RESTARTED}
SLOW = {**PROBE, "name": "slow", "max_batch": 1, "params": {"work_ms": 600}}
LANDMARKS = {"step": "detect", "input": "landmarks"}
REUSE = {
    "name": "faces_reuse",
    "tracker": {"iou": 0.3, "max_missed": 10},
    "steps": [
        {"name": "detect", "model": "face"},
        {
            "name": "embedding",
            "model": "face_embedding",
            "for_each": LANDMARKS,
            "reinfer_every": 5,
            "reinfer_area_ratio": 1.5,
        },
        {"name": "attributes", "model": "face_attributes", "for_each": LANDMARKS},
        {
            "name": "identity",
            "model": "people",
            "for_each": {"step": "embedding", "input": "result"},
            "reinfer_every": 3,
        },
    ],
}
FAULTY = {
    "name": "faces_faulty",
    "steps": [
        {"name": "detect", "model": "face"},
        {"name": "embedding", "model": "face_embedding", "for_each": LANDMARKS},
        {"name": "broken", "model": "broken", "for_each": LANDMARKS},
        {"name": "marks", "model": "probe", "for_each": LANDMARKS},
        {
            "name": "chip",
            "model": "probe",
            "for_each": {"step": "detect", "margin": 0.1, "resize": [32, 48], "largest": 2},
        },
    ],
}


SLOWLY = {
    "name": "faces_slowly",
    "steps": [
        {"name": "detect", "model": "face"},
        {"name": "slow", "model": "slow", "for_each": LANDMARKS},
    ],
}


def rgb(image: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(
        np.repeat(image[:, :, None], 3, axis=2) if image.ndim == 2 else image
    )


ASTRONAUT = rgb(fixture_image("astronaut.png"))
MIRROR = np.ascontiguousarray(ASTRONAUT[:, ::-1])
CAMERA = rgb(fixture_image("camera.png"))
# three faces a frame, at half size (each about 45 × 58 px): the load tests' frame
MOSAIC = np.ascontiguousarray(np.concatenate([ASTRONAUT, MIRROR, CAMERA], axis=1)[::2, ::2])
BLANK = np.zeros((240, 320, 3), dtype=np.uint8)


def demo_pipelines() -> list[dict[str, Any]]:
    return list(yaml.safe_load(DEMO_CONFIG.read_text())["pipelines"])


def pipelines_config(folder: Path, **top: Any) -> Path:
    """The demo's face models and pipeline ``faces``, the test pipelines and the probes;
    ``top`` may override ``models`` entries through ``overrides`` and set top-level keys."""
    overrides = top.pop("overrides", None)
    return write_config(
        folder, FACE_MODELS, extra=[PROBE, BROKEN, SLOW], overrides=overrides,
        pipelines=[*demo_pipelines(), REUSE, FAULTY, SLOWLY], **top,
    )  # fmt: skip


def vector(face: dict[str, Any]) -> np.ndarray:
    return np.asarray(face["embedding"]["embedding"], dtype=np.float64)


def answered_in_full(result: dict[str, Any], faces: int) -> bool:
    """``faces`` faces, each with its embedding and attributes, no sub-result an error."""
    found = result.get("faces")
    if not isinstance(found, list) or len(found) != faces:
        return False
    return all(
        len(f.get("embedding", {}).get("embedding", [])) == 128
        and f.get("attributes", {}).get("gender") in ("female", "male")
        for f in found
    )


def step_counts(status: dict[str, Any], pipeline: str) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in status["pipelines"][pipeline]["steps"]}


# -- in process -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipelines")


@pytest.fixture(scope="module")
def engine(folder: Path, demo_config: object) -> Iterator[Engine]:
    (folder / "engine").mkdir()
    with Engine(load_config(pipelines_config(folder / "engine"))) as engine:
        yield engine


def test_the_astronaut_one_face_its_mirror_image_and_another_person(engine: Engine) -> None:
    astronaut = engine.infer("faces", ASTRONAUT, timeout_s=60)
    mirror = engine.infer("faces", MIRROR, timeout_s=60)
    camera = engine.infer("faces", CAMERA, timeout_s=60)
    assert [len(r["faces"]) for r in (astronaut, mirror, camera)] == [1, 1, 1]
    (face,) = astronaut["faces"]
    assert set(face) == {"box", "score", "landmarks", "embedding", "attributes", "identity"}
    assert face["identity"] == {"name": None, "similarity": None}  # an empty gallery
    assert face["score"] > 0.8 and len(face["landmarks"]) == 5
    mine = vector(face)
    assert mine.shape == (128,) and abs(np.linalg.norm(mine) - 1.0) < 1e-4
    same, other = float(mine @ vector(mirror["faces"][0])), float(mine @ vector(camera["faces"][0]))
    assert same >= 0.9, same
    assert other < 0.4, other
    for result, gender in ((astronaut, "female"), (camera, "male")):
        attributes = result["faces"][0]["attributes"]
        assert attributes["gender"] == gender
        assert 0.5 < attributes["gender_probability"] <= 1.0
        assert 0.0 < attributes["age"] < 100.0 and 0.0 <= attributes["age_confidence"] <= 1.0
    # the pipeline answers what its models answer, step by step
    direct = engine.infer("face", ASTRONAUT, timeout_s=60)["faces"][0]
    assert direct["box"] == face["box"] and direct["landmarks"] == face["landmarks"]
    request = {"image": ASTRONAUT, "landmarks": np.asarray(face["landmarks"], np.float32)}
    np.testing.assert_allclose(
        engine.infer("face_embedding", request, timeout_s=60)["embedding"], mine, atol=1e-5
    )


def test_a_step_over_the_embedding_names_the_face_enrolled_meanwhile(
    engine: Engine, folder: Path
) -> None:
    """``identity`` takes each face's embedding (``input: result``); an enrolment in the
    gallery file is searched from the next frame on, without a reload, and so is a removal."""
    embedded = vector(engine.infer("faces", ASTRONAUT, timeout_s=60)["faces"][0])
    with GalleryStore.open(folder / "engine" / "people.gallery") as gallery:
        gallery.add("Eileen Collins", embedded)
        try:
            mirror = engine.infer("faces", MIRROR, timeout_s=60)["faces"][0]["identity"]
            camera = engine.infer("faces", CAMERA, timeout_s=60)["faces"][0]["identity"]
        finally:
            gallery.remove("Eileen Collins", vacuum=True)
        again = engine.infer("faces", MIRROR, timeout_s=60)["faces"][0]["identity"]
    assert mirror["name"] == "Eileen Collins" and mirror["similarity"] > 0.9, mirror
    assert camera["name"] is None and camera["similarity"] < 0.363, camera
    assert again == {"name": None, "similarity": None}  # empty again
    # the embedding it was given is the face's, and the step comes last in the face's keys
    mosaic = engine.infer("faces", MOSAIC, timeout_s=60)["faces"]
    assert [list(f)[-3:] for f in mosaic] == [["embedding", "attributes", "identity"]] * 3


def test_a_frame_without_a_face_runs_no_second_step_and_is_counted(engine: Engine) -> None:
    before = engine.status().pipelines["faces"].to_dict()
    embedded = engine.status().models["face_embedding"].requests
    # (the detector's scale says how large a face it could have found: 640 / 320)
    assert engine.infer("faces", BLANK, timeout_s=60) == {"faces": [], "scale": 2.0}
    after = engine.status().pipelines["faces"].to_dict()
    for name in ("embedding", "attributes"):
        was = step_counts({"pipelines": {"faces": before}}, "faces")[name]
        now = step_counts({"pipelines": {"faces": after}}, "faces")[name]
        assert now["skipped"] == was["skipped"] + 1, name
        assert now["runs"] == was["runs"], name
    detect_was, detect_now = before["steps"][0], after["steps"][0]
    assert detect_now["runs"] == detect_was["runs"] + 1 and detect_now["skipped"] == 0
    assert engine.status().models["face_embedding"].requests == embedded  # nothing ran
    assert after["requests"] == before["requests"] + 1 and after["errors"] == before["errors"]
    zero = dict(after["objects"]["buckets"])["0"] - dict(before["objects"]["buckets"])["0"]
    assert zero == 1 and after["objects"]["frames"] == before["objects"]["frames"] + 1


def test_three_faces_a_frame_and_what_each_step_was_handed(engine: Engine) -> None:
    before = engine.status().pipelines["faces_faulty"].to_dict()
    result = engine.infer("faces_faulty", MOSAIC, timeout_s=60)
    faces = result["faces"]
    assert len(faces) == 3
    for face in faces:
        assert len(vector(face)) == 128  # the other steps answered
        assert face["broken"]["error"]["code"] == "INTERNAL"  # the failing one: this sub-result
        assert "'broken'" in face["broken"]["error"]["message"]
        # landmarks: the whole frame and the face's five points
        assert face["marks"] == {
            "mean": pytest.approx(float(MOSAIC.mean()), rel=1e-6),
            "shape": list(MOSAIC.shape[:2]),
            "points": 5,
        }
    # a crop widened by 10 % and resized to 32 × 48, for the two largest faces only
    areas = [(f["box"][2] - f["box"][0]) * (f["box"][3] - f["box"][1]) for f in faces]
    cropped = [i for i, f in enumerate(faces) if "chip" in f]
    assert len(cropped) == 2 and min(areas) not in [areas[i] for i in cropped]
    for i in cropped:
        assert faces[i]["chip"]["shape"] == [48, 32] and faces[i]["chip"]["points"] == 0
    after = engine.status().pipelines["faces_faulty"].to_dict()
    counts = {s["name"]: s["runs"] - b["runs"] for s, b in zip(after["steps"], before["steps"])}
    assert counts == {"detect": 1, "embedding": 3, "broken": 3, "marks": 3, "chip": 2}
    errors = {s["name"]: s["errors"] - b["errors"] for s, b in zip(after["steps"], before["steps"])}
    assert errors == {"detect": 0, "embedding": 0, "broken": 3, "marks": 0, "chip": 0}
    assert after["requests"] == before["requests"] + 1
    assert after["errors"] == before["errors"]  # the frame itself was answered OK
    assert after["objects"]["count"] == before["objects"]["count"] + 3


def test_a_failed_first_step_fails_the_frame(engine: Engine) -> None:
    before = engine.status().pipelines["faces"].to_dict()
    with pytest.raises(DuomoError) as info:
        engine.infer("faces", np.zeros((4, 4, 2), np.uint8), timeout_s=60)
    assert info.value.code.name == "INVALID_ARGUMENT"
    after = engine.status().pipelines["faces"].to_dict()
    assert after["errors"] == before["errors"] + 1
    assert [s["runs"] for s in after["steps"][1:]] == [s["runs"] for s in before["steps"][1:]]


def test_the_frames_deadline_carries_into_its_steps(engine: Engine) -> None:
    """A face's step that waits past the frame's deadline answers DEADLINE_EXCEEDED in its
    sub-result; the frame, detected in time, is answered."""
    busy = engine.submit("slow", ASTRONAUT)  # holds ``slow`` for 0.6 s
    time.sleep(0.05)
    started = time.monotonic()
    answer = engine.submit("faces_slowly", ASTRONAUT, deadline_s=started + 0.3).result(30)
    (face,) = answer["faces"]
    assert face["slow"]["error"]["code"] == "DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 0.6 + 0.3  # answered when its turn came, not after a run
    busy.result(30)
    answer = engine.submit("faces_slowly", ASTRONAUT, deadline_s=time.monotonic() + 5).result(30)
    assert answer["faces"][0]["slow"]["shape"] == list(ASTRONAUT.shape[:2])


def test_the_frames_priority_carries_into_its_steps(engine: Engine) -> None:
    """Two frames whose faces wait for a busy step: the later frame, of higher priority, has
    its face's step run first."""
    busy = engine.submit("slow", ASTRONAUT)  # holds ``slow`` for 0.6 s
    time.sleep(0.05)
    done: dict[str, float] = {}
    low = engine.submit("faces_slowly", ASTRONAUT, priority=0)
    low.add_done_callback(lambda _: done.setdefault("low", time.monotonic()))
    time.sleep(0.2)  # its face is queued on ``slow`` first
    high = engine.submit("faces_slowly", ASTRONAUT, priority=5)
    high.add_done_callback(lambda _: done.setdefault("high", time.monotonic()))
    for future in (busy, low, high):
        future.result(30)
    assert done["high"] < done["low"]


# -- through a supervisor ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sup(folder: Path, demo_config: object) -> Iterator[SupervisorProcess]:
    (folder / "sup").mkdir()
    with running_supervisor(pipelines_config(folder / "sup")) as running:
        yield running


def test_served_like_a_model(sup: SupervisorProcess, engine: Engine) -> None:
    with Client(sup.socket, timeout_s=60) as client:
        tasks = {m.name: m.task for m in client.models()}
        assert tasks["faces"] == tasks["faces_reuse"] == tasks["faces_faulty"] == "pipeline"
        assert tasks["face_embedding"] == "face_embedding"
        faces = client.model("faces", slots=2)
        answer = faces.infer(ASTRONAUT, timeout_s=60)
        gray = faces.infer(fixture_image("camera.png"), timeout_s=60)  # H×W: a gray frame
        blank = faces.infer(BLANK, timeout_s=60)
        faulty = client.model("faces_faulty", slots=1).infer(MOSAIC, timeout_s=60)
    local = engine.infer("faces", ASTRONAUT, timeout_s=60)
    assert answered_in_full(answer, 1) and answered_in_full(gray, 1)
    assert answer["faces"][0]["box"] == local["faces"][0]["box"]
    assert float(vector(answer["faces"][0]) @ vector(local["faces"][0])) > 0.9999
    assert answer["faces"][0]["attributes"]["gender"] == "female"
    assert blank == {"faces": [], "scale": 2.0}
    assert len(faulty["faces"]) == 3
    for face in faulty["faces"]:  # through a slot: the failure is still that sub-result alone
        assert face["broken"]["error"]["code"] == "INTERNAL"
        assert len(vector(face)) == 128 and face["marks"]["points"] == 5
        assert face["score"] > 0.5 and len(face["box"]) == 4


def test_stream_frames_keep_their_track_ids(sup: SupervisorProcess) -> None:
    with Client(sup.socket, timeout_s=60) as client:
        ids: dict[str, list[list[int]]] = {}
        for name in ("cam-a", "cam-b"):
            with client.stream(name, models=["faces"], policy="fifo") as stream:
                answers = [one_answer(stream, MOSAIC) for _ in range(4)]
            assert all(a.ok and a.model == "faces" for a in answers), answers
            assert all(answered_in_full(a.result, 3) for a in answers)
            ids[name] = [[f["track_id"] for f in a.result["faces"]] for a in answers]
        unstreamed = client.model("faces", slots=1).infer(MOSAIC, timeout_s=60)
    for name, seen in ids.items():
        assert len(set(seen[0])) == 3, seen  # three faces, three ids
        assert all(frame == seen[0] for frame in seen), (name, seen)  # the same on every frame
    assert sorted(ids["cam-a"][0]) == sorted(ids["cam-b"][0]) == [1, 2, 3]  # a tracker a stream
    assert all("track_id" not in f for f in unstreamed["faces"])  # not a stream's frame


def one_answer(stream: Any, frame: np.ndarray) -> Any:
    """Send ``frame`` and wait for its answer (one frame in flight: a result kept by a frame
    is there for the next)."""
    stream.send(frame)
    for answer in stream.answers(timeout_s=60):
        return answer
    raise AssertionError("no answer within 60 s")


def zoomed(image: np.ndarray, about: tuple[float, float], factor: float) -> np.ndarray:
    matrix = cv2.getRotationMatrix2D(about, 0.0, factor)
    h, w = image.shape[:2]
    return np.ascontiguousarray(cv2.warpAffine(image, matrix, (w, h)))


def test_a_tracked_face_reuses_its_embedding_for_reinfer_every_frames(
    sup: SupervisorProcess,
) -> None:
    with Client(sup.socket, timeout_s=60) as client:
        with client.stream("cam-reuse", models=["faces_reuse"], policy="fifo") as stream:
            answers = [one_answer(stream, ASTRONAUT) for _ in range(7)]
        faces = [a.result["faces"][0] for a in answers]
        assert len({f["track_id"] for f in faces}) == 1
        reused = [f["embedding"].get("reused", False) for f in faces]
        assert reused == [False, True, True, True, True, False, True]  # frames 2..5, then 7
        # the identity, over the embedding (reused or not), is kept with the track as well
        named = [f["identity"].get("reused", False) for f in faces]
        assert named == [False, True, True, False, True, True, False]  # reinfer_every 3
        assert all(f["identity"]["name"] is None for f in faces)
        first = vector(faces[0])
        assert all(float(vector(f) @ first) > 0.9999 for f in faces)
        assert all("reused" not in f["attributes"] for f in faces)  # reinfer_every 1: each frame
        assert all("reused" not in f for f in faces)  # the mark is on the sub-result

        # a face that grew by more than reinfer_area_ratio (1.5) is embedded again at once
        box = faces[0]["box"]
        centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        with client.stream("cam-grow", models=["faces_reuse"], policy="fifo") as stream:
            small = one_answer(stream, ASTRONAUT).result["faces"][0]
            near = one_answer(stream, zoomed(ASTRONAUT, centre, 1.1)).result["faces"][0]
            grown = one_answer(stream, zoomed(ASTRONAUT, centre, 1.4)).result["faces"][0]
    area = [(f["box"][2] - f["box"][0]) * (f["box"][3] - f["box"][1]) for f in (small, near, grown)]
    assert small["track_id"] == near["track_id"] == grown["track_id"]
    assert area[1] / area[0] < 1.5 and near["embedding"].get("reused") is True
    assert area[2] / area[0] > 1.5 and "reused" not in grown["embedding"]


def test_status_counts_per_pipeline_and_step(sup: SupervisorProcess) -> None:
    with Client(sup.socket, timeout_s=60) as client:
        before = client.status().to_dict()
        assert "pipelines" in before, sorted(before)  # ``duomo status`` shows pipelines
        with client.stream("cam-status", models=["faces_reuse"], policy="fifo") as stream:
            for _ in range(5):
                assert one_answer(stream, ASTRONAUT).ok
            assert one_answer(stream, BLANK).result == {"faces": [], "scale": 2.0}
        after = client.status().to_dict()
    shown, was = after["pipelines"]["faces_reuse"], before["pipelines"]["faces_reuse"]
    assert shown["state"] == "READY" and shown["requests"] - was["requests"] == 6
    steps, old = step_counts(after, "faces_reuse"), step_counts(before, "faces_reuse")
    delta = {
        name: {k: steps[name][k] - old[name][k] for k in ("runs", "skipped", "reused", "errors")}
        for name in steps
    }
    assert delta["detect"] == {"runs": 6, "skipped": 0, "reused": 0, "errors": 0}
    assert delta["embedding"] == {"runs": 1, "skipped": 1, "reused": 4, "errors": 0}
    assert delta["attributes"] == {"runs": 5, "skipped": 1, "reused": 0, "errors": 0}
    assert delta["identity"] == {"runs": 2, "skipped": 0, "reused": 3, "errors": 0}
    text = duomo(sup.socket, "status")
    assert text.returncode == 0, text.stderr
    assert "faces_reuse" in text.stdout and "face_embedding" in text.stdout


def test_a_pipelines_status_alone_is_its_first_models_with_its_own_figures(
    sup: SupervisorProcess,
) -> None:
    """``status`` of a pipeline's name alone (what the gateway's statistics read) answers a
    model's status: its first step's model's, with the pipeline's own state and request
    figures and no batch sizes (``ServedPipeline.model_status``)."""
    with Client(sup.socket, timeout_s=60) as client:
        assert client.model("faces").infer(ASTRONAUT, timeout_s=60)["faces"]
        one = client.request("status", model="faces")["model_status"]
        whole = client.status()
    shown = ModelStatus.from_dict(one)
    assert shown.to_dict() == one  # the documented shape, key for key
    pipeline, root = whole.pipelines["faces"], whole.models["face"]
    assert shown.state == pipeline.state == "READY" and shown.batch_sizes == {}
    assert shown.requests == pipeline.requests >= 1 and shown.errors == pipeline.errors
    assert (shown.max_batch, shown.instances) == (root.max_batch, root.instances)
    assert shown.totals.timed["success"].count == pipeline.requests - pipeline.errors


def test_chips_of_frames_from_several_producers_batch_together(sup: SupervisorProcess) -> None:
    def sizes() -> dict[int, int]:
        with Client(sup.socket, timeout_s=60) as client:
            shown = client.status().models["face_embedding"].batch_sizes
        return {int(size): n for size, n in shown.items()}

    before = sizes()
    reports = [summary(p) for p in [producer(sup, "faces", 3, seconds=4.0) for _ in range(3)]]
    for report in reports:
        assert report["sent"] >= 3 and report["ok"] == report["sent"], report
    grown = {size: n - before.get(size, 0) for size, n in sizes().items()}
    chips = sum(size * n for size, n in grown.items())
    assert chips == 3 * sum(r["sent"] for r in reports), grown  # each face's chip, once
    # a batch of more than 3 chips holds chips of more than one frame (three faces a frame)
    assert sum(n for size, n in grown.items() if size > 3) > 0, grown


def test_duomo_infer_prints_the_nested_answer(sup: SupervisorProcess, demo_config: object) -> None:
    image = str(IMAGES / "astronaut.png")
    through = duomo(sup.socket, "infer", "faces", image, "--json")
    local = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "infer", "-c", str(DEMO_CONFIG), "faces",
         image, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    for run in (through, local):
        assert run.returncode == 0, run.stderr
        (row,) = [json.loads(line) for line in run.stdout.splitlines()]
        assert row["image"] == image and row["model"] == "faces"
        assert answered_in_full(row["result"], 1), row
        assert row["result"]["faces"][0]["attributes"]["gender"] == "female"
    plain = duomo(sup.socket, "infer", "faces", image)
    assert plain.returncode == 0 and "embedding" in plain.stdout and "female" in plain.stdout


def test_load_and_unload_of_a_pipeline(sup: SupervisorProcess) -> None:
    loaded = duomo(sup.socket, "load", "faces")
    assert loaded.returncode == 0, loaded.stderr
    refused = duomo(sup.socket, "unload", "faces")
    assert refused.returncode == 2, refused
    assert "'faces' is a pipeline" in refused.stderr and "Traceback" not in refused.stderr
    with Client(sup.socket, timeout_s=60) as client:
        states = {m.name: m.state for m in client.models()}
    assert all(states[name] == "READY" for name in [*FACE_MODELS, "faces"]), states


# -- reload ---------------------------------------------------------------------------------


def test_reloading_the_embedding_model_under_pipeline_load_loses_nothing(
    tmp_path: Path, demo_config: object
) -> None:
    config = pipelines_config(tmp_path)
    with running_supervisor(config) as running:
        producers = [producer(running, "faces", 1, seconds=8.0) for _ in range(2)]

        def embedded() -> int:
            with Client(running.socket) as client:
                return client.status().models["face_embedding"].requests

        poll(lambda: embedded() >= 6, timeout_s=60)  # the reload comes under load
        pipelines_config(tmp_path, overrides={"face_embedding": {"max_batch": 6}})
        reloaded = duomo(running.socket, "reload")
        assert reloaded.returncode == 0, reloaded.stderr
        assert reloaded.stdout.strip() == "duomo reloaded: replaced: face_embedding"
        with Client(running.socket) as client:
            shown = client.status().models["face_embedding"]
        assert shown.max_batch == 6 and shown.state == "READY"
        settled = embedded()
        poll(lambda: embedded() >= settled + 4, timeout_s=60)  # the new one serves the pipeline
        reports = [summary(p) for p in producers]
    for report in reports:
        assert report["sent"] > 5, report
        assert report["ok"] == report["sent"] and not report["errors"], report  # none lost


# -- the producer process -------------------------------------------------------------------


def producer(
    sup: SupervisorProcess, pipeline: str, faces: int, seconds: float, slots: int = 3
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_pipelines", str(sup.socket), pipeline,
         str(faces), str(seconds), str(slots)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def summary(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    return dict(json.loads(out.strip().splitlines()[-1]))


def produce(socket_path: str, pipeline: str, faces: int, seconds: float, slots: int) -> int:
    frame = {1: ASTRONAUT, 3: MOSAIC}[faces]
    sent = ok = 0
    errors: dict[str, int] = {}
    wrong: list[Any] = []
    with Client(socket_path, timeout_s=60) as client:
        model = client.model(pipeline, slots=slots)
        in_flight: list[Future[Any]] = []

        def settle(future: Future[Any]) -> None:
            nonlocal ok
            try:
                result = future.result(120)
            except DuomoError as err:
                errors[err.code.name] = errors.get(err.code.name, 0) + 1
                return
            if answered_in_full(result, faces):
                ok += 1
            else:
                wrong.append(result)

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            in_flight.append(model.infer_async(frame, timeout_s=60))
            sent += 1
            if len(in_flight) >= slots:
                settle(in_flight.pop(0))
        for future in in_flight:
            settle(future)
    print(json.dumps({"sent": sent, "ok": ok, "errors": errors, "wrong": wrong[:2]}), flush=True)
    return 0


if __name__ == "__main__":
    socket_arg, pipeline_arg, faces_arg, seconds_arg, slots_arg = sys.argv[1:6]
    sys.exit(produce(socket_arg, pipeline_arg, int(faces_arg), float(seconds_arg), int(slots_arg)))


def test_a_hung_step_answers_the_frame_and_holds_its_slot_until_the_batch_ends(
    tmp_path: Path, demo_config: object
) -> None:
    """A face's step that hangs is abandoned by the watchdog: the frame is answered (that
    sub-result UNAVAILABLE), and its slot, which the hung batch may still read, stays reserved
    until that batch really ends."""
    control = tmp_path / "stuck.fault"
    control.write_text("hang")
    stuck = {
        **PROBE, "name": "stuck", "max_batch": 1, "params": {"control_file": str(control)},
        "health": {"exec_timeout_ms": 500, "backoff_ms": 0},
    }  # fmt: skip
    hangs = {"name": "hangs", "steps": [
        {"name": "detect", "model": "face"},
        {"name": "stuck", "model": "stuck", "for_each": LANDMARKS},
    ]}  # fmt: skip
    config = write_config(
        tmp_path, ["face"], extra=[stuck], pipelines=[hangs], watchdog={"period_ms": 100}
    )
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=30) as client:
        handle = client.model("hangs", slots=2)
        slot = handle.slot()
        slot.write(ASTRONAUT)
        slot.submit()
        (face,) = slot.wait(timeout_s=20)["faces"]
        assert face["stuck"]["error"]["code"] == "UNAVAILABLE"
        slot.submit()  # the hung batch may still read the frame in this slot
        with pytest.raises(UnavailableError, match="still held"):
            slot.wait(timeout_s=10)
        control.write_text("none")  # the hung thread ends, and lets go of the slot

        def served() -> bool:
            slot.submit()
            try:
                return "mean" in slot.wait(timeout_s=10)["faces"][0]["stuck"]
            except UnavailableError:
                return False

        poll(served, timeout_s=60)
        slot.release()
