"""The MQTT publisher: paho-mqtt 2.x, one connection, an event acknowledged on its PUBACK.

Each event goes to ``{topic_prefix}/{source}/{kind}`` at the sink's QoS (MQTT 3.1.1, which every
broker speaks). At QoS 1 an event counts as delivered when the broker's PUBACK for it arrives
(QoS 2: PUBCOMP; QoS 0: when it is written to the socket, all QoS 0 ever promises). paho's
network thread (``loop_start``) reads the acknowledgements and calls ``_on_publish``, which
records the message id under ``_cond``; ``publish`` sends the whole batch (paho keeps at most
``INFLIGHT`` unacknowledged on the wire and queues the rest) and waits on ``_cond`` for every
id, the connection's loss or ``ack_timeout_s``.

paho's own reconnecting is off: a lost connection ends this client, and the delivery loop
connects a new one (so a late PUBACK of an abandoned batch can never be taken for a new one's:
message ids are reused). The CONNACK decides the error: a bad user name or password, not
authorised, a rejected client id or protocol → ``SinkRefusedError``; server unavailable or busy
→ ``SinkUnavailableError``. So do the socket's: TLS verification and an unknown host refuse;
a refused or timed-out connection is unavailable.

Threads: the delivery thread calls ``connect``, ``publish`` and ``close``; paho's network
thread calls the ``_on_*`` callbacks, which only touch what ``_cond`` guards.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.reasoncodes import ReasonCode

from duomo.sinks.config import MqttSinkConfig, SecretError, read_secret
from duomo.sinks.outbox import PendingEvent
from duomo.sinks.publisher import Published, SinkRefusedError, SinkUnavailableError

KEEPALIVE_S = 30
INFLIGHT = 64  # unacknowledged QoS > 0 messages on the wire at once
# CONNACK reason codes that say "later", not "never" (MQTT 5 numbering, as paho gives v3's)
_TRANSIENT_CONNACK = {136, 137, 151, 159}  # unavailable, busy, quota exceeded, rate exceeded


class MqttPublisher:
    """Publishes a sink's events to its MQTT broker (``publisher.Publisher``)."""

    def __init__(
        self, config: MqttSinkConfig, connect_timeout_s: float = 10.0, ack_timeout_s: float = 30.0
    ) -> None:
        self.config = config
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self._client: mqtt.Client | None = None
        self._cond = threading.Condition()
        # guarded by _cond (written by paho's network thread)
        self._connack: ReasonCode | None = None
        self._connected = False
        self._lost: str | None = None
        self._acked_mids: set[int] = set()

    def connect(self) -> None:
        self.close()
        config = self.config
        try:
            password = read_secret(config.password_env, config.password_file)
        except SecretError as err:
            raise SinkRefusedError(str(err)) from None
        if password is None:
            password = config.url_password
        username = config.username or config.url_username
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=config.client_id or "",
            protocol=MQTTProtocolVersion.MQTTv311,
            reconnect_on_failure=False,
        )
        client.connect_timeout = self.connect_timeout_s
        client.max_inflight_messages_set(INFLIGHT)
        if username is not None:
            client.username_pw_set(username, password)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        with self._cond:
            self._connack, self._connected, self._lost = None, False, None
            self._acked_mids.clear()
        where = f"{config.host}:{config.port}"
        try:
            if config.tls:
                client.tls_set(ca_certs=str(config.ca_file) if config.ca_file else None)
            client.connect(config.host, config.port, keepalive=KEEPALIVE_S)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as err:
            raise SinkUnavailableError(f"TLS with {where} cut short: {err}") from None
        except ssl.SSLError as err:  # (before OSError: an SSLError is one)
            raise SinkRefusedError(f"TLS with {where}: {err.reason or err}") from None
        except socket.gaierror as err:
            raise SinkRefusedError(f"cannot resolve {config.host}: {err.strerror}") from None
        except FileNotFoundError as err:
            raise SinkRefusedError(f"ca_file {config.ca_file}: {err.strerror}") from None
        except OSError as err:
            raise SinkUnavailableError(f"cannot connect to {where}: {_why(err)}") from None
        self._client = client
        client.loop_start()
        deadline = time.monotonic() + self.connect_timeout_s
        with self._cond:
            while self._connack is None and self._lost is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            connack, lost = self._connack, self._lost
        if connack is None:
            self.close()
            raise SinkUnavailableError(f"no CONNACK from {where}: {lost or 'timed out'}")
        if connack.is_failure:
            self.close()
            why = f"the broker at {where} refused the connection: {connack}"
            if connack.value in _TRANSIENT_CONNACK:
                raise SinkUnavailableError(why)
            raise SinkRefusedError(why)

    def publish(self, batch: Sequence[PendingEvent]) -> Published:
        client = self._client
        with self._cond:
            if client is None or not self._connected:
                return Published(error=SinkUnavailableError(self._lost or "not connected"))
            self._acked_mids.clear()
        sent: list[tuple[PendingEvent, int]] = []
        rejected: list[tuple[str, str]] = []
        for event in batch:
            topic = self.config.topic(event.source, event.kind)
            info = client.publish(topic, event.body, qos=self.config.qos)
            if info.rc == MQTTErrorCode.MQTT_ERR_PAYLOAD_SIZE:
                rejected.append((event.id, "larger than MQTT allows"))
            elif info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                break  # not connected any more: the rest waits in the outbox
            else:
                sent.append((event, info.mid))
        deadline = time.monotonic() + self.ack_timeout_s
        with self._cond:
            while self._connected and not all(mid in self._acked_mids for _, mid in sent):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            acked = [event.id for event, mid in sent if mid in self._acked_mids]
            lost = None if self._connected else (self._lost or "connection lost")
        if len(acked) + len(rejected) == len(batch):
            return Published(acked, rejected)
        why = lost or (
            f"the broker acknowledged {len(acked)} of {len(sent)} events "
            f"in {self.ack_timeout_s:g} s"
        )
        return Published(acked, rejected, SinkUnavailableError(why))

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.disconnect()
        finally:
            client.loop_stop()
        with self._cond:
            self._connected = False

    # -- paho's network thread ---------------------------------------------------------------

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        with self._cond:
            self._connack = reason
            self._connected = not reason.is_failure
            self._cond.notify_all()

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        with self._cond:
            self._connected = False
            self._lost = f"the connection was lost: {reason}"
            self._cond.notify_all()

    def _on_publish(
        self, client: mqtt.Client, userdata: Any, mid: int, reason: ReasonCode, props: Any
    ) -> None:
        with self._cond:
            self._acked_mids.add(mid)
            self._cond.notify_all()


def _why(err: OSError) -> str:
    return err.strerror or type(err).__name__
