"""The managed sources' Prometheus series (``duomo_source_*``), per ``source``: what its worker last
reported, from the fleet's ``SourceStatus`` records.

- ``duomo_source_decoded_total``, ``duomo_source_decode_errors_total`` (packets the decoder
  refused and frames it had to conceal: not sent), ``duomo_source_reconnects_total`` and
  ``duomo_source_answered_total`` (OK answers, over its models): counters;
- ``duomo_source_state{state}``: 1 for the source's state, 0 for the others (every state of
  ``ipc.source_records.SOURCE_STATES`` is there, so an alert on ``failed`` works from the start).

The last error is text, so it is no label (a label per message would be a new series each time):
``duomo source list`` and ``duomo status`` show it. A source's counters count what its worker
decoded; a source moved to another worker (its first one died) starts them again, which
Prometheus reads as a counter reset. A removed source's series end. Called by
``supervisor.operators.metrics.DuomoCollector`` on each scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from duomo.ipc.source_records import SOURCE_STATES, SourceStatus

COUNTERS = (
    ("decoded", "Frames the source's decoder gave."),
    ("decode_errors", "Packets the decoder refused and frames it concealed (not sent)."),
    ("reconnects", "Times the source failed or dropped and was tried again."),
    ("answered", "OK answers to the source's frames, over its models."),
)


def source_families(sources: Sequence[SourceStatus]) -> Iterator[Metric]:
    """The ``duomo_source_*`` families of ``sources``."""
    for name, doc in COUNTERS:
        family = CounterMetricFamily(f"duomo_source_{name}", doc, labels=["source"])
        for source in sources:
            family.add_metric([source.name], getattr(source, name))
        yield family
    state = GaugeMetricFamily(
        "duomo_source_state", "1 for the source's state (connecting, playing, reconnecting, "
        "failed, stopped), 0 for the others.", labels=["source", "state"],
    )  # fmt: skip
    for source in sources:
        for known in SOURCE_STATES:
            state.add_metric([source.name, known], 1.0 if source.state == known else 0.0)
    yield state
