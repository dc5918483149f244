"""What a publisher is (one small interface), what it answers, how it fails, and which one a
sink's config gets.

A publisher speaks one protocol to one broker::

    connect()          open the connection (and check the credentials); raises a SinkError
    publish(batch)     send a batch of outbox events; a Published says which ones the broker
                       acknowledged, which it refused for good, and the error that stopped it
    close()            let go of the connection (never raises)

It keeps no events of its own: what is not in ``Published.acked`` or ``.rejected`` stays in the
outbox and is sent again (at least once). It is driven by one thread, the sink's delivery loop
(``sinks.delivery``), and needs no lock of its own beyond what its client library keeps.

The errors::

    SinkError                 a publisher could not do its job; str() is the reason, shown in
    │                         status, never with a secret (URLs masked)
    ├── SinkUnavailableError  the broker is away, timed out or answered "try later" (5xx, 408,
    │                         429): retried with backoff, the sink ``retrying``
    └── SinkRefusedError      retrying as it is cannot help: the credentials are refused, the
                              TLS certificate does not verify, the host is unknown, a secret
                              is unset: the sink ``failing`` with the reason, retried slowly

Publishers: ``mqtt_publisher`` (paho-mqtt), ``redis_publisher`` (redis-py),
``webhook_publisher`` (httpx), ``file_publisher`` (the standard library); ``publisher_for``
imports only the one a sink needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from duomo.sinks.config import SinkConfig
    from duomo.sinks.outbox import PendingEvent


class SinkError(Exception):
    """A publisher could not connect or publish; ``str()`` is the reason (no secrets)."""


class SinkUnavailableError(SinkError):
    """The broker is away or asked to try later: retried with backoff."""


class SinkRefusedError(SinkError):
    """Retrying as configured cannot help (credentials, TLS, URL, secret): the sink fails."""


@dataclass(frozen=True, slots=True)
class Published:
    """What became of a batch: the ids the broker acknowledged, those it refused for good
    (``(id, why)``: dropped and counted, never sent again) and the error that stopped the rest
    (None: every event is in ``acked`` or ``rejected``)."""

    acked: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    error: SinkError | None = None


class Publisher(Protocol):
    """One protocol to one broker, driven by one delivery thread."""

    def connect(self) -> None:
        """Open the connection; SinkUnavailableError or SinkRefusedError if it cannot."""

    def publish(self, batch: Sequence[PendingEvent]) -> Published:
        """Send ``batch`` (each source's events in seq order); never raises a SinkError, which
        comes back in ``Published.error`` beside what was acknowledged before it."""
        ...

    def close(self) -> None:
        """Let go of the connection; safe to call at any time, twice included."""


def publisher_for(config: SinkConfig) -> Publisher:
    """The publisher of ``config``'s kind (its client library imported now, not before)."""
    if config.kind == "mqtt":
        from duomo.sinks.mqtt_publisher import MqttPublisher

        return MqttPublisher(config)
    if config.kind == "redis":
        from duomo.sinks.redis_publisher import RedisPublisher

        return RedisPublisher(config)
    if config.kind == "webhook":
        from duomo.sinks.webhook_publisher import WebhookPublisher

        return WebhookPublisher(config)
    from duomo.sinks.file_publisher import FilePublisher

    return FilePublisher(config)
