"""The ``duomo_pipeline_*`` series of ``supervisor.operators.metrics``, scraped from a collector
over a fake engine whose one pipeline has the attributes
``supervisor.dataflow.pipelines.ServedPipeline`` gives the scrape (``stats``, ``objects``,
``step_counts``): every series present at zero before the first request, with every code, and each
count where its family says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from duomo.ipc.errors import ErrorCode, InternalError, InvalidArgumentError
from duomo.ipc.status_records import PipelineStepStatus
from duomo.supervisor.operators.metrics import DuomoCollector, ProcessView
from duomo.worker.request import Outcome
from duomo.worker.stats import Buckets, ModelStats

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def step(
    name: str,
    model: str,
    for_each: str | None,
    runs: int = 0,
    skipped: int = 0,
    reused: int = 0,
    errors: int = 0,
) -> PipelineStepStatus:
    """A step's counts, the record ``ServedPipeline.step_counts`` gives."""
    return PipelineStepStatus(name, model, for_each, runs, skipped, reused, errors)  # fmt: skip


@dataclass
class FakePipeline:
    name: str
    steps: list[PipelineStepStatus]
    stats: ModelStats = field(default_factory=ModelStats)
    objects: Buckets = field(default_factory=lambda: Buckets((0, 1, 2, 4, 8, 16, 32)))

    def step_counts(self) -> list[PipelineStepStatus]:
        return list(self.steps)


@dataclass
class FakeEngine:
    pipelines: dict[str, FakePipeline]
    models: dict[str, Any] = field(default_factory=dict)

    def device_memory(self) -> dict[int, Any]:
        return {}


class NoStreams:
    def snapshot(self) -> list[dict[str, Any]]:
        return []


def faces() -> FakePipeline:
    return FakePipeline(
        "faces",
        [step("detect", "face", None), step("embedding", "face_embedding", "detect")],
    )


def scrape(*pipelines: FakePipeline) -> Samples:
    engine = FakeEngine({p.name: p for p in pipelines})
    collector = DuomoCollector(
        cast(Any, engine), lambda: ProcessView(0, 0, 0), cast(Any, NoStreams())
    )
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_every_series_of_a_pipeline_is_there_at_zero_before_its_first_request() -> None:
    samples = scrape(faces())
    for code in ErrorCode:
        assert value(samples, "duomo_pipeline_requests_total", pipeline="faces",
                     code=code.name) == 0  # fmt: skip
    for histogram in ("duomo_pipeline_latency_seconds", "duomo_pipeline_objects_per_frame"):
        assert value(samples, f"{histogram}_count", pipeline="faces") == 0
        assert value(samples, f"{histogram}_bucket", pipeline="faces", le="+Inf") == 0
    for kind in ("skipped", "reused", "errors"):
        for step in ("detect", "embedding"):
            key = {"pipeline": "faces", "step": step}
            assert value(samples, f"duomo_pipeline_step_{kind}_total", **key) == 0
    runs = "duomo_pipeline_step_runs_total"
    assert value(samples, runs, pipeline="faces", step="detect", model="face") == 0
    assert value(samples, runs, pipeline="faces", step="embedding", model="face_embedding") == 0


def test_each_count_lands_in_its_series() -> None:
    pipeline = faces()
    for seconds in (0.02, 0.04, 0.3):
        pipeline.stats.record(Outcome(result={"faces": []}), seconds)
    pipeline.stats.record(Outcome(error=InternalError("detector failed")), 0.01)
    pipeline.stats.record_refusal(InvalidArgumentError("bad header").code)
    for objects in (0, 3, 3, 40):
        pipeline.objects.observe(objects)
    pipeline.steps = [
        step("detect", "face", None, runs=5),
        step("embedding", "face_embedding", "detect", runs=46, skipped=1, reused=7, errors=2),
    ]
    samples = scrape(pipeline)
    requests = {
        code.name: value(samples, "duomo_pipeline_requests_total", pipeline="faces",
                         code=code.name)
        for code in ErrorCode
    }  # fmt: skip
    assert {code: n for code, n in requests.items() if n} == {
        "OK": 3, "INTERNAL": 1, "INVALID_ARGUMENT": 1,
    }  # fmt: skip
    latency = {"pipeline": "faces"}
    assert value(samples, "duomo_pipeline_latency_seconds_count", **latency) == 3  # successes
    assert value(samples, "duomo_pipeline_latency_seconds_sum", **latency) == pytest.approx(0.36)
    assert value(samples, "duomo_pipeline_latency_seconds_bucket", **latency, le="0.05") == 2
    per_frame = "duomo_pipeline_objects_per_frame"
    assert value(samples, f"{per_frame}_count", pipeline="faces") == 4
    assert value(samples, f"{per_frame}_sum", pipeline="faces") == 46
    buckets = {le: value(samples, f"{per_frame}_bucket", pipeline="faces", le=le)
               for le in ("0.0", "2.0", "4.0", "32.0", "+Inf")}  # fmt: skip
    assert buckets == {"0.0": 1, "2.0": 1, "4.0": 3, "32.0": 3, "+Inf": 4}
    embedding = {"pipeline": "faces", "step": "embedding"}
    assert value(samples, "duomo_pipeline_step_runs_total", **embedding,
                 model="face_embedding") == 46  # fmt: skip
    assert value(samples, "duomo_pipeline_step_skipped_total", **embedding) == 1
    assert value(samples, "duomo_pipeline_step_reused_total", **embedding) == 7
    assert value(samples, "duomo_pipeline_step_errors_total", **embedding) == 2
    detect = {"pipeline": "faces", "step": "detect"}
    assert value(samples, "duomo_pipeline_step_runs_total", **detect, model="face") == 5


def test_no_pipeline_no_samples() -> None:
    assert not any(name.startswith("duomo_pipeline_") for name, _ in scrape())
