"""The sinks' Prometheus series (``duomo_sink_*``), per ``sink``: what the sink worker last
reported, from the hub's ``SinkStatus`` records.

- ``duomo_sink_published_total``, ``duomo_sink_dropped_total`` (by the outbox's bounds, plus
  events a receiver refused for good) and ``duomo_sink_errors_total``: counters;
- ``duomo_sink_pending_events`` and ``duomo_sink_pending_bytes``: what waits in its outbox;
- ``duomo_sink_state{state}``: 1 for the sink's state, 0 for the others (every state of
  ``ipc.sink_records.SINK_STATES``, so an alert on ``failing`` works from the start);
- ``duomo_sink_ack_delay_ms{quantile}``: the delay from an event's append to the broker's
  acknowledgement, p50 and p99 (``0.5``, ``0.99``) over the delivery loop's recent window.

The reason of a ``retrying`` or ``failing`` sink is text, so it is no label: ``duomo status``
shows it. ``published`` and ``errors`` count since the sink worker started (a restart reads as
a counter reset); ``dropped`` is kept in the outbox and survives it. Called by
``supervisor.operators.metrics.DuomoCollector`` on each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from duomo.ipc.sink_records import SINK_STATES, SinkStatus


def sink_families(sinks: Sequence[SinkStatus]) -> Iterator[Metric]:
    """The ``duomo_sink_*`` families of ``sinks``."""
    counters = (
        ("published", "Events the sink's broker acknowledged.", lambda s: s.published),
        ("dropped", "Events dropped: by the outbox's bounds, or refused for good.",
         lambda s: s.dropped + s.rejected),
        ("errors", "Failed connects and publishes of the sink.", lambda s: s.errors),
    )  # fmt: skip
    for name, doc, value in counters:
        family = CounterMetricFamily(f"duomo_sink_{name}", doc, labels=["sink"])
        for sink in sinks:
            family.add_metric([sink.name], value(sink))
        yield family
    gauges = (
        ("pending_events", "Events waiting in the sink's outbox.", lambda s: s.pending_events),
        ("pending_bytes", "Bytes of their JSON.", lambda s: s.pending_bytes),
    )
    for name, doc, value in gauges:
        gauge = GaugeMetricFamily(f"duomo_sink_{name}", doc, labels=["sink"])
        for sink in sinks:
            gauge.add_metric([sink.name], value(sink))
        yield gauge
    state = GaugeMetricFamily(
        "duomo_sink_state", "1 for the sink's state (connecting, connected, retrying, failing), "
        "0 for the others.", labels=["sink", "state"],
    )  # fmt: skip
    for sink in sinks:
        for known in SINK_STATES:
            state.add_metric([sink.name, known], 1.0 if sink.state == known else 0.0)
    yield state
    delay = GaugeMetricFamily(
        "duomo_sink_ack_delay_ms", "Delay from an event's append to its acknowledgement, ms "
        "(recent acknowledgements).", labels=["sink", "quantile"],
    )  # fmt: skip
    for sink in sinks:
        for quantile, value_ms in (("0.5", sink.delay_p50_ms), ("0.99", sink.delay_p99_ms)):
            if value_ms is not None:
                delay.add_metric([sink.name, quantile], value_ms)
    yield delay
