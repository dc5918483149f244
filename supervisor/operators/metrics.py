"""The supervisor's Prometheus series: what ``/metrics`` shows, read at scrape time from the
numbers the workers, the engine and the reactor already keep.

Served by ``supervisor.operators.metrics_http`` (``metrics: {http: HOST:PORT}``), rendered by
``prometheus-client``. Names follow Triton's ``nv_inference_*`` with the ``duomo_`` prefix, so
dashboards and alerts written for Triton translate. Every declared model has all its series from
the moment the supervisor starts, at zero, with every known label value (each error code as a
failure ``reason``, each state, each restart ``cause``), so ``rate()`` and alerts work before
the first failure. A scrape takes no lock a worker waits for: ``ModelStats.counters`` and
``Buckets.read`` copy without one. A model rebuilt by a reload starts its counters again from
zero, which Prometheus reads as a counter reset. SUPERSEDED (a ``latest`` stream's frame that a
newer one replaced) is an outcome, never a failure: it has its own counter
(``duomo_inference_request_superseded_total``) and is no ``reason`` of the failures, so an error
ratio over the failures and successes counts only errors. Each model's capacity against its
streams (``worker.stream_load``, read through ``worker.model_status.stream_capacity``) is a set
of gauges: over or not, the frames per second offered and served, and the age bound.

Streams (``duomo_stream_*``, from ``supervisor.dataflow.streams``' registry: the
``StreamStatus`` records ``status`` shows) have their series from the moment they open, per
``stream`` and the ``model``s it feeds; an ended stream keeps them (its state ``ended``) until the
registry forgets it to open another past ``limits.max_streams``, which bounds the ``stream``
label's values. A stream opened again under its name carries its counts on and drops the series
of a model it no longer feeds. Its answer-age quantiles appear with its first answer in the last
60 s.

Managed sources have ``duomo_source_*`` (``supervisor.operators.source_metrics``), sinks
``duomo_sink_*`` (``supervisor.operators.sink_metrics``).

Pipelines (``duomo_pipeline_*``, from ``engine.pipelines``) have their series from the start,
at zero, like the models: a request counter by ``code`` (every ``ErrorCode`` name, ``OK``
among them), the latency of its successful requests and its objects per frame as histograms,
and per ``step`` its runs (labelled with the step's ``model`` too), skipped frames, reused
sub-results and failed sub-results (its ``PipelineStepStatus`` records, as ``status`` shows
them). Read without a lock, as the models' are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from duomo.ipc.errors import ErrorCode
from duomo.ipc.sink_records import SinkStatus
from duomo.ipc.source_records import SourceStatus
from duomo.supervisor.core.engine import Engine
from duomo.supervisor.dataflow.streams import STATES, StreamRegistry
from duomo.supervisor.operators.sink_metrics import sink_families
from duomo.supervisor.operators.source_metrics import source_families
from duomo.worker.galleries.session import GallerySession
from duomo.worker.model_spec import ModelState
from duomo.worker.model_status import stream_capacity
from duomo.worker.stats import TOTALS, HistogramState

# every error code but OK and SUPERSEDED, which are outcomes, not failures
FAILURE_REASONS = tuple(
    code.name for code in ErrorCode if code not in (ErrorCode.OK, ErrorCode.SUPERSEDED)
)
SUPERSEDED = ErrorCode.SUPERSEDED.name.lower()  # its outcome key in ``ModelStats``
CODES = tuple(code.name for code in ErrorCode)  # a pipeline's requests by outcome, OK included
# Triton's cumulative stage durations: (metric suffix, ``ModelStats`` total kind)
STAGE_DURATIONS = (
    ("request", "success"),
    ("queue", "queue"),
    ("compute_input", "compute_input"),
    ("compute_infer", "compute_infer"),
    ("compute_output", "compute_output"),
)
assert {kind for _, kind in STAGE_DURATIONS} <= set(TOTALS)
STREAM_BOUND = " At most limits.max_streams streams, live or ended, have series."


@dataclass(frozen=True)
class ProcessView:
    """What the supervisor itself contributes to a scrape."""

    clients_attached: int  # authenticated connections
    gateway_workers_running: int
    resident_bytes: int


def _histogram(
    family: HistogramMetricFamily,
    labels: list[str],
    bounds: Sequence[float],
    state: HistogramState,
) -> None:
    edges = [floatToGoString(b) for b in bounds] + ["+Inf"]
    family.add_metric(labels, list(zip(edges, state.cumulative, strict=True)), state.total)


class DuomoCollector(Collector):
    """Builds every ``duomo_*`` family on each scrape (``collect``)."""

    def __init__(
        self,
        engine: Engine,
        process: Callable[[], ProcessView],
        streams: StreamRegistry,
        sources: Callable[[], Sequence[SourceStatus]] = tuple,
        sinks: Callable[[], Sequence[SinkStatus]] = tuple,
    ) -> None:
        self.engine = engine
        self.process = process
        self.streams = streams
        self.sources = sources
        self.sinks = sinks

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        yield from self._devices()
        yield from self._streams()
        yield from self._pipelines()
        yield from source_families(self.sources())
        yield from sink_families(self.sinks())
        view = self.process()
        yield GaugeMetricFamily(
            "duomo_clients_attached", "Authenticated client connections (producers, gateway "
            "workers, CLI).", value=view.clients_attached,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "duomo_gateway_workers_running", "KServe v2 gateway worker processes running.",
            value=view.gateway_workers_running,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "duomo_process_resident_bytes", "The supervisor's resident memory.",
            value=view.resident_bytes,
        )  # fmt: skip

    def _models(self) -> Iterator[Metric]:
        m = ["model"]

        def counter(name: str, doc: str, labels: Sequence[str] = m) -> CounterMetricFamily:
            return CounterMetricFamily(f"duomo_{name}", doc, labels=list(labels))

        success = counter("inference_request_success", "Requests answered successfully.")
        failure = counter(
            "inference_request_failure",
            "Requests answered with an error or refused before they were queued, by its code "
            "(SUPERSEDED is no failure: duomo_inference_request_superseded_total).",
            [*m, "reason"],
        )  # fmt: skip
        superseded = counter(
            "inference_request_superseded",
            "Frames of latest streams that a newer frame replaced in the queue (an outcome, "
            "not an error).",
        )  # fmt: skip
        over = GaugeMetricFamily(
            "duomo_model_capacity_over",
            "1 while the model's streams offer more frames than it serves (more than a tenth "
            "of them lost to its load over the last 5 s), else 0.", labels=m,
        )  # fmt: skip
        offered = GaugeMetricFamily(
            "duomo_model_offered_fps",
            "Frames per second the model's streams offer it (after their caps), last 5 s.",
            labels=m,
        )  # fmt: skip
        served = GaugeMetricFamily(
            "duomo_model_served_fps",
            "Frames per second of its streams the model answers OK, last 5 s.", labels=m,
        )  # fmt: skip
        bound = GaugeMetricFamily(
            "duomo_model_age_bound_ms",
            "The answer age bound that follows for the model's latest streams, in ms: "
            "(ceil(streams / (instances x max_batch)) + 1) service times plus the batch window "
            "(absent without streams).", labels=m,
        )  # fmt: skip
        items = counter("inference_count", "Items inferred (a batch of n counts n).")
        executions = counter("inference_exec_count", "Batches run.")
        durations = {
            stage: counter(
                f"inference_{stage}_duration_us",
                f"Cumulative microseconds of successful requests in {stage.replace('_', ' ')}"
                + (" (end to end)" if stage == "request" else ""),
            )
            for stage, _ in STAGE_DURATIONS
        }
        latency = HistogramMetricFamily(
            "duomo_request_duration_seconds",
            "End-to-end time of successful requests, queue included.", labels=m,
        )  # fmt: skip
        batch = HistogramMetricFamily("duomo_batch_size", "Items per batch run.", labels=m)
        window = GaugeMetricFamily(
            "duomo_batch_window_seconds",
            "The fill window max_delay_ms: auto chose last (models with an auto window).",
            labels=m,
        )  # fmt: skip
        pending = GaugeMetricFamily(
            "duomo_inference_pending_request_count",
            "Requests accepted and not yet answered (queued or running).", labels=m,
        )  # fmt: skip
        state = GaugeMetricFamily(
            "duomo_model_state", "1 for the model's current state, 0 for the others.",
            labels=[*m, "state"],
        )  # fmt: skip
        memory = GaugeMetricFamily(
            "duomo_model_memory_bytes",
            "Memory charged to the loaded model on its device: its weights in full even where "
            "shared, of an ACL work buffer it shares its own work (0 when unloaded).",
            labels=[*m, "device"],
        )  # fmt: skip
        weights = GaugeMetricFamily(
            "duomo_model_weights_bytes",
            "The part of duomo_model_memory_bytes that is the copies of weights it uses "
            "(the rest: activations, buffers); a copy shared with other models is charged to "
            "the device once (duomo_weights_bytes).",
            labels=[*m, "device"],
        )  # fmt: skip
        budget = GaugeMetricFamily(
            "duomo_model_memory_budget_bytes", "The model's memory_budget_mb, in bytes.", labels=m
        )
        loads = counter("model_loads", "Successful loads (first, on demand, by an operator).")
        load_time = HistogramMetricFamily(
            "duomo_model_load_duration_seconds",
            "Time to load and warm up the model: the model switch latency.", labels=m,
        )  # fmt: skip
        evictions = counter("model_evictions", "Unloads to make room for another model.")
        restarts = counter(
            "model_restarts", "Re-initialization attempts by the watchdog, by cause.",
            [*m, "cause"],
        )  # fmt: skip
        predicted = counter(
            "model_predicted_loads", "Loads ahead of a request (preload_policy: predictive)."
        )
        hits = counter("model_prediction_hits", "Predicted loads that a request then used.")
        wasted = counter(
            "model_predictions_wasted", "Predicted loads unloaded again before any request."
        )
        identities = GaugeMetricFamily(
            "duomo_gallery_identities",
            "People in a loaded gallery model as it serves them (a change to its file is "
            "taken at its next batch).", labels=m,
        )  # fmt: skip
        embeddings = GaugeMetricFamily(
            "duomo_gallery_embeddings", "Their embeddings: the columns of its matrix.", labels=m
        )

        now = time.monotonic()
        for name, model in list(self.engine.models.items()):
            numbers = model.stats.counters()
            success.add_metric([name], numbers.totals["success"][0])
            for reason in FAILURE_REASONS:  # answered with the error, or refused at the door
                key = reason.lower()
                count = numbers.outcomes.get(key, 0) + numbers.refused.get(key, 0)
                failure.add_metric([name, reason], count)
            superseded.add_metric([name], numbers.outcomes.get(SUPERSEDED, 0))
            capacity = stream_capacity(model, now)
            over.add_metric([name], 1.0 if capacity.state == "over" else 0.0)
            offered.add_metric([name], capacity.offered_fps)
            served.add_metric([name], capacity.served_fps)
            if capacity.age_bound_ms is not None:
                bound.add_metric([name], capacity.age_bound_ms)
            items.add_metric([name], numbers.items)
            executions.add_metric([name], numbers.executions)
            for stage, kind in STAGE_DURATIONS:
                durations[stage].add_metric([name], numbers.totals[kind][1] / 1e3)
            _histogram(latency, [name], model.stats.request_seconds.bounds, numbers.request_seconds)
            _histogram(batch, [name], model.stats.batch_size.bounds, numbers.batch_sizes)
            pending.add_metric([name], model.pending)
            if model.window is not None:
                window.add_metric([name], model.window.window_s)
            current = model.state
            for each in ModelState:
                state.add_metric([name, each.value], 1.0 if each is current else 0.0)
            for device, use in self.engine.model_memory(name, model).items():
                if use.used_bytes is not None:
                    held = use.used_bytes if model.holds_memory else 0
                    memory.add_metric([name, str(device)], held)
                    mine = self.engine.memory.weights_bytes(name, device)
                    weights.add_metric([name, str(device)], mine if model.holds_memory else 0)
                if use.budget_bytes is not None and device == model.spec.devices[0]:
                    budget.add_metric([name], use.budget_bytes)
            loads.add_metric([name], model.loads)
            _histogram(load_time, [name], model.load_seconds.bounds, model.load_seconds.read())
            evictions.add_metric([name], model.evictions)
            for cause, count in list(model.restart_attempts.items()):
                restarts.add_metric([name, cause], count)
            predicted.add_metric([name], model.predictions.loads)
            hits.add_metric([name], model.predictions.hits)
            wasted.add_metric([name], model.predictions.wasted)
            gallery = GallerySession.served(model.instances.sessions())
            if gallery is not None:
                identities.add_metric([name], gallery.identities)
                embeddings.add_metric([name], gallery.embeddings)
        yield from (success, failure, superseded, items, executions, *durations.values())
        yield from (latency, batch, over, offered, served)
        if bound.samples:
            yield bound
        yield from (pending, state, memory, weights, budget, loads, load_time, evictions)
        yield restarts
        yield from (predicted, hits, wasted)
        if window.samples:
            yield window
        if identities.samples:
            yield from (identities, embeddings)

    def _devices(self) -> Iterator[Metric]:
        d = ["device"]
        used = GaugeMetricFamily(
            "duomo_device_memory_used_bytes",
            "Memory charged to the device's loaded models.", labels=d,
        )  # fmt: skip
        budget = GaugeMetricFamily(
            "duomo_device_memory_budget_bytes", "The device's memory_budget_mb.", labels=d
        )
        total = GaugeMetricFamily(
            "duomo_device_memory_total_bytes", "The device's memory, as it reports it.", labels=d
        )
        utilization = GaugeMetricFamily(
            "duomo_device_utilization_ratio", "Compute units busy (0..1), as the device "
            "reports it (NVML, npu-smi).", labels=d,
        )  # fmt: skip
        temperature = GaugeMetricFamily(
            "duomo_device_temperature_celsius", "The device's temperature.", labels=d
        )
        power = GaugeMetricFamily("duomo_device_power_watts", "The device's power draw.", labels=d)
        cpu = CounterMetricFamily(
            "duomo_device_cpu_seconds", "CPU seconds this process spent (cpu devices).",
            labels=[*d, "mode"],
        )  # fmt: skip
        weights = GaugeMetricFamily(
            "duomo_weights_bytes",
            "A copy of weights held for the loaded models that use it, charged to the device "
            "once (copy: what tells copies of one file apart).",
            labels=[*d, "file", "copy"],
        )  # fmt: skip
        users = GaugeMetricFamily(
            "duomo_weights_models",
            "How many loaded models use the copy of weights.", labels=[*d, "file", "copy"],
        )  # fmt: skip
        for id_, use in self.engine.device_memory().items():
            key = [str(id_)]
            used.add_metric(key, use.used_bytes or 0)
            for copy, (share, names) in self.engine.memory.weights_held(id_).items():
                weights.add_metric([*key, share.file, copy], share.nbytes)
                users.add_metric([*key, share.file, copy], len(names))
            if use.budget_bytes is not None:
                budget.add_metric(key, use.budget_bytes)
            reading = self.engine.telemetry.read(id_)
            if reading.total_bytes is not None:
                total.add_metric(key, reading.total_bytes)
            for family, value in (
                (utilization, reading.utilization),
                (temperature, reading.temperature_c),
                (power, reading.power_w),
            ):
                if value is not None:
                    family.add_metric(key, value)
            for mode, seconds in reading.cpu_seconds.items():
                cpu.add_metric([*key, mode], seconds)
        families: tuple[Metric, ...] = (
            used, budget, total, weights, users, utilization, temperature, power, cpu,
        )  # fmt: skip
        yield from (family for family in families if family.samples)  # absent when unreported

    def _streams(self) -> Iterator[Metric]:
        sm = ["stream", "model"]

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"duomo_stream_{name}", doc + STREAM_BOUND, labels=sm)

        def gauge(name: str, doc: str, labels: Sequence[str] = sm) -> GaugeMetricFamily:
            return GaugeMetricFamily(
                f"duomo_stream_{name}", doc + STREAM_BOUND, labels=list(labels)
            )

        frames = counter(
            "frames", "Frames of the stream that reached the supervisor for the model (those "
            "superseded at the source count only in duomo_stream_superseded_total).",
        )  # fmt: skip
        answered = counter("answered", "Frames of the stream the model answered successfully.")
        superseded = counter(
            "superseded", "Frames of the stream replaced by a newer one before the model took "
            "them (latest): in its queue, or at the source before they were sent.",
        )  # fmt: skip
        refused = counter(
            "refused", "Frames of the stream refused at the source (fifo's backlog full: never "
            "sent) or answered with an error (any outcome but OK and SUPERSEDED).",
        )  # fmt: skip
        skipped = counter(
            "skipped", "Frames of the stream its source's caps dropped (max_fps, every): never "
            "sent, by the stream's own settings.",
        )  # fmt: skip
        state = gauge(
            "state", "1 for the stream's current state (starting, running, blocked, stalled, "
            "ended), 0 for the others.", ["stream", "state"],
        )  # fmt: skip
        input_fps = gauge("input_fps", "Frames of the stream arriving per second, recently.")
        answered_fps = gauge("answered_fps", "Frames of the stream answered per second, recently.")
        age = gauge(
            "age_ms", "Answer age (answer time minus capture time) of the stream's answers in "
            "the last 60 s, in ms, at the quantile.", [*sm, "quantile"],
        )  # fmt: skip
        for stream in self.streams.snapshot():  # (the records ``status`` shows)
            for each in STATES:
                state.add_metric([stream.name, each], 1.0 if each == stream.state else 0.0)
            for model, f in stream.models.items():
                key = [stream.name, model]
                frames.add_metric(key, f.frames_in)
                answered.add_metric(key, f.answered)
                superseded.add_metric(key, f.superseded)
                refused.add_metric(key, f.refused)
                skipped.add_metric(key, f.skipped)
                input_fps.add_metric(key, f.input_fps)
                answered_fps.add_metric(key, f.answered_fps)
                for quantile, ms in (("0.5", f.age_ms_p50), ("0.99", f.age_ms_p99)):
                    if ms is not None:
                        age.add_metric([*key, quantile], ms)
        yield from (frames, answered, superseded, refused, skipped, state)
        yield from (input_fps, answered_fps, age)

    def _pipelines(self) -> Iterator[Metric]:
        p, ps = ["pipeline"], ["pipeline", "step"]
        requests = CounterMetricFamily(
            "duomo_pipeline_requests", "Pipeline requests answered, by code (OK: answered; "
            "refusals before it ran included).", labels=[*p, "code"],
        )  # fmt: skip
        latency = HistogramMetricFamily(
            "duomo_pipeline_latency_seconds",
            "End-to-end time of successful pipeline requests, every step included.", labels=p,
        )  # fmt: skip
        objects = HistogramMetricFamily(
            "duomo_pipeline_objects_per_frame",
            "Objects the pipeline's steps iterated per frame (frames with a first-step result).",
            labels=p,
        )  # fmt: skip
        runs = CounterMetricFamily(
            "duomo_pipeline_step_runs", "Requests the step sent to its model.",
            labels=[*ps, "model"],
        )  # fmt: skip
        skipped = CounterMetricFamily(
            "duomo_pipeline_step_skipped",
            "Frames on which the step had nothing to run on (no object left after its filters).",
            labels=ps,
        )  # fmt: skip
        reused = CounterMetricFamily(
            "duomo_pipeline_step_reused", "Sub-results the step reused from the tracker.",
            labels=ps,
        )  # fmt: skip
        errors = CounterMetricFamily(
            "duomo_pipeline_step_errors", "Sub-results of the step that failed.", labels=ps
        )
        for name, pipeline in list(self.engine.pipelines.items()):
            numbers = pipeline.stats.counters()
            for code in CODES:  # answered with the code, or refused with it before it ran
                outcome = code.lower()
                count = numbers.outcomes.get(outcome, 0) + numbers.refused.get(outcome, 0)
                requests.add_metric([name, code], count)
            bounds = pipeline.stats.request_seconds.bounds
            _histogram(latency, [name], bounds, numbers.request_seconds)
            _histogram(objects, [name], pipeline.objects.bounds, pipeline.objects.read())
            for step in pipeline.step_counts():
                key = [name, step.name]
                runs.add_metric([*key, step.model], step.runs)
                skipped.add_metric(key, step.skipped)
                reused.add_metric(key, step.reused)
                errors.add_metric(key, step.errors)
        yield from (requests, latency, objects, runs, skipped, reused, errors)
