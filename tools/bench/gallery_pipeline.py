"""The galleries benchmark's pipeline part (``duomo bench --galleries``, issue 47): what the
``identity`` step costs the ``faces`` pipeline, and how fast people enrol through the producer API.

One supervisor (``duomo start``, as ``tools.bench.fleet.serving`` starts it) on the demo config's
``face``, ``face_embedding``, ``face_attributes`` and ``people``, the gallery file in a temporary
folder holding ``identities`` random identities (``GalleryStore.add_many`` before the start),
and two pipelines: the demo's ``faces`` (detect → embedding + attributes → identity) and
``faces_without_identity`` (the same without its last step). Then, from this process:

1. *enrolment*: ``enrol_images`` single-face images added one after another through the producer
   API (``client.gallery("people").add(name, [image])``: the pipeline run on the image, the one
   face checked, its embedding written by the supervisor): images per second. The images are
   the three photos of the galleries' tests (the astronaut of ``tests/fixtures/images``, Grace
   Hopper and Tom Hanks from ``models/test_images``, fetched by ``tools/prepare_models.py
   --test-images``) and their mirror images, in turn, each under a name of its own.
2. *frames*: a 640×640 frame of 4 faces (a 2×2 mosaic of the astronaut, the camera man of
   ``camera.png``, Grace Hopper and Tom Hanks) sent closed loop by ``threads`` threads sharing
   one handle, into each pipeline in turn for ``seconds``, ``rounds`` rounds (with, without,
   without, with, …: the machine's drift hits both alike): frames per second. Every answer is
   checked: four faces, each with an embedding, and with the step each one's identity, the three
   enrolled by name and the camera man nobody (a wrong answer fails the part). Before each
   trial of ``QUIET_FROM_S`` or more the run waits (at most twice the trial's length) for the
   shared machine's other work to fall below ``quiet_below`` cores, and each trial records the
   cores the supervisor and this process used and what the rest of the machine kept busy
   meanwhile (``others_cores``): a round far from the others is read beside it.

Called by ``tools.bench.galleries.bench_galleries``; its figures go into that section.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from duomo.ipc.client import Client
from duomo.ipc.handle import ModelHandle
from duomo.supervisor.operators.image_files import read_image
from duomo.worker.galleries.store import GalleryLimits, GalleryStore, NewIdentity
from tools.bench.fleet import serving
from tools.bench.sampler import TreeSampler, wait_quiet
from tools.bench.servers import supervisor_config

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "default.yaml"
FIXTURES = ROOT / "tests" / "fixtures" / "images"
TEST_IMAGES = ROOT / "models" / "test_images"
MODELS = ["face", "face_embedding", "face_attributes", "people"]
WITH, WITHOUT = "faces", "faces_without_identity"
TILE = 320  # the mosaic's tiles: 640×640 in all
TIMEOUT_S = 60.0
QUIET_FROM_S = 5.0  # (the tests' miniature trials, shorter, do not wait: the wait reads 1 s)
PEOPLE = {"Eileen Collins": "astronaut.png", "Grace Hopper": "grace_hopper.jpg",
          "Tom Hanks": "Tom_Hanks_54745.png"}  # fmt: skip
STRANGER = "camera.png"
FRAMED = "Tom_Hanks_54745.png"  # a 112×112 chip, the face edge to edge


@dataclass(frozen=True)
class GalleryPipelineSettings:
    """What the pipeline part runs (``duomo bench --gallery-pipeline-*``)."""

    seconds: float = 10.0  # per round and pipeline
    rounds: int = 2  # each a with and a without, the order reversed every other round
    threads: int = 2  # requests in flight, closed loop
    identities: int = 1000  # random identities in the gallery beside the enrolled
    enrol_images: int = 30
    quiet_below: float = 0.3  # cores of the machine's other work a trial waits to fall below


def _log(message: str) -> None:
    print(f"duomo bench: galleries: {message}", file=sys.stderr, flush=True)


def _photo(name: str) -> np.ndarray:
    """One photo, RGB; Tom Hanks's 112×112 chip framed in a plain border half its size a side
    (the detector wants room around a face)."""
    path = FIXTURES / name if (FIXTURES / name).is_file() else TEST_IMAGES / name
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: run `python tools/prepare_models.py --test-images` "
            "(make bench does)"
        )
    image = read_image(path)
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2RGB)
    if name == FRAMED:
        image = cv2.copyMakeBorder(image, 56, 56, 56, 56, cv2.BORDER_CONSTANT, value=(128,) * 3)
    return np.ascontiguousarray(image[..., :3])


def mosaic(images: list[np.ndarray]) -> np.ndarray:
    """Four images in a 2×2 mosaic of ``TILE`` squares (each resized whole)."""
    tiles = [cv2.resize(im, (TILE, TILE), interpolation=cv2.INTER_AREA) for im in images]
    rows = [np.concatenate(tiles[0:2], axis=1), np.concatenate(tiles[2:4], axis=1)]
    return np.ascontiguousarray(np.concatenate(rows, axis=0))


def _tile_of(face: dict[str, Any]) -> int:
    x1, y1, x2, y2 = face["box"]
    return int((y1 + y2) / 2 >= TILE) * 2 + int((x1 + x2) / 2 >= TILE)


def check_answer(answer: Any, named: list[str | None], identity: bool) -> None:
    """Four faces, one per tile, each embedded; with ``identity``, the one in tile ``i`` is
    ``named[i]``. RuntimeError otherwise."""
    faces = answer.get("faces") if isinstance(answer, dict) else None
    if not isinstance(faces, list) or sorted(_tile_of(f) for f in faces) != [0, 1, 2, 3]:
        raise RuntimeError(f"not one face per tile: {answer!r:.500}")
    for face in faces:
        if "embedding" not in face.get("embedding", {}):
            raise RuntimeError(f"a face without its embedding: {face!r:.300}")
        if identity != ("identity" in face):
            raise RuntimeError(f"identity {'missing' if identity else 'there'}: {face!r:.300}")
        if identity and face["identity"].get("name") != named[_tile_of(face)]:
            raise RuntimeError(f"tile {_tile_of(face)} is {named[_tile_of(face)]}: {face!r:.300}")


def _config(workdir: Path, identities: int) -> Path:
    config = supervisor_config(DEMO_CONFIG, MODELS, workdir / "galleries.yaml")
    raw = yaml.safe_load(config.read_text())
    people = next(m for m in raw["models"] if m["name"] == "people")
    people["file"] = str(workdir / "people.gallery")
    params = people.setdefault("params", {})
    params["max_identities"] = max(identities + 1000, params.get("max_identities", 0))
    faces = next(p for p in raw["pipelines"] if p["name"] == WITH)
    bare = [s for s in faces["steps"] if s["model"] != "people"]
    raw["pipelines"] = [faces, {"name": WITHOUT, "steps": bare}]
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    rows = np.random.default_rng(47).standard_normal((identities, 128)).astype(np.float32)
    with GalleryStore.create(Path(people["file"]), params["embedding_model"], 128) as store:
        limits = GalleryLimits(max_identities=params["max_identities"])
        store.add_many((NewIdentity(f"random-{i}", r) for i, r in enumerate(rows)), limits=limits)
    return config


def enrol(client: Client, count: int) -> dict[str, Any]:
    """``count`` single-face images through the producer API, one after another."""
    photos = [_photo(name) for name in PEOPLE.values()]
    images = [*photos, *(np.ascontiguousarray(p[:, ::-1]) for p in photos)]
    people = client.gallery("people")
    people.add("warm-up", [images[0]])  # (the pipeline's first request is not timed)
    people.remove("warm-up")
    started = time.perf_counter()
    for n in range(count):
        people.add(f"enrolled-{n}", [images[n % len(images)]], labels=[f"image {n}"])
    elapsed = time.perf_counter() - started
    for n in range(count):
        people.remove(f"enrolled-{n}")
    return {"images": count, "seconds": elapsed, "images_per_s": count / elapsed}


def _closed_loop(handle: ModelHandle, frame: np.ndarray, threads: int, seconds: float,
                 check: Any) -> dict[str, Any]:  # fmt: skip
    """``threads`` threads sending ``frame`` one after another for ``seconds``."""
    answered = [0] * threads
    failures: list[BaseException] = []
    end_at = time.perf_counter() + seconds

    def loop(k: int) -> None:
        try:
            while time.perf_counter() < end_at:
                check(handle.infer(frame, timeout_s=TIMEOUT_S))
                answered[k] += 1
        except BaseException as err:  # (any: reported by the caller, which fails the part)
            failures.append(err)

    started = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"a request failed: {failures[0]!r}") from failures[0]
    return {"frames": sum(answered), "seconds": elapsed, "frames_per_s": sum(answered) / elapsed}


def run_gallery_pipeline(settings: GalleryPipelineSettings) -> dict[str, Any]:
    """Both measurements in one supervisor; the figures of the module docstring."""
    with tempfile.TemporaryDirectory(prefix="duomo-bench-gallery-pipeline-") as tmp:
        workdir = Path(tmp)
        config = _config(workdir, settings.identities)
        socket = workdir / "g.sock"
        with serving(config, socket), Client(socket) as client:
            people = client.gallery("people")
            for name, photo in PEOPLE.items():
                people.add(name, [_photo(photo)])
            _log(f"enrolment: {settings.enrol_images} images")
            enrolment = enrol(client, settings.enrol_images)
            named = ["Eileen Collins", None, "Grace Hopper", "Tom Hanks"]
            frame = mosaic([_photo(PEOPLE[n] if n else STRANGER) for n in named])
            handles = {p: client.model(p, slots=settings.threads) for p in (WITH, WITHOUT)}
            for pipeline, handle in handles.items():  # (warm-up, and the frame checked)
                check_answer(handle.infer(frame, timeout_s=TIMEOUT_S), named, pipeline == WITH)
            rounds: list[dict[str, Any]] = []
            roots = [client.status().pid, os.getpid()]
            for r in range(settings.rounds):
                for pipeline in (WITH, WITHOUT) if r % 2 == 0 else (WITHOUT, WITH):
                    quiet: dict[str, float] = {}
                    if settings.seconds >= QUIET_FROM_S:
                        quiet = wait_quiet(settings.quiet_below, 2 * settings.seconds)
                    _log(f"round {r + 1}: {pipeline} {quiet}")
                    identity = pipeline == WITH

                    def check(answer: Any, identity: bool = identity) -> None:
                        check_answer(answer, named, identity)

                    sampler = TreeSampler(roots).start()
                    trial = _closed_loop(
                        handles[pipeline], frame, settings.threads, settings.seconds, check
                    )
                    used = sampler.stop()
                    others = max(0.0, used["machine_busy_cores"] - used["cpu_cores"])
                    rounds.append({"round": r + 1, "pipeline": pipeline, **trial, **quiet,
                                   "cores": used["cpu_cores"], "others_cores": others})  # fmt: skip
    return {"settings": asdict(settings), "enrolment": enrolment, "rounds": rounds,
            **summary(rounds)}  # fmt: skip


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Over each pipeline's rounds: frames per second, and frames per second of the cores the
    supervisor and this process used (the work a frame takes, which the machine's other work
    disturbs less than the rate); each, with the step over without."""
    rate, per_core = {}, {}
    for pipeline in (WITH, WITHOUT):
        mine = [t for t in rounds if t["pipeline"] == pipeline]
        frames = sum(t["frames"] for t in mine)
        rate[pipeline] = frames / sum(t["seconds"] for t in mine)
        per_core[pipeline] = frames / sum(t["cores"] * t["seconds"] for t in mine)
    return {
        "frames_per_s": rate,
        "with_over_without": rate[WITH] / rate[WITHOUT],
        "frames_per_core_s": per_core,
        "with_over_without_per_core": per_core[WITH] / per_core[WITHOUT],
    }


def markdown(raw: dict[str, Any]) -> str:
    """The part's lines of the galleries section."""
    s, e = raw["settings"], raw["enrolment"]
    rate = raw["frames_per_s"]
    lines = [
        "",
        f"The `faces` pipeline on a 640×640 frame of 4 faces (3 enrolled, 1 stranger; a gallery "
        f"of {s['identities']:,} random identities beside them), {s['threads']} requests in "
        f"flight closed loop from one client, {s['rounds']} rounds of {s['seconds']:g} s per "
        "pipeline, interleaved; every answer checked:",
        "",
        "| pipeline | frames/s | frames per core-second | each round: frames/s (its cores; the "
        "machine's other work, cores) |",
        "|---|--:|--:|---|",
    ]
    per_core = raw["frames_per_core_s"]
    for pipeline, label in ((WITHOUT, "`faces` without `identity`"), (WITH, "`faces` (identity)")):
        each = ", ".join(
            f"{t['frames_per_s']:.2f} ({t['cores']:.2f}; {t['others_cores']:.2f})"
            for t in raw["rounds"]
            if t["pipeline"] == pipeline
        )
        lines.append(f"| {label} | {rate[pipeline]:.2f} | {per_core[pipeline]:.2f} | {each} |")
    lines += [
        "",
        f"With the step ÷ without: {raw['with_over_without']:.3f} in frames/s, "
        f"{raw['with_over_without_per_core']:.3f} in frames per core-second. Enrolment through the "
        f'producer API (`client.gallery("people").add`, one single-face image at a time: the '
        f"pipeline run, the one face checked, the embedding written): {e['images']} images in "
        f"{e['seconds']:.2f} s, **{e['images_per_s']:.1f} images/s**.",
    ]
    return "\n".join(lines) + "\n"
