"""The ``pipelines:`` section of a config: named graphs of steps over the declared models.

Parsed as part of ``DuomoConfig`` (``supervisor.config``), which calls ``pipeline_problems`` once
the models are resolved: every reference is checked there (an unknown model or step, a cycle, a
``for_each`` over a result that has no objects, an input the step's task cannot take), each
problem with its field path (``pipelines[faces].steps[embedding].model``). What a valid
pipeline does at run time is ``supervisor.dataflow.pipelines``'.

    pipelines:
      - name: faces
        tracker: {iou: 0.3, max_missed: 10}     # optional: objects of a stream's frames get ids
        steps:
          - {name: detect, model: face}          # the first step runs on the whole frame
          - name: embedding
            model: face_embedding
            for_each: {step: detect, input: landmarks, min_score: 0.5, largest: 8}
            reinfer_every: 5                     # reuse a tracked face's embedding 5 frames
          - name: identity
            model: people                        # a gallery: the embedding in, a name out
            for_each: {step: embedding, input: result}
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from duomo.worker.config_model import NAME_PATTERN, StrictModel

# keys an object of a result already has: a step named so would hide them
RESERVED_STEP_NAMES = frozenset({"box", "score", "landmarks", "track_id", "error", "reused"})


class ForEach(StrictModel):
    """Run a step once per object of an earlier step's result: which objects, and what of each
    the request is given (``box``: the frame cropped to the object's box, widened by ``margin``
    of its size on each side and resized to ``resize`` [width, height] if set; ``landmarks``:
    the frame and the object's landmarks, for a task that aligns them itself; ``quad``: the
    frame and the object's box as four corner points, for a task that warps the quadrilateral
    itself (a text line); ``result``: the result of ``step``, itself an earlier per-object step,
    on the object — the step runs on each object that one answered (an embedding, for a
    gallery to name))."""

    step: str
    input: Literal["box", "landmarks", "quad", "result"] = "box"
    min_score: float = Field(default=0.0, ge=0.0, le=1.0)
    min_size: float = Field(default=0.0, ge=0.0)  # px, the box's shorter side
    largest: int | None = Field(default=None, ge=1, le=1024)  # the N largest boxes
    margin: float = Field(default=0.0, ge=0.0, le=4.0)
    resize: tuple[int, int] | None = None

    def model_post_init(self, _context: object) -> None:
        if self.resize is not None and not all(1 <= side <= 4096 for side in self.resize):
            raise ValueError("resize must be [width, height], each 1..4096")


class StepConfig(StrictModel):
    """One step: a declared model, run on the whole frame or ``for_each`` object of an earlier
    step. ``reinfer_every`` > 1 reuses a tracked object's last result of this step for that many
    frames of its stream, or until its box's area grew by ``reinfer_area_ratio``. ``merge``:
    its result's keys join the object itself instead of a key named after the step, and a null
    result drops the object from the answer (a text line read as nothing)."""

    name: str = Field(pattern=NAME_PATTERN)
    model: str
    for_each: ForEach | None = None
    reinfer_every: int = Field(default=1, ge=1, le=100_000)
    reinfer_area_ratio: float | None = Field(default=None, gt=1.0, le=100.0)
    merge: bool = False

    @property
    def reuses(self) -> bool:
        return self.reinfer_every > 1


class TrackerConfig(StrictModel):
    """A stream's objects are matched to the last frame's by IoU (greedy, best first): a match
    of at least ``iou`` keeps its id; an id unseen for ``max_missed`` frames is forgotten."""

    iou: float = Field(default=0.3, gt=0.0, lt=1.0)
    max_missed: int = Field(default=10, ge=0, le=10_000)


class PipelineConfig(StrictModel):
    """A named pipeline, served under its name as a model is."""

    name: str = Field(pattern=NAME_PATTERN)
    steps: list[StepConfig] = Field(min_length=1, max_length=32)
    tracker: TrackerConfig | None = None


def entries_over(entries: object, models: Collection[str]) -> list[Any]:
    """The raw ``pipelines:`` entries of a config file whose steps all run on ``models``: what
    a copy of the file restricted to those models keeps (the benchmark's, the tests')."""
    if not isinstance(entries, list):
        return []
    return [
        entry
        for entry in entries
        if isinstance(entry, dict)
        and all(isinstance(s, dict) and s.get("model") in models for s in entry.get("steps", []))
    ]


def labels(names: Sequence[str]) -> list[str]:
    """How each entry (a pipeline, a step) is named in a field path: its name, or its index
    where names repeat (as a model's: ``config._model_labels``)."""
    return [n if names.count(n) == 1 and not n.isdigit() else str(i) for i, n in enumerate(names)]


def pipeline_problems(
    pipelines: Sequence[PipelineConfig], tasks: Mapping[str, type | None]
) -> list[tuple[str, str]]:
    """(field path, reason) for every reference in ``pipelines`` that does not hold; ``tasks``:
    each declared model's executor class (its ``objects`` and ``object_inputs``), None for a
    model whose own entry is invalid (reported there)."""
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    for label, pipeline in zip(labels([p.name for p in pipelines]), pipelines):
        where = f"pipelines[{label}]"
        if pipeline.name in tasks:
            problems.append((f"{where}.name", f"{pipeline.name!r} is already a model's name"))
        elif pipeline.name in seen:
            problems.append((f"{where}.name", f"duplicate pipeline name {pipeline.name!r}"))
        seen.add(pipeline.name)
        problems.extend(_step_problems(where, pipeline, tasks))
    return problems


def _step_problems(
    where: str, pipeline: PipelineConfig, tasks: Mapping[str, type | None]
) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    steps = {s.name: s for s in pipeline.steps}
    order = [s.name for s in pipeline.steps]
    for label, step in zip(labels([s.name for s in pipeline.steps]), pipeline.steps):
        at = f"{where}.steps[{label}]"
        if order.count(step.name) > 1:
            problems.append((f"{at}.name", f"duplicate step name {step.name!r}"))
        if step.name in RESERVED_STEP_NAMES:
            problems.append(
                (f"{at}.name", f"{step.name!r} is a key objects already have; name it otherwise")
            )
        if step.model not in tasks:
            problems.append(
                (f"{at}.model", f"unknown model {step.model!r}; declared: {sorted(tasks)}")
            )
        if step.reuses or step.reinfer_area_ratio is not None:
            if pipeline.tracker is None:
                field = "reinfer_every" if step.reuses else "reinfer_area_ratio"
                problems.append(
                    (f"{at}.{field}", "reusing results needs the pipeline's tracker (tracker: {})")
                )
            elif step.for_each is None:
                problems.append(
                    (f"{at}.reinfer_every", "only a for_each step's results are reused")
                )
        if step.merge and step.for_each is None:
            problems.append((f"{at}.merge", "only a for_each step's results merge into objects"))
        each = step.for_each
        if each is None:
            continue  # a whole-frame step; past the first, its result joins the answer by name
        if step is pipeline.steps[0]:
            problems.append((f"{at}.for_each", "the first step runs on the whole frame"))
            continue
        problems.extend(_for_each_problems(f"{at}.for_each", step, steps, order, tasks))
    return problems


def _for_each_problems(
    at: str,
    step: StepConfig,
    steps: Mapping[str, StepConfig],
    order: list[str],
    tasks: Mapping[str, type | None],
) -> list[tuple[str, str]]:
    each = step.for_each
    assert each is not None
    source = steps.get(each.step)
    if source is None:
        return [(f"{at}.step", f"unknown step {each.step!r}; steps: {order}")]
    cycle = _cycle(step.name, steps)
    if cycle:
        return [(f"{at}.step", f"a cycle: {' → '.join(cycle)}")]
    if order.index(each.step) > order.index(step.name):
        return [(f"{at}.step", f"step {each.step!r} comes later; name an earlier step")]
    if source.for_each is not None:
        return _result_problems(at, step, tasks)
    if each.input == "result":
        return [
            (
                f"{at}.input",
                f"step {each.step!r} runs on the whole frame; input: result takes an earlier "
                "per-object step's result (name that step)",
            )
        ]
    problems = []
    task = tasks.get(source.model)
    if task is not None and getattr(task, "objects", None) is None:
        problems.append(
            (
                f"{at}.step",
                f"step {each.step!r} (model {source.model!r}) has no objects in its result "
                "to run for_each over",
            )
        )
    mine = tasks.get(step.model)
    takes: frozenset[str] = getattr(mine, "object_inputs", frozenset())
    if mine is not None and takes == {"result"}:
        problems.append(
            (
                f"{at}.input",
                f"model {step.model!r} takes an earlier step's result, not an image: name a "
                "per-object step with input: result",
            )
        )
    elif each.input != "box" and mine is not None and each.input not in takes:
        problems.append(
            (
                f"{at}.input",
                f"model {step.model!r} takes no {each.input}; use input: box (a crop)",
            )
        )
    return problems


def _result_problems(
    at: str, step: StepConfig, tasks: Mapping[str, type | None]
) -> list[tuple[str, str]]:
    """A step over an earlier per-object step: it takes that step's result, no image cut."""
    each = step.for_each
    assert each is not None
    if each.input != "result":
        return [
            (
                f"{at}.input",
                f"step {each.step!r} runs per object; a step over it takes its result "
                "(input: result)",
            )
        ]
    problems = [
        (f"{at}.{field}", f"a step over another step's result cuts no image; drop {field}")
        for field in ("margin", "resize", "largest")
        if field in each.model_fields_set
    ]
    mine = tasks.get(step.model)
    takes: frozenset[str] = getattr(mine, "object_inputs", frozenset())
    if mine is not None and "result" not in takes:
        problems.append(
            (f"{at}.input", f"model {step.model!r} takes an image, not another step's result")
        )
    return problems


def _cycle(start: str, steps: Mapping[str, StepConfig]) -> list[str]:
    """The steps from ``start`` along ``for_each`` back to ``start``, if they loop."""
    path = [start]
    current = steps[start]
    while current.for_each is not None and current.for_each.step in steps:
        following = current.for_each.step
        path.append(following)
        if following == start:
            return path
        if path.count(following) > 1:
            return []  # a loop that does not pass through ``start``: reported at its own steps
        current = steps[following]
    return []
