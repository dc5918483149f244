"""The sinks against real brokers (tests/integration/brokers.py): mosquitto with a password
file, redis-server, a webhook receiver from the standard library, and files. Events are made as
a source worker makes them (a seq from the sequencer, appended to the outbox), delivered by a
``SinkDelivery`` and read back from the broker by a client of the test's own."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import redis
from paho.mqtt.enums import CallbackAPIVersion

from duomo.ipc.stream_records import FrameTime
from duomo.sinks.config import (
    FileSinkConfig,
    MqttSinkConfig,
    OutboxConfig,
    RedisSinkConfig,
    SinkConfig,
    WebhookSinkConfig,
)
from duomo.sinks.delivery import DeliveryTiming, SinkDelivery
from duomo.sinks.events import Event, TrackedObject, decode_event
from duomo.sinks.outbox import Outbox, outbox_path
from duomo.sinks.sequencer import FILE_NAME, Sequencer
from tests.conftest import poll
from tests.integration.brokers import running_mosquitto, running_redis, self_signed_certificate
from tools.bench.brokers import Broker

FAST = DeliveryTiming(
    batch_limit=64,
    idle_poll_s=0.02,
    first_retry_s=0.1,
    max_retry_s=0.5,
    failing_retry_s=0.5,
    prune_every_s=0.2,
)
PASSWORD_ENV = "DUOMO_TEST_SINK_PASSWORD"
KINDS = ("object_appeared", "object_updated", "object_left")


def make_event(source: str, seq: int) -> Event:
    """An answer for an even seq, an object event otherwise (every kind appears)."""
    when = FrameTime(1796420400.0 + seq / 25, "camera")
    if seq % 2 == 0:
        return Event(source, seq, "answer", when, seq, model="classify", result={"top": seq})
    tracked = TrackedObject(seq, (1.0, 2.0, 30.0, 40.0), 0.9, {"identify": {"name": "alice"}})
    return Event(source, seq, KINDS[seq // 2 % 3], when, seq, pipeline="faces", object=tracked)


class Producer:
    """A source worker's side: seqs from the sequencer, events appended to the sink's outbox
    (its own connections, as another process would have)."""

    def __init__(self, folder: Path, sink: SinkConfig) -> None:
        self.seqs = Sequencer(folder / FILE_NAME).open()
        self.outbox = Outbox(outbox_path(folder, sink.name), sink.outbox, sink.name).open()
        self.made: list[Event] = []
        self.slowest_append_s = 0.0

    def emit(self, source: str, count: int = 1) -> None:
        for _ in range(count):
            event = make_event(source, self.seqs.next(source))
            started = time.monotonic()
            self.outbox.append([event])
            self.slowest_append_s = max(self.slowest_append_s, time.monotonic() - started)
            self.made.append(event)

    def close(self) -> None:
        self.outbox.close()
        self.seqs.close()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "sinks"


@pytest.fixture
def delivering(folder: Path) -> Iterator[Any]:
    """``delivering(sink)``: a started ``SinkDelivery`` and a ``Producer`` for ``sink``, both
    stopped at the end."""
    made: list[tuple[SinkDelivery, Producer]] = []

    def start(sink: SinkConfig, timing: DeliveryTiming = FAST) -> tuple[SinkDelivery, Producer]:
        producer = Producer(folder, sink)
        delivery = SinkDelivery.of(sink, folder, timing)
        delivery.start()
        made.append((delivery, producer))
        return delivery, producer

    yield start
    for delivery, producer in made:
        delivery.stop()
        producer.close()


def first_arrivals(ids: list[str]) -> dict[str, list[int]]:
    """Each source's seqs in the order they first arrived (a redelivery is a duplicate)."""
    seen: set[str] = set()
    out: dict[str, list[int]] = {}
    for event_id in ids:
        if event_id not in seen:
            seen.add(event_id)
            source, _, seq = event_id.rpartition(":")
            out.setdefault(source, []).append(int(seq))
    return out


# -- MQTT ---------------------------------------------------------------------------------------


class Subscriber:
    """A paho client of the test's own, reading every topic under ``duomo/``. ``drain()``
    returns what came before a marker it publishes itself: the broker forwards in the order it
    received, so anything the sink sent before (a duplicate included) is there by then."""

    def __init__(self, port: int, user: str, password: str, session: str | None = None) -> None:
        """``session``: a client id whose session the broker keeps while this is away (its
        QoS 1 messages queued for it), and paho reconnects quickly."""
        self.messages: list[tuple[str, bytes]] = []
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=session or "", clean_session=session is None
        )
        self.client.reconnect_delay_set(min_delay=0.1, max_delay=0.5)
        self.client.username_pw_set(user, password)
        self.client.on_connect = lambda c, *_: c.subscribe("duomo/#", qos=1)
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, m.payload))
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self._subscribed.wait(10), "no SUBACK"

    def drain(self) -> list[tuple[str, bytes]]:
        self.client.publish("duomo/marker/end", b"{}", qos=1)
        poll(lambda: any(topic == "duomo/marker/end" for topic, _ in self.messages), timeout_s=10)
        return [(topic, body) for topic, body in self.messages if topic != "duomo/marker/end"]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_mqtt_delivers_every_event_once(
    folder: Path, delivering: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_mosquitto(folder / "mqtt", {"duomo": "pub-pw", "reader": "read-pw"}) as broker:
        reader = Subscriber(broker.port, "reader", "read-pw")
        try:
            monkeypatch.setenv(PASSWORD_ENV, "pub-pw")
            sink = MqttSinkConfig(
                name="broker",
                kind="mqtt",
                url=f"mqtt://127.0.0.1:{broker.port}",
                username="duomo",
                password_env=PASSWORD_ENV,
            )
            delivery, producer = delivering(sink)
            for _ in range(40):
                producer.emit("gate-1")
                producer.emit("gate-2")
            poll(lambda: delivery.status().pending_events == 0, timeout_s=15)
            messages = reader.drain()
        finally:
            reader.close()
    ids = [decode_event(body)["id"] for _, body in messages]
    assert sorted(ids) == sorted(e.id for e in producer.made) and len(ids) == 80  # once each
    assert first_arrivals(ids) == {"gate-1": list(range(1, 41)), "gate-2": list(range(1, 41))}
    made = {e.id: e for e in producer.made}
    for topic, body in messages:
        event = made[decode_event(body)["id"]]
        assert topic == f"duomo/{event.source}/{event.kind}"
        assert decode_event(body) == event.to_json()
    status = delivery.status()
    assert (status.state, status.published, status.errors, status.dropped) == (
        "connected", 80, 0, 0
    )  # fmt: skip
    assert status.delay_p50_ms is not None and status.delay_p99_ms is not None
    assert 0 <= status.delay_p50_ms <= status.delay_p99_ms < 15_000


def test_mqtt_refused_credentials_fail_with_the_reason_and_keep_the_events(
    folder: Path, delivering: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_mosquitto(folder / "mqtt", {"duomo": "right-pw"}) as broker:
        monkeypatch.setenv(PASSWORD_ENV, "wrong-pw")
        sink = MqttSinkConfig(
            name="broker",
            kind="mqtt",
            url=f"mqtt://127.0.0.1:{broker.port}",
            username="duomo",
            password_env=PASSWORD_ENV,
        )
        delivery, producer = delivering(sink)
        producer.emit("gate-1", 5)
        poll(lambda: delivery.status().state == "failing", timeout_s=10)
        status = delivery.status()
        assert status.reason is not None and "not authori" in status.reason.lower(), status
        assert "wrong-pw" not in status.reason and status.errors >= 1
        assert status.pending_events == 5 and status.published == 0
        # the secret is read at each connect: once it is right, the slow retry gets through
        monkeypatch.setenv(PASSWORD_ENV, "right-pw")
        poll(lambda: delivery.status().published == 5, timeout_s=10)
        assert delivery.status().state == "connected"


def test_mqtt_over_tls_trusts_only_its_ca(
    folder: Path, delivering: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed_certificate(tmp_path / "broker-cert")
    stranger, _ = self_signed_certificate(tmp_path / "other-cert")
    monkeypatch.setenv(PASSWORD_ENV, "pub-pw")
    with running_mosquitto(folder / "mqtt", {"duomo": "pub-pw"}, tls=(cert, key)) as broker:
        url = f"mqtts://127.0.0.1:{broker.port}"
        common = {"kind": "mqtt", "url": url, "username": "duomo", "password_env": PASSWORD_ENV}
        trusting, producer = delivering(
            MqttSinkConfig.model_validate({"name": "trusting", "ca_file": cert, **common})
        )
        wary, wary_producer = delivering(
            MqttSinkConfig.model_validate({"name": "wary", "ca_file": stranger, **common})
        )
        producer.emit("gate-1", 3)
        wary_producer.emit("gate-2", 3)
        poll(lambda: trusting.status().published == 3, timeout_s=10)
        poll(lambda: wary.status().state == "failing", timeout_s=10)
    reason = wary.status().reason or ""
    assert "TLS" in reason and "CERTIFICATE_VERIFY_FAILED" in reason, reason
    assert wary.status().pending_events == 3


# -- Redis Streams ------------------------------------------------------------------------------


def stream_ids(client: redis.Redis, key: str) -> list[str]:
    entries = client.xrange(key)
    assert all(set(fields) == {b"event"} for _, fields in entries)
    return [decode_event(fields[b"event"])["id"] for _, fields in entries]


def test_redis_streams_one_per_source_and_trimmed_by_maxlen(
    folder: Path, delivering: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_redis(folder / "redis", password="redis-pw") as broker:
        monkeypatch.setenv(PASSWORD_ENV, "redis-pw")
        url = f"redis://127.0.0.1:{broker.port}/0"
        sink = RedisSinkConfig(name="lake", kind="redis", url=url, password_env=PASSWORD_ENV)
        trimmed = RedisSinkConfig(
            name="recent", kind="redis", url=url, password_env=PASSWORD_ENV,
            stream_prefix="recent", maxlen=10,
        )  # fmt: skip
        delivery, producer = delivering(sink)
        short, short_producer = delivering(trimmed)
        producer.emit("gate-1", 30)
        producer.emit("gate-2", 30)
        short_producer.emit("gate-3", 200)
        poll(lambda: delivery.status().pending_events == 0, timeout_s=15)
        poll(lambda: short.status().pending_events == 0, timeout_s=15)
        reader = redis.Redis(port=broker.port, password="redis-pw")
        try:
            assert sorted(reader.keys("*")) == [b"duomo:gate-1", b"duomo:gate-2", b"recent:gate-3"]
            for source in ("gate-1", "gate-2"):
                assert stream_ids(reader, f"duomo:{source}") == [
                    f"{source}:{seq}" for seq in range(1, 31)
                ]
            (_, fields), *_ = reader.xrange("duomo:gate-1", count=1)
            assert json.loads(fields[b"event"]) == producer.made[0].to_json()
            # XREAD, as a consumer follows a stream
            ((key, entries),) = reader.xread({"duomo:gate-2": "0-0"}, count=3)
            assert key == b"duomo:gate-2" and len(entries) == 3
            # MAXLEN ~ 10 trims whole nodes (5 entries here): about 10 kept, the newest
            kept = stream_ids(reader, "recent:gate-3")
            assert 10 <= len(kept) < 20
            assert kept == [f"gate-3:{seq}" for seq in range(201 - len(kept), 201)]
        finally:
            reader.close()
        assert delivery.status().published == 60 and short.status().published == 200


def test_past_the_outbox_bound_the_next_event_says_how_many_were_dropped(
    folder: Path, delivering: Any
) -> None:
    with running_redis(folder / "redis") as broker:
        size = len(make_event("gate-1", 11).encode())
        sink = RedisSinkConfig(
            name="lake", kind="redis", url=f"redis://127.0.0.1:{broker.port}",
            outbox=OutboxConfig(max_mb=10.5 * size / 1024 / 1024),
        )  # fmt: skip
        broker.stop()  # away from the start
        delivery, producer = delivering(sink)
        producer.emit("gate-1", 40)
        poll(lambda: delivery.status().state == "retrying", timeout_s=10)
        away = delivery.status()
        assert away.dropped > 20 and away.pending_events + away.dropped == 40, away
        assert away.pending_bytes <= sink.outbox.max_bytes
        broker.start()
        poll(lambda: delivery.status().pending_events == 0, timeout_s=10)
        reader = redis.Redis(port=broker.port)
        try:
            arrived = [decode_event(f[b"event"]) for _, f in reader.xrange("duomo:gate-1")]
        finally:
            reader.close()
    assert [e["seq"] for e in arrived] == list(range(away.dropped + 1, 41))
    assert arrived[0]["dropped"] == away.dropped  # a consumer knows what it missed
    assert all("dropped" not in e for e in arrived[1:])
    assert delivery.status().dropped == away.dropped


def test_redis_refused_password_fails(folder: Path, delivering: Any) -> None:
    with running_redis(folder / "redis", password="redis-pw") as broker:
        sink = RedisSinkConfig(
            name="lake", kind="redis", url=f"redis://:not-it@127.0.0.1:{broker.port}/0"
        )
        delivery, producer = delivering(sink)
        producer.emit("gate-1", 3)
        poll(lambda: delivery.status().state == "failing", timeout_s=10)
        status = delivery.status()
        assert status.reason is not None and "not-it" not in status.reason
        assert "password" in status.reason.lower() and status.pending_events == 3


def play_through_an_outage(delivery: SinkDelivery, producer: Producer, broker: Broker) -> None:
    """Two cameras append events every 10 ms; after some are delivered the broker is stopped
    for 3 s and started again; the cameras stop once the sink is connected again, and the
    outbox empties. The producers never wait on the broker meanwhile."""
    playing = threading.Event()
    playing.set()

    def cameras() -> None:
        while playing.is_set():
            producer.emit("gate-1")
            producer.emit("gate-2")
            time.sleep(0.01)  # the cameras' pace

    camera_thread = threading.Thread(target=cameras)
    camera_thread.start()
    try:
        poll(lambda: delivery.status().published >= 40, timeout_s=10)
        broker.stop()
        stopped_at = time.monotonic()
        producer.slowest_append_s = 0.0
        poll(lambda: delivery.status().state == "retrying", timeout_s=10)
        poll(lambda: time.monotonic() - stopped_at >= 3.0, timeout_s=10)
        during = delivery.status()
        assert during.pending_events > 20, during
        # the producers never waited on the broker: one that did would have waited the whole
        # outage (3 s and more); the bound leaves room for a loaded machine's slow fsync
        assert producer.slowest_append_s < 2.5, producer.slowest_append_s
        broker.start()
        poll(lambda: delivery.status().state == "connected", timeout_s=10)
    finally:
        playing.clear()
        camera_thread.join()
    poll(lambda: delivery.status().pending_events == 0, timeout_s=15)
    assert delivery.status().errors >= 1


def assert_every_seq_in_order(producer: Producer, arrived: list[str]) -> None:
    made = first_arrivals([e.id for e in producer.made])
    assert made["gate-1"] == list(range(1, len(made["gate-1"]) + 1))
    assert first_arrivals(arrived) == made  # every seq, each source's first arrivals in order


def test_a_redis_outage_loses_nothing_and_keeps_the_order(folder: Path, delivering: Any) -> None:
    with running_redis(folder / "redis", durable=True) as broker:
        sink = RedisSinkConfig(name="lake", kind="redis", url=f"redis://127.0.0.1:{broker.port}")
        delivery, producer = delivering(sink)
        play_through_an_outage(delivery, producer, broker)
        reader = redis.Redis(port=broker.port)
        try:
            arrived = stream_ids(reader, "duomo:gate-1") + stream_ids(reader, "duomo:gate-2")
        finally:
            reader.close()
    assert_every_seq_in_order(producer, arrived)


def test_an_mqtt_outage_loses_nothing_and_keeps_the_order(
    folder: Path, delivering: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    users = {"duomo": "pub-pw", "reader": "read-pw"}
    with running_mosquitto(folder / "mqtt", users, durable=True) as broker:
        # the reader's session outlives the broker's restart, with what was queued for it
        reader = Subscriber(broker.port, "reader", "read-pw", session="outage-reader")
        try:
            monkeypatch.setenv(PASSWORD_ENV, "pub-pw")
            sink = MqttSinkConfig(
                name="broker", kind="mqtt", url=f"mqtt://127.0.0.1:{broker.port}",
                username="duomo", password_env=PASSWORD_ENV,
            )  # fmt: skip
            delivery, producer = delivering(sink)
            play_through_an_outage(delivery, producer, broker)
            poll(reader.client.is_connected, timeout_s=10)
            messages = reader.drain()
        finally:
            reader.close()
    assert_every_seq_in_order(producer, [decode_event(body)["id"] for _, body in messages])


# A sink worker: the delivery loop in a process of its own, killed with SIGKILL mid-stream.
SINK_WORKER = """
import sys, time
from pathlib import Path
from duomo.sinks.config import RedisSinkConfig
from duomo.sinks.delivery import DeliveryTiming, SinkDelivery

folder, url = Path(sys.argv[1]), sys.argv[2]
sink = RedisSinkConfig(name="lake", kind="redis", url=url)
delivery = SinkDelivery.of(sink, folder, DeliveryTiming(batch_limit=8, idle_poll_s=0.02))
delivery.start()
while True:
    print("published", delivery.status().published, flush=True)
    time.sleep(0.01)
"""


def test_a_kill_9_of_the_publishing_process_loses_nothing(folder: Path, delivering: Any) -> None:
    with running_redis(folder / "redis") as broker:
        url = f"redis://127.0.0.1:{broker.port}"
        sink = RedisSinkConfig(name="lake", kind="redis", url=url)
        with (
            Sequencer(folder / FILE_NAME) as seqs,
            Outbox(outbox_path(folder, sink.name), sink.outbox) as outbox,
        ):
            first = seqs.next("gate-1", count=2000)
            outbox.append(make_event("gate-1", seq) for seq in range(first, first + 2000))
        worker = subprocess.Popen(
            [sys.executable, "-c", SINK_WORKER, str(folder), url], stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert worker.stdout is not None
        try:
            published = 0
            while published < 100:
                line = worker.stdout.readline()
                assert line, "the sink worker ended"
                if line.startswith("published "):  # (its log lines come here too)
                    published = int(line.split()[1])
        finally:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(10)
        with Outbox(outbox_path(folder, "lake"), OutboxConfig()) as left:
            assert 0 < left.pending().events < 2000  # killed mid-stream
        delivery, _ = delivering(sink)  # the restarted sink worker
        poll(lambda: delivery.status().pending_events == 0, timeout_s=15)
        reader = redis.Redis(port=broker.port)
        try:
            arrived = stream_ids(reader, "duomo:gate-1")
        finally:
            reader.close()
    assert first_arrivals(arrived) == {"gate-1": list(range(1, 2001))}
    assert len(arrived) - 2000 <= 8  # at most the batch in flight went twice


# -- webhook ------------------------------------------------------------------------------------


class Receiver(ThreadingHTTPServer):
    """A webhook receiver: answers 503 to the first request, 400 to the events in ``refuse``,
    200 to the rest; with ``fail_every`` n, 500 to every n-th request instead (and no 503
    first). Keeps what it accepted and whether each signature was right."""

    def __init__(self, secret: str, refuse: set[str], fail_every: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), ReceiverHandler)
        self.secret = secret
        self.refuse = refuse
        self.fail_every = fail_every
        self.requests = 0
        self.accepted: list[str] = []
        self.signatures_ok: list[bool] = []


class ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        expected = hmac.new(self.server.secret.encode(), body, hashlib.sha256).hexdigest()
        signed = self.headers.get("X-Duomo-Signature", "")
        self.server.signatures_ok.append(hmac.compare_digest(signed, f"sha256={expected}"))
        event_id = decode_event(body)["id"]
        assert self.headers["X-Duomo-Event"] == event_id
        assert self.headers["Content-Type"] == "application/json"
        self.server.requests += 1
        status = 200
        if self.server.fail_every:
            if self.server.requests % self.server.fail_every == 0:
                status = 500
        elif self.server.requests == 1:
            status = 503
        elif event_id in self.server.refuse:
            status = 400
        if status == 200:
            self.server.accepted.append(event_id)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _webhook_delivers(
    receiver: Receiver, delivering: Any, tmp_path: Path, source: str, events: int
) -> Any:
    """``events`` events of ``source`` through a webhook sink signed with the receiver's secret
    (read from a file), the receiver serving meanwhile, until the outbox is empty; the sink's
    delivery."""
    secret_file = tmp_path / "hook-secret"
    secret_file.write_text(f"{receiver.secret}\n")
    serving = threading.Thread(target=receiver.serve_forever, daemon=True)
    serving.start()
    try:
        sink = WebhookSinkConfig(
            name="alarm", kind="webhook",
            url=f"http://127.0.0.1:{receiver.server_address[1]}/hook",
            secret_file=secret_file, timeout_s=5,
        )  # fmt: skip
        delivery, producer = delivering(sink)
        producer.emit(source, events)
        poll(lambda: delivery.status().pending_events == 0, timeout_s=30)
    finally:
        receiver.shutdown()
        receiver.server_close()
    return delivery


def test_webhook_signs_retries_a_503_and_drops_what_is_refused_for_good(
    folder: Path, delivering: Any, tmp_path: Path
) -> None:
    receiver = Receiver("hook-secret", refuse={"gate-1:7"})
    delivery = _webhook_delivers(receiver, delivering, tmp_path, "gate-1", 20)
    assert receiver.accepted == [f"gate-1:{seq}" for seq in range(1, 21) if seq != 7]
    assert receiver.requests == 21  # the 503'd event once more, the 400'd one once
    assert all(receiver.signatures_ok) and len(receiver.signatures_ok) == 21
    status = delivery.status()
    assert (status.published, status.rejected, status.errors) == (19, 1, 1)
    assert status.last_error is not None and "503" in status.last_error


def test_a_webhook_that_fails_half_its_requests_still_gets_every_event_once_signed(
    folder: Path, delivering: Any, tmp_path: Path
) -> None:
    receiver = Receiver("hook-secret", refuse=set(), fail_every=2)
    delivery = _webhook_delivers(receiver, delivering, tmp_path, "gate-2", 20)
    # every event once, in seq order, though every other request was answered 500
    # (requests 200, 500, 200, 500, …: each event but the first is refused once, then taken)
    assert receiver.accepted == [f"gate-2:{seq}" for seq in range(1, 21)]
    assert receiver.requests == 39 and all(receiver.signatures_ok)
    status = delivery.status()
    assert (status.published, status.rejected, status.errors) == (20, 0, 19)
    assert status.last_error is not None and "500" in status.last_error


# -- file ---------------------------------------------------------------------------------------


def test_file_sink_rotates_by_size_and_keeps_a_bounded_number(
    folder: Path, delivering: Any, tmp_path: Path
) -> None:
    line = len(make_event("gate-1", 10).encode()) + 1
    path = tmp_path / "out" / "events.jsonl"
    sink = FileSinkConfig(
        name="local", kind="file", path=path, max_mb=10.5 * line / 1024 / 1024, keep=2
    )
    delivery, producer = delivering(sink)
    producer.emit("gate-1", 60)
    poll(lambda: delivery.status().pending_events == 0, timeout_s=15)
    delivery.stop()  # the file closed, all written
    names = sorted(p.name for p in path.parent.iterdir())
    assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    lines: list[str] = []
    for name in ("events.jsonl.2", "events.jsonl.1", "events.jsonl"):
        text = (path.parent / name).read_text()
        assert len(text.encode()) <= sink.max_bytes
        lines += text.splitlines()
    seqs = [decode_event(text)["seq"] for text in lines]
    assert seqs == list(range(61 - len(seqs), 61)) and 20 <= len(seqs) <= 32


def test_a_file_sink_that_cannot_write_is_failing(
    folder: Path, delivering: Any, tmp_path: Path
) -> None:
    (tmp_path / "not-a-folder").write_text("")
    sink = FileSinkConfig(name="local", kind="file", path=tmp_path / "not-a-folder" / "e.jsonl")
    delivery, producer = delivering(sink)
    producer.emit("gate-1", 2)
    poll(lambda: delivery.status().state == "failing", timeout_s=10)
    status = delivery.status()
    assert status.reason == f"{tmp_path / 'not-a-folder'}: not a folder"
    assert status.pending_events == 2
