"""The ``pipelines:`` section of a config: a valid pipeline loads; each kind of mistake is
reported with its field path (``pipelines[faces].steps[embedding].model``), through
``load_config`` on a YAML file and through ``duomo check``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from duomo.supervisor.config import ConfigError, load_config
from duomo.supervisor.operators.cli import main
from tests.conftest import DEMO_CONFIG

MODELS: list[dict[str, Any]] = [
    {"name": "face", "task": "face_detection", "file": "face.onnx"},
    {"name": "face_embedding", "task": "face_embedding", "file": "sface.onnx"},
    {
        "name": "face_attributes",
        "task": "face_attributes",
        "files": {"age": "age.onnx", "gender": "gender.onnx"},
    },
    {"name": "classify", "task": "classification", "file": "classify.onnx"},
    {"name": "people", "task": "gallery", "file": "people.gallery"},  # made at its first load
]


def detect(**overrides: Any) -> dict[str, Any]:
    return {"name": "detect", "model": "face", **overrides}


def embedding(**overrides: Any) -> dict[str, Any]:
    each = {"step": "detect", "input": "landmarks"}
    return {"name": "embedding", "model": "face_embedding", "for_each": each, **overrides}


def attributes(**overrides: Any) -> dict[str, Any]:
    each = {"step": "detect", "input": "landmarks"}
    return {"name": "attributes", "model": "face_attributes", "for_each": each, **overrides}


def identity(**overrides: Any) -> dict[str, Any]:
    each = {"step": "embedding", "input": "result"}
    return {"name": "identity", "model": "people", "for_each": each, **overrides}


def faces(*steps: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"name": "faces", "steps": list(steps), **top}


def write(tmp_path: Path, pipelines: list[dict[str, Any]], models: Any = None) -> Path:
    for name in ("face.onnx", "sface.onnx", "age.onnx", "gender.onnx", "classify.onnx"):
        (tmp_path / name).write_bytes(b"")  # load_config checks they exist; nothing opens them
    path = tmp_path / "duomo.yaml"
    chosen = MODELS if models is None else models
    path.write_text(yaml.safe_dump({"version": 1, "models": chosen, "pipelines": pipelines}))
    return path


def problems(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.render()
    return info.value.problems


def paths(path: Path) -> list[str]:
    return [where for where, _ in problems(path)]


def test_the_demo_shaped_pipeline_loads_with_its_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            faces(
                detect(),
                embedding(reinfer_every=5, reinfer_area_ratio=1.5),
                attributes(for_each={"step": "detect", "input": "landmarks", "largest": 4}),
                {"name": "crop", "model": "classify", "for_each": {"step": "detect"}},
                tracker={},
            )
        ],
    )
    pipeline = load_config(path).config.pipelines[0]
    assert pipeline.name == "faces" and [s.name for s in pipeline.steps] == [
        "detect", "embedding", "attributes", "crop",
    ]  # fmt: skip
    assert pipeline.tracker is not None
    assert (pipeline.tracker.iou, pipeline.tracker.max_missed) == (0.3, 10)
    root, embed, attrs, crop = pipeline.steps
    assert root.for_each is None and not root.reuses
    assert embed.reuses and embed.reinfer_area_ratio == 1.5
    assert attrs.for_each is not None and attrs.for_each.largest == 4
    each = crop.for_each
    assert each is not None and each.input == "box"  # the default: a crop of the box
    assert (each.min_score, each.min_size, each.largest, each.margin, each.resize) == (
        0.0, 0.0, None, 0.0, None,
    )  # fmt: skip


def test_the_demo_config_declares_the_faces_pipeline() -> None:
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    (pipeline,) = [p for p in demo["pipelines"] if p["name"] == "faces"]
    assert [s["model"] for s in pipeline["steps"]] == [
        "face", "face_embedding", "face_attributes", "people",
    ]  # fmt: skip
    assert [s["for_each"]["input"] for s in pipeline["steps"][1:]] == [
        "landmarks", "landmarks", "result",
    ]  # fmt: skip
    (people,) = [m for m in demo["models"] if m["name"] == "people"]
    assert people["task"] == "gallery"


def test_a_step_over_an_earlier_steps_result(tmp_path: Path) -> None:
    path = write(tmp_path, [faces(detect(), embedding(), identity(reinfer_every=3), tracker={})])
    loaded = load_config(path)
    step = loaded.config.pipelines[0].steps[2]
    assert step.for_each is not None and (step.for_each.step, step.for_each.input) == (
        "embedding", "result",
    )  # fmt: skip
    assert step.reuses
    assert not (tmp_path / "people.gallery").exists()  # a check makes nothing; a load does


@pytest.mark.parametrize(
    ("steps", "where", "reason"),
    [
        (
            [detect(), embedding(), identity(for_each={"step": "detect", "input": "result"})],
            "pipelines[faces].steps[identity].for_each.input",
            "runs on the whole frame; input: result takes an earlier per-object step's result",
        ),
        (
            [detect(), embedding(), identity(for_each={"step": "detect"})],
            "pipelines[faces].steps[identity].for_each.input",
            "model 'people' takes an earlier step's result, not an image",
        ),
        (
            [detect(), embedding(), identity(for_each={"step": "embedding", "input": "box"})],
            "pipelines[faces].steps[identity].for_each.input",
            "a step over it takes its result (input: result)",
        ),
        (
            [
                detect(),
                embedding(),
                {"name": "again", "model": "classify",
                 "for_each": {"step": "embedding", "input": "result"}},
            ],
            "pipelines[faces].steps[again].for_each.input",
            "model 'classify' takes an image, not another step's result",
        ),
        (
            [
                detect(),
                embedding(),
                identity(for_each={"step": "embedding", "input": "result", "resize": [8, 8]}),
            ],
            "pipelines[faces].steps[identity].for_each.resize",
            "cuts no image; drop resize",
        ),
    ],
)  # fmt: skip
def test_what_a_step_over_a_result_may_not_be(
    tmp_path: Path, steps: list[dict[str, Any]], where: str, reason: str
) -> None:
    found = problems(write(tmp_path, [faces(*steps)]))
    assert [w for w, _ in found] == [where]
    assert reason in found[0][1]


def test_an_unknown_model(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [faces(detect(), embedding(model="sface"))]))
    assert [where for where, _ in found] == ["pipelines[faces].steps[embedding].model"]
    assert "unknown model 'sface'" in found[0][1] and "face_embedding" in found[0][1]


def test_an_unknown_first_step_model_too(tmp_path: Path) -> None:
    found = paths(write(tmp_path, [faces(detect(model="retinaface"), embedding())]))
    assert found == ["pipelines[faces].steps[detect].model"]


def test_an_unknown_step(tmp_path: Path) -> None:
    each = {"step": "detection", "input": "landmarks"}
    found = problems(write(tmp_path, [faces(detect(), embedding(for_each=each))]))
    assert found == [
        (
            "pipelines[faces].steps[embedding].for_each.step",
            "unknown step 'detection'; steps: ['detect', 'embedding']",
        )
    ]


def test_a_cycle(tmp_path: Path) -> None:
    a = {"name": "a", "model": "face_embedding", "for_each": {"step": "b"}}
    b = {"name": "b", "model": "face_attributes", "for_each": {"step": "a"}}
    found = problems(write(tmp_path, [faces(detect(), a, b)]))
    where = [w for w, _ in found]
    assert where == [
        "pipelines[faces].steps[a].for_each.step",
        "pipelines[faces].steps[b].for_each.step",
    ]
    assert "a cycle: a → b → a" in found[0][1] and "a cycle: b → a → b" in found[1][1]


def test_a_step_over_itself_is_a_cycle(tmp_path: Path) -> None:
    self_loop = {"name": "loop", "model": "face_embedding", "for_each": {"step": "loop"}}
    found = problems(write(tmp_path, [faces(detect(), self_loop)]))
    assert found == [("pipelines[faces].steps[loop].for_each.step", "a cycle: loop → loop")]


def test_for_each_over_a_result_without_objects(tmp_path: Path) -> None:
    whole = {"name": "classes", "model": "classify"}
    over = {"name": "embedding", "model": "face_embedding", "for_each": {"step": "classes"}}
    found = problems(write(tmp_path, [faces(whole, over)]))
    assert found == [
        (
            "pipelines[faces].steps[embedding].for_each.step",
            "step 'classes' (model 'classify') has no objects in its result to run for_each over",
        )
    ]


def test_for_each_over_a_later_step(tmp_path: Path) -> None:
    early = {"name": "early", "model": "face_embedding", "for_each": {"step": "late"}}
    found = problems(write(tmp_path, [faces(detect(), early, {"name": "late", "model": "face"})]))
    assert [w for w, _ in found] == ["pipelines[faces].steps[early].for_each.step"]
    assert "comes later" in found[0][1]


def test_landmarks_to_a_task_that_takes_none(tmp_path: Path) -> None:
    wrong = {
        "name": "classes",
        "model": "classify",
        "for_each": {"step": "detect", "input": "landmarks"},
    }
    found = problems(write(tmp_path, [faces(detect(), wrong)]))
    assert found == [
        (
            "pipelines[faces].steps[classes].for_each.input",
            "model 'classify' takes no landmarks; use input: box (a crop)",
        )
    ]


def test_an_input_that_is_no_choice(tmp_path: Path) -> None:
    each = {"step": "detect", "input": "mask"}
    found = problems(write(tmp_path, [faces(detect(), embedding(for_each=each))]))
    assert [w for w, _ in found] == ["pipelines[faces].steps[embedding].for_each.input"]
    assert "'box'" in found[0][1] and "'landmarks'" in found[0][1]


def test_the_first_step_with_for_each(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [faces(embedding(), detect())]))
    assert found == [
        ("pipelines[faces].steps[embedding].for_each", "the first step runs on the whole frame")
    ]


def test_reinfer_every_without_a_tracker(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [faces(detect(), embedding(reinfer_every=5))]))
    assert found == [
        (
            "pipelines[faces].steps[embedding].reinfer_every",
            "reusing results needs the pipeline's tracker (tracker: {})",
        )
    ]
    ratio = paths(write(tmp_path, [faces(detect(), embedding(reinfer_area_ratio=2.0))]))
    assert ratio == ["pipelines[faces].steps[embedding].reinfer_area_ratio"]


def test_reuse_on_a_whole_frame_step(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [faces(detect(reinfer_every=3), embedding(), tracker={})]))
    assert found == [
        (
            "pipelines[faces].steps[detect].reinfer_every",
            "only a for_each step's results are reused",
        )
    ]


def test_duplicate_step_names_are_told_apart_by_index(tmp_path: Path) -> None:
    found = paths(write(tmp_path, [faces(detect(), embedding(), attributes(name="embedding"))]))
    assert found == ["pipelines[faces].steps[1].name", "pipelines[faces].steps[2].name"]


def test_a_step_named_as_a_key_objects_have(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [faces(detect(), embedding(name="box"))]))
    assert [w for w, _ in found] == ["pipelines[faces].steps[box].name"]
    assert "a key objects already have" in found[0][1]


def test_duplicate_pipeline_names(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [faces(detect()), faces(detect(), embedding())]))
    assert found == [("pipelines[1].name", "duplicate pipeline name 'faces'")]


def test_a_pipeline_named_as_a_model(tmp_path: Path) -> None:
    found = problems(write(tmp_path, [{"name": "classify", "steps": [detect()]}]))
    assert found == [("pipelines[classify].name", "'classify' is already a model's name")]


def test_schema_errors_carry_labels_too(tmp_path: Path) -> None:
    typo = embedding(reinfer_evry=2)
    bad_filter = embedding(
        name="e2", for_each={"step": "detect", "input": "landmarks", "min_score": 1.5}
    )
    found = problems(write(tmp_path, [faces(detect(), typo, bad_filter, tracker={"iou": 2})]))
    where = {w: why for w, why in found}
    assert where["pipelines[faces].steps[embedding].reinfer_evry"] == (
        "unknown key (check the spelling)"
    )
    assert "pipelines[faces].steps[e2].for_each.min_score" in where
    assert "pipelines[faces].tracker.iou" in where
    assert len(found) == 3


def test_no_steps_and_a_bad_resize(tmp_path: Path) -> None:
    assert paths(write(tmp_path, [faces()])) == ["pipelines[faces].steps"]
    each = {"step": "detect", "resize": [0, 10]}
    crop = {"name": "crop", "model": "classify", "for_each": each}
    found = problems(write(tmp_path, [faces(detect(), crop)]))
    assert [w for w, _ in found] == ["pipelines[faces].steps[crop].for_each"]
    assert "resize" in found[0][1]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            faces(detect(), embedding(model="nope"), attributes(reinfer_every=2)),
            {"name": "classify", "steps": [embedding()]},
        ],
    )
    assert paths(path) == [
        "pipelines[faces].steps[embedding].model",
        "pipelines[faces].steps[attributes].reinfer_every",
        "pipelines[classify].name",
        "pipelines[classify].steps[embedding].for_each",
    ]


def test_duomo_check_prints_the_field_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(tmp_path, [faces(detect(), embedding(model="sface"))])
    assert main(["check", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: pipelines[faces].steps[embedding].model: unknown model 'sface'" in err
