"""The sinks' record on the wire: one sink as its delivery loop sees it (``SinkStatus``), sent by
the sink worker in its ``sink_report`` message and shown as it came by the supervisor (``duomo
status``, ``--watch``, ``/metrics``).

A flat record of scalars whose dict form is derived from its fields (``ipc.records``): a key
missing or of the wrong type is an error naming the record and the key, never a default.

Made by ``sinks.delivery.SinkDelivery.status`` (in the sink worker), kept by
``supervisor.sinks.hub.SinkHub``, read by the CLI's status views and the metrics collector.
"""

from __future__ import annotations

import dataclasses

from duomo.ipc.records import Record

SINK_STATES = ("connecting", "connected", "retrying", "failing")


@dataclasses.dataclass(frozen=True)
class SinkStatus(Record):
    """One sink.

    Attributes:
        name: The sink's name.
        kind: ``mqtt``, ``redis``, ``webhook`` or ``file``.
        target: Where it sends (a URL's password masked, or the file's path).
        state: ``connecting``, ``connected``, ``retrying`` or ``failing``.
        reason: Why it is retrying or failing (None while connected).
        published: Events the broker acknowledged since the loop started.
        pending_events: Events waiting in the outbox.
        pending_bytes: Bytes of their JSON.
        dropped: Events the outbox's bounds dropped, ever (from its database).
        rejected: Events the receiver refused for good (a webhook's 4xx), dropped.
        errors: Failed connects and publishes since the loop started.
        last_error: The last of them (None: none yet).
        delay_p50_ms: Median delay from an event's append to its acknowledgement, over the
            delivery loop's window of acknowledgements (None: none yet).
        delay_p99_ms: Its 99th percentile.
    """

    name: str
    kind: str
    target: str
    state: str
    reason: str | None
    published: int
    pending_events: int
    pending_bytes: int
    dropped: int
    rejected: int
    errors: int
    last_error: str | None
    delay_p50_ms: float | None
    delay_p99_ms: float | None


def waiting_status(name: str, kind: str, target: str) -> SinkStatus:
    """What a configured sink shows before the sink worker's first word on it."""
    return SinkStatus(
        name=name, kind=kind, target=target, state="connecting", reason=None, published=0,
        pending_events=0, pending_bytes=0, dropped=0, rejected=0, errors=0, last_error=None,
        delay_p50_ms=None, delay_p99_ms=None,
    )  # fmt: skip
