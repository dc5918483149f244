"""Pipelines at run time: a request to a pipeline becomes requests to its steps' models.

Built by the engine (``supervisor.core.engine``) for each entry of the config's ``pipelines:``
(``supervisor.dataflow.pipeline_config``) and served under its name wherever a model is: an
attachment queues a slot's request with ``enqueue``, ``Engine.submit`` with ``submit``. A pipeline
owns no thread and no queue. ``enqueue`` queues a request per whole-frame step on its model, with
the pipeline request's priority, deadline and stream (its flow, weight and ``latest`` policy); when
a step with objects answers (on its model's worker thread), each object that passes a later step's
filters becomes a request to that step's model: its payload is a view of the frame already in
the slot, cropped to the object's box, or the frame with the object's landmarks (the worker's
image work: ``worker.executors.object_crops``; here, which objects: ``select``) — nothing goes
back to the producer between steps, and a second-stage model batches chips of many frames and
streams together in its own batcher. A step over a per-object step's result (``input: result``:
a gallery over the embedding) is queued, per object, when that result is there (made, or
reused from the track), with the result as its payload. No step waits for another: a callback
queues and returns, so no worker ever holds its device's compute gate while another step runs.

The answer, given when the last step's request is answered (on that thread): the first step's
result, each object of an iterated step with one key per step run on it — that step's result,
or ``{"error": {"code", "message"}}`` when that one request failed (the frame's answer is still
OK) — other whole-frame steps' results under their names at the top. A failed first step fails
the frame. Models are looked up by name for every request: a model that a reload replaces
serves the next request, and the old one's queue is handed over.

With a ``tracker``, a stream's objects carry a ``track_id``
(``supervisor.dataflow.object_tracker``), and a step with ``reinfer_every`` answers a tracked object
from its last result (marked ``"reused": true``) until that many frames passed or its box grew by
``reinfer_area_ratio``.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import structlog

from duomo.ipc.errors import DuomoError, InternalError, InvalidArgumentError, UnavailableError
from duomo.ipc.model_records import ModelStatus, error_count
from duomo.ipc.status_records import PipelineObjects, PipelineStatus, PipelineStepStatus
from duomo.supervisor.dataflow.object_tracker import IouTracker, Kept, Track, box_area
from duomo.supervisor.dataflow.pipeline_config import ForEach, PipelineConfig, StepConfig
from duomo.supervisor.dataflow.streams import StreamState
from duomo.worker.executors.base import SlotSpec
from duomo.worker.executors.object_crops import object_box, object_payload
from duomo.worker.model_spec import ModelState
from duomo.worker.request import Outcome, Request, submit_to
from duomo.worker.served_model import ServedModel
from duomo.worker.stats import Buckets, ModelStats

log = structlog.get_logger("duomo.pipeline")
OBJECT_BOUNDS = (0, 1, 2, 4, 8, 16, 32)  # objects per frame


class _Figures:
    """A step's counters: written under the pipeline's lock, read whole without it."""

    __slots__ = ("errors", "reused", "runs", "skipped")

    def __init__(self) -> None:
        self.runs = self.skipped = self.reused = self.errors = 0


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline shows where a model's spec is read (attachments, the ``models`` reply)."""

    name: str
    max_batch: int
    task: str = "pipeline"


class ServedPipeline:
    """One configured pipeline: its steps over the served models, its counts and trackers."""

    def __init__(
        self,
        config: PipelineConfig,
        models: Mapping[str, ServedModel],
        objects_keys: Mapping[str, str | None],
    ) -> None:
        """``models``: the engine's served models by name (read for every request);
        ``objects_keys``: each model's executor's ``objects`` (the key of its objects)."""
        self.config = config
        self.name = config.name
        self._models = models
        # its models' ``objects`` (a reload that changes them builds the pipeline anew)
        self.objects_keys = {s.model: objects_keys.get(s.model) for s in config.steps}
        self.steps = tuple(config.steps)
        self.root = self.steps[0]
        self._whole = tuple(s for s in self.steps if s.for_each is None)
        self._over: dict[str, tuple[StepConfig, ...]] = {
            s.name: tuple(c for c in self.steps if c.for_each and c.for_each.step == s.name)
            for s in self._whole
        }
        self._objects_key = {s.name: objects_keys.get(s.model) for s in self._whole}
        # per per-object step: the steps that take its result (``input: result``)
        self._after: dict[str, tuple[StepConfig, ...]] = {
            s.name: tuple(c for c in self.steps if c.for_each and c.for_each.step == s.name)
            for s in self.steps
            if s.for_each is not None
        }
        # the keys per-object steps add to an object, in step order
        self.nested = tuple(s.name for s in self.steps if s.for_each and not s.merge)
        self.stats = ModelStats()
        self.objects = Buckets(OBJECT_BOUNDS)
        self._figures = {s.name: _Figures() for s in self.steps}
        self._lock = threading.Lock()
        # per stream, per iterated step: its tracker (forgotten with the stream)
        self._trackers: weakref.WeakKeyDictionary[StreamState, dict[str, IouTracker]] = (
            weakref.WeakKeyDictionary()
        )

    # -- what a model shows --------------------------------------------------------------------

    @property
    def spec(self) -> PipelineSpec:
        root = self._models.get(self.root.model)
        return PipelineSpec(self.name, root.spec.max_batch if root is not None else 1)

    @property
    def state(self) -> ModelState:
        """READY when every step's model is; else the first step model's state that is not."""
        for step in self.steps:
            model = self._models.get(step.model)
            if model is None:
                return ModelState.UNLOADED
            if model.state is not ModelState.READY:
                return model.state
        return ModelState.READY

    def state_name(self) -> str:
        return self.state.value

    @property
    def reader(self) -> str:
        """The model whose idle workers may read its producers' connections
        (``supervisor.process.lending``): its first step's, which takes its requests first."""
        return self.root.model

    @property
    def layout_known(self) -> bool:
        root = self._models.get(self.root.model)
        return root is not None and root.layout_known

    def slot_spec(self) -> SlotSpec:
        """The first step's model's slot: its inputs; the answer is always JSON."""
        spec = self._root_model().slot_spec()
        if spec.result != "json":
            raise UnavailableError(
                f"pipeline {self.name!r}: its first step's model {self.root.model!r} answers "
                "tensors; a pipeline answers JSON"
            )
        return replace(spec, outputs=(), output_specs=())

    def payload_builder(self) -> Callable[[dict[str, np.ndarray], memoryview], Any]:
        return self._root_model().payload_builder()

    def model_names(self) -> list[str]:
        return list(dict.fromkeys(s.model for s in self.steps))

    def _root_model(self) -> ServedModel:
        root = self._models.get(self.root.model)
        if root is None:
            raise UnavailableError(f"pipeline {self.name!r}: model {self.root.model!r} is gone")
        return root

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self,
        payload: Any,
        on_done: Callable[[Outcome], object],
        priority: int | None = None,
        deadline_s: float | None = None,
    ) -> Request:
        """Queue one request (the in-process API: ``submit_to``); ``on_done`` gets the outcome.
        Without a ``priority``, its first step's model's."""
        if priority is None:
            priority = self._root_model().spec.priority
        return submit_to(self.enqueue, payload, on_done, priority, deadline_s)

    def enqueue(self, request: Request) -> None:
        """Queue ``request``'s whole-frame steps (from any thread; returns at once). Raises,
        with nothing queued, what the first step's model raises (not serving, queue full)."""
        request.on_counted = self._count
        run = _Run(self, request)
        try:
            run.start()
        except BaseException:
            request.on_counted = None
            raise

    def queue(self, step: StepConfig, request: Request) -> None:
        """Queue one of its requests on ``step``'s model, as it is served now (a reload may have
        replaced it); raises what the model raises."""
        model = self._models.get(step.model)
        if model is None:
            raise UnavailableError(f"model {step.model!r} is not served")
        model.enqueue(request)

    def _count(self, request: Request, outcome: Outcome) -> None:
        self.stats.record(outcome, time.monotonic() - request.enqueued_s)

    def tracker(self, request: Request, step: str) -> IouTracker | None:
        """The tracker of ``request``'s stream over ``step``'s objects (None: not a stream's
        frame, or no tracker configured)."""
        settings = self.config.tracker
        stream = request.flow
        if settings is None or not isinstance(stream, StreamState):
            return None
        with self._lock:
            trackers = self._trackers.setdefault(stream, {})
            found = trackers.get(step)
            if found is None:
                found = trackers[step] = IouTracker(settings.iou, settings.max_missed)
            return found

    def count(
        self, step: str, runs: int = 0, skipped: int = 0, reused: int = 0, errors: int = 0
    ) -> None:
        with self._lock:
            figures = self._figures[step]
            figures.runs += runs
            figures.skipped += skipped
            figures.reused += reused
            figures.errors += errors

    # -- what status shows ---------------------------------------------------------------------

    def step_counts(self) -> tuple[PipelineStepStatus, ...]:
        """Each step's counts since the pipeline was built (``status``, ``/metrics``): the
        requests it sent to its model, the frames on which it had no object to run on, the
        results it answered from a tracked object's last one, and its requests answered with an
        error."""
        counts = []
        for step in self.steps:
            f = self._figures[step.name]
            over = step.for_each.step if step.for_each else None
            counts.append(
                PipelineStepStatus(
                    step.name, step.model, over, f.runs, f.skipped, f.reused, f.errors
                )
            )
        return tuple(counts)

    def status(self) -> PipelineStatus:
        """Its status record: its state, requests (errors counted as a model's: failed and
        refused, SUPERSEDED in neither), latency, objects per frame and each step's counts."""
        figures = self.stats.snapshot()
        total = figures.latency.get("total", {})
        objects = self.objects.read()
        edges = [*(str(b) for b in OBJECT_BOUNDS), "+Inf"]
        return PipelineStatus(
            name=self.name,
            state=self.state_name(),
            requests=figures.requests,
            errors=error_count(figures.requests, figures.outcomes, figures.refused),
            latency_p50_ms=total.get("p50_ms"),
            latency_p99_ms=total.get("p99_ms"),
            objects=PipelineObjects(
                count=int(objects.total),
                frames=objects.cumulative[-1],
                buckets=tuple(zip(edges, objects.cumulative, strict=True)),
            ),
            steps=self.step_counts(),
        )

    def model_status(self, root: ModelStatus) -> ModelStatus:
        """What it shows where one model's status is read (``status`` of its name alone: the
        gateway's statistics): its first step's model's record ``root`` with the pipeline's own
        state and request figures (no batch sizes: it runs no batch of its own)."""
        figures = self.stats.snapshot()
        return replace(
            root,
            state=self.state_name(),
            requests=figures.requests,
            outcomes=figures.outcomes,
            refused=figures.refused,
            latency=figures.latency,
            batch_sizes={},
            totals=figures.totals,
        )


def _unset(outcome: Outcome) -> None:
    """A request's callback until the real one, which needs the request, is set."""


def _error_entry(error: DuomoError) -> dict[str, Any]:
    return {"error": {"code": error.code.name, "message": error.message}}


def _score(item: Mapping[str, Any]) -> float:
    score = item.get("score", 1.0)
    return float(score) if isinstance(score, (int, float)) else 1.0


def select(objects: Sequence[Mapping[str, Any]], each: ForEach) -> list[int]:
    """The indices of the objects a ``for_each`` runs on, in their order: score and size at
    least the minimum, then the ``largest`` N by box area."""
    chosen = []
    for i, item in enumerate(objects):
        if _score(item) < each.min_score:
            continue
        if each.min_size > 0:
            box = object_box(item)
            if box is None or min(box[2] - box[0], box[3] - box[1]) < each.min_size:
                continue
        chosen.append(i)
    if each.largest is not None and len(chosen) > each.largest:

        def area(i: int) -> float:
            box = object_box(objects[i])
            return 0.0 if box is None else max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])

        chosen = sorted(sorted(chosen, key=area, reverse=True)[: each.largest])
    return chosen


class _Place(NamedTuple):
    """Where an object is in its stream: its tracker and track (None: not tracked) and the
    tracker's frame number."""

    tracker: IouTracker | None
    track: Track | None
    frame_no: int


class _Run:
    """One pipeline request in flight: the requests it is waiting for, and its answer."""

    __slots__ = (
        "abandoned", "dropped", "error", "extra", "first", "lists", "lock", "outstanding",
        "pipeline", "request", "started",
    )  # fmt: skip

    def __init__(self, pipeline: ServedPipeline, request: Request) -> None:
        self.pipeline = pipeline
        self.request = request
        self.lock = threading.Lock()
        self.outstanding = 0  # requests queued and not yet answered
        self.first: Outcome | None = None  # the first step's
        self.extra: dict[str, Any] = {}  # other whole-frame steps' results, by name
        self.error: DuomoError | None = None  # the frame's: its first step failed
        self.abandoned: list[Request] = []  # answered while their batch still runs
        self.lists: list[list[Any]] = []  # the objects lists fanned out over
        self.dropped: set[int] = set()  # ids of objects a ``merge`` step's null result drops
        self.started = time.monotonic()

    def start(self) -> None:
        """Queue every whole-frame step. The first step's refusal is raised (nothing queued);
        another's is its result's error."""
        pipeline, request = self.pipeline, self.request
        whole = pipeline._whole
        self.outstanding = len(whole)
        for index, step in enumerate(whole):
            sub = Request(
                request.payload,
                _unset,
                request.priority,
                request.deadline_s,
                flow=request.flow,
                weight=request.weight,
                supersedes=request.supersedes and index == 0,
            )
            sub.on_done = functools.partial(self._frame_done, step, sub)
            try:
                pipeline.queue(step, sub)
            except DuomoError as err:
                if index == 0:
                    raise
                pipeline.count(step.name, errors=1)
                sub.complete(error=err)
                continue
            pipeline.count(step.name, runs=1)

    def _frame_done(self, step: StepConfig, sub: Request, outcome: Outcome) -> None:
        """A whole-frame step answered (on its model's thread): keep its result and queue the
        steps over its objects."""
        pipeline = self.pipeline
        if outcome.abandoned:
            with self.lock:
                self.abandoned.append(sub)
        if step is pipeline.root:
            self.first = outcome
            timings = self.request.timings
            timings.queue_s = outcome.timings.queue_s
            timings.preprocess_s = outcome.timings.preprocess_s
            timings.infer_s = outcome.timings.infer_s
            if outcome.error is not None:
                self.error = outcome.error
        elif outcome.error is not None:
            pipeline.count(step.name, errors=1)
            self.extra[step.name] = _error_entry(outcome.error)
        else:
            self.extra[step.name] = outcome.result
        if outcome.error is None and not self.request.cancelled and self.error is None:
            try:
                self._fan_out(step, outcome.result)
            except DuomoError as err:
                self.error = err
            except Exception:  # a bug must still answer the frame
                log.exception("pipeline fan-out failed", pipeline=pipeline.name, step=step.name)
                self.error = InternalError(f"pipeline {pipeline.name!r}: step {step.name!r} failed")
        self._settle()

    def _fan_out(self, step: StepConfig, result: Any) -> None:
        pipeline = self.pipeline
        children = pipeline._over.get(step.name, ())
        key = pipeline._objects_key.get(step.name)
        if not children or key is None:
            return
        objects = result.get(key) if isinstance(result, dict) else None
        if not isinstance(objects, list):
            raise InvalidArgumentError(f"step {step.name!r} answered no {key!r} list")
        if step is pipeline.root:
            pipeline.objects.observe(len(objects))
        tracker = pipeline.tracker(self.request, step.name)
        frame_no, tracks = 0, None
        if tracker is not None:
            boxes = [object_box(o) or (0.0, 0.0, 0.0, 0.0) for o in objects]
            frame_no, tracks = tracker.update(boxes)
            for item, track in zip(objects, tracks):
                item["track_id"] = track.id
        self.lists.append(objects)
        frame = self.request.payload
        for child in children:
            assert child.for_each is not None
            chosen = select(objects, child.for_each)
            if not chosen:
                pipeline.count(child.name, skipped=1)
                continue
            for i in chosen:
                place = _Place(tracker, tracks[i] if tracks else None, frame_no)
                self._run_on(child, objects[i], frame, place)

    def _run_after(
        self, step: StepConfig, item: dict[str, Any], result: Any, place: _Place
    ) -> None:
        """``step`` answered ``item`` with ``result``: queue the steps that take that result."""
        for child in self.pipeline._after.get(step.name, ()):
            assert child.for_each is not None
            if self.request.cancelled or self.error is not None:
                return
            if isinstance(result, dict) and select([item], child.for_each):
                self._run_on(child, item, result, place)

    def _run_on(self, step: StepConfig, item: dict[str, Any], source: Any, place: _Place) -> None:
        """Queue ``step`` on one object (or answer it from the object's track); ``source``: the
        frame, or for a step over another per-object step (``input: result``) that one's result
        on the object."""
        pipeline = self.pipeline
        assert step.for_each is not None
        tracker, track, frame_no = place
        if track is not None and tracker is not None and step.reuses:
            with tracker.lock:
                kept = track.kept.get(step.name)
                fresh = kept is not None and frame_no - kept.frame < step.reinfer_every
                ratio = step.reinfer_area_ratio
                if fresh and ratio is not None and kept is not None:
                    fresh = track.area <= kept.area * ratio
            if fresh and kept is not None:
                self._join(step, item, {**kept.result, "reused": True})
                pipeline.count(step.name, reused=1)
                self._run_after(step, item, kept.result, place)
                return
        try:
            if step.for_each.input == "result":
                payload = source  # read, never changed: it is also the object's sub-result
            else:
                payload = object_payload(source, item, step.for_each)
        except DuomoError as err:
            item[step.name] = _error_entry(err)
            pipeline.count(step.name, errors=1)
            return
        keep = None
        if track is not None and tracker is not None and step.reuses:
            keep = (tracker, track, frame_no, box_area(track.box))
        request = self.request
        sub = Request(
            payload, _unset, request.priority, request.deadline_s,
            flow=request.flow, weight=request.weight,
        )  # fmt: skip
        sub.on_done = functools.partial(self._object_done, step, item, keep, place, sub)
        with self.lock:
            self.outstanding += 1
        try:
            pipeline.queue(step, sub)
        except DuomoError as err:
            sub.complete(error=err)
        pipeline.count(step.name, runs=1)

    def _object_done(
        self,
        step: StepConfig,
        item: dict[str, Any],
        keep: tuple[IouTracker, Track, int, float] | None,
        place: _Place,
        sub: Request,
        outcome: Outcome,
    ) -> None:
        """One object's request was answered: its result (or error) joins the object, and the
        steps over that result are queued."""
        if outcome.error is not None:
            item[step.name] = _error_entry(outcome.error)
            self.pipeline.count(step.name, errors=1)
        else:
            self._join(step, item, outcome.result)
            if keep is not None and isinstance(outcome.result, dict):
                tracker, track, frame_no, area = keep
                with tracker.lock:
                    kept = track.kept.get(step.name)
                    if kept is None or kept.frame <= frame_no:
                        track.kept[step.name] = Kept(outcome.result, frame_no, area)
            try:
                self._run_after(step, item, outcome.result, place)
            except Exception:  # a bug must still answer the frame
                log.exception("pipeline step failed", pipeline=self.pipeline.name, step=step.name)
                self.error = InternalError(
                    f"pipeline {self.pipeline.name!r}: the steps after {step.name!r} failed"
                )
        if outcome.abandoned:
            with self.lock:
                self.abandoned.append(sub)
        self._settle()

    def _join(self, step: StepConfig, item: dict[str, Any], result: Any) -> None:
        """``step``'s result for ``item``: under the step's name, or merged into it."""
        if not step.merge:
            item[step.name] = result
        elif result is None:
            with self.lock:
                self.dropped.add(id(item))
        elif isinstance(result, dict):
            item.update(result)
        else:
            item[step.name] = result

    def _settle(self) -> None:
        """One awaited request was answered; the last one answers the pipeline request."""
        with self.lock:
            self.outstanding -= 1
            if self.outstanding:
                return
        request, first = self.request, self.first
        timings = request.timings
        total = time.monotonic() - self.started
        timings.postprocess_s = max(
            0.0, total - timings.queue_s - timings.preprocess_s - timings.infer_s
        )
        if first is None or self.error is not None:
            error = self.error or InternalError(f"pipeline {self.pipeline.name!r}: no answer")
            self._answer(error=error)
            return
        if self.dropped:
            for objects in self.lists:
                objects[:] = [o for o in objects if id(o) not in self.dropped]
        order = self.pipeline.nested
        for objects in self.lists:  # sub-results in step order, not in the order they came
            for item in objects:
                for name in order:
                    if name in item:
                        item[name] = item.pop(name)
        result = first.result
        if self.extra:
            result = {**result, **self.extra} if isinstance(result, dict) else result
        self._answer(result=result, batch_size=first.batch_size)

    def _answer(
        self, result: Any = None, error: DuomoError | None = None, batch_size: int = 0
    ) -> None:
        request = self.request
        held = self.abandoned
        if held:
            request.abandoned = True  # its slot stays reserved until their batches end
        request.complete(result=result, error=error, batch_size=batch_size)
        if held:
            left = [len(held)]
            lock = threading.Lock()

            def over() -> None:
                with lock:
                    left[0] -= 1
                    done = left[0] == 0
                if done:
                    request.batch_over()

            for sub in held:
                if not sub.hold_until_batch_over(over):
                    over()
