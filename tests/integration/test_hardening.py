"""The socket and the data plane under heavy and hostile clients: a client that reads is never
cut off, and no client can exhaust the supervisor (docs/operations.md, "Security and limits").

Three real supervisors: one with the default limits (the heavy legitimate clients, replies and
messages that used to be lost, the control queue), one with every limit lowered so a test can
reach it in a moment, and one started with few file descriptors. Each test ends by checking
that a well-behaved client is still served correctly.

The two shared supervisors are module fixtures (``roomy_supervisor``, ``tight_supervisor``); a
test takes one through ``roomy`` or ``tight``, which record its threads, descriptors and
resident memory when that test starts and check, when it ends, that the supervisor is back where
it began. Each baseline belongs to its own test, so the check means the same whatever order the
tests run in, alone or together, and a leak is charged to the test that made it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from duomo.ipc.client import Client
from duomo.ipc.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from duomo.ipc.framing import FrameReader, json_frame, parse_json, recv_frame
from duomo.ipc.status_records import SupervisorStatus
from duomo.ipc.wire import FRAME, MAX_JSON_BYTES, FrameKind, frame
from duomo.supervisor.operators.image_files import read_image
from tests.conftest import IMAGES
from tests.integration.harness import (
    SupervisorProcess,
    affine_model,
    authenticated,
    connected,
    faulty_model,
    our_segments,
    poll,
    replies,
    running_supervisor,
    write_config,
)

HUGE_NAME = "m" * 340_000


def _affine_entry(folder: Path) -> dict[str, object]:
    affine_model(folder / "affine.onnx")
    return {
        "name": "affine", "task": "raw", "file": str(folder / "affine.onnx"), "max_batch": 4,
        "queue_size": 1024,  # every request of the heaviest client queued at once
    }  # fmt: skip


@pytest.fixture(scope="module")
def roomy_supervisor(
    tmp_path_factory: pytest.TempPathFactory, demo_config: object
) -> Iterator[SupervisorProcess]:
    """Default limits, but a listen backlog of one (a burst of connections fills it)."""
    folder = tmp_path_factory.mktemp("roomy")
    config = write_config(
        folder, ["classify"], extra=[_affine_entry(folder)], limits={"listen_backlog": 1}
    )
    with running_supervisor(config) as running:
        served(running)  # warm: every model has answered once, every lazy thread has started
        yield running


@pytest.fixture
def roomy(roomy_supervisor: SupervisorProcess) -> Iterator[SupervisorProcess]:
    """The default-limits supervisor, back where it began when the test ends."""
    before = settled_usage(roomy_supervisor)
    yield roomy_supervisor
    back_where_it_began(roomy_supervisor, before)


TIGHT_LIMITS = {
    "max_connections": 6,
    "auth_timeout_s": 1.0,
    "idle_timeout_s": 3.0,
    "stall_timeout_s": 1.0,
    "max_slots_per_client": 100,
    "shm_per_client_mb": 4,
    "shm_total_mb": 6,
    "control_queue": 4,
}


@pytest.fixture(scope="module")
def tight_supervisor(
    tmp_path_factory: pytest.TempPathFactory, demo_config: object
) -> Iterator[SupervisorProcess]:
    folder = tmp_path_factory.mktemp("tight")
    config = write_config(folder, ["classify"], extra=[_affine_entry(folder)], limits=TIGHT_LIMITS)
    with running_supervisor(config) as running:
        served(running)
        yield running


@pytest.fixture
def tight(tight_supervisor: SupervisorProcess) -> Iterator[SupervisorProcess]:
    """The supervisor with every limit lowered, back where it began when the test ends."""
    before = settled_usage(tight_supervisor)
    yield tight_supervisor
    back_where_it_began(tight_supervisor, before)


def settled(sup: SupervisorProcess) -> None:
    """No client connected (but the asking one) and no ring mapped."""
    poll(lambda: len(status(sup).clients) == 0 and status(sup).mapped_rings == 0)


def settled_usage(sup: SupervisorProcess) -> dict[str, int]:
    """The supervisor's threads, resident memory and descriptors with no client: a baseline."""
    settled(sup)
    return usage(sup)


def usage(sup: SupervisorProcess) -> dict[str, int]:
    process = psutil.Process(sup.pid)
    return {
        "threads": process.num_threads(),
        "rss_mib": process.memory_info().rss >> 20,
        "fds": process.num_fds(),
    }


def back_where_it_began(sup: SupervisorProcess, before: dict[str, int]) -> None:
    """Once every client has gone: the same threads and descriptors as ``before`` (a thread
    that ends with its work is given a moment), and resident memory within 64 MiB of it
    (printed for the record: ``pytest -s``)."""
    settled(sup)

    def same() -> bool:
        after = usage(sup)
        return after["threads"] == before["threads"] and after["fds"] <= before["fds"] + 1

    with contextlib.suppress(AssertionError):  # the asserts below say what differs
        poll(same, timeout_s=10)
    after = usage(sup)
    print(f"\n{sup.socket.parent.name}: before the test {before}, after {after}")
    assert after["threads"] == before["threads"], (before, after)
    assert after["fds"] <= before["fds"] + 1, (before, after)  # (the asking connection)
    assert after["rss_mib"] - before["rss_mib"] < 64, (before, after)


def served(sup: SupervisorProcess) -> None:
    """A well-behaved client gets correct answers from both models."""
    with Client(sup.socket, timeout_s=30) as client:
        top = client.model("classify", slots=1).infer(read_image(IMAGES / "coffee.png"))["top"]
        assert top[0]["label"] == "espresso"
        out = client.model("affine", slots=1).infer(np.ones((2, 4), dtype=np.float32))
        np.testing.assert_array_equal(out["y"], np.full((2, 4), 3.0, dtype=np.float32))


def status(sup: SupervisorProcess) -> SupervisorStatus:
    with Client(sup.socket) as client:
        return client.status()


# -- defects: a client that reads is never cut off; every message gets its answer ---------------


def test_a_heavy_client_that_reads_late_gets_every_answer(roomy: SupervisorProcess) -> None:
    """5 rings × 64 slots through ``Slot.submit``, read 3 s later: 320 answers, none lost
    (before the outbox, 87 of 320 came and the rest failed with 'lost the supervisor')."""
    with Client(roomy.socket, timeout_s=30) as client:
        handles = [client.model("affine", slots=64) for _ in range(5)]
        submitted = []
        for handle in handles:
            for _ in range(64):
                slot = handle.slot()
                slot.input("x", (1, 4))[...] = float(len(submitted))
                slot.submit()
                submitted.append(slot)
        time.sleep(3.0)  # the point of the test: nothing read for a while
        for n, slot in enumerate(submitted):
            assert slot.wait(timeout_s=60)["y"][0, 0] == 2.0 * n + 1.0
            slot.release()
        assert client.connected
    served(roomy)


def test_two_thousand_pipelined_pings_get_two_thousand_answers(roomy: SupervisorProcess) -> None:
    sock, reader = authenticated(roomy.socket)
    with sock:
        sock.sendall(b"".join(json_frame({"id": i, "op": "ping"}) for i in range(2000)))
        time.sleep(0.5)  # the scenario: nothing read for a moment, the answers pile up
        got = replies(sock, reader, 2000)
    assert [r["id"] for r in got] == list(range(2000))
    assert all(r["ok"] for r in got)
    served(roomy)


def test_a_reply_that_would_be_too_large_is_cut_and_still_sent(roomy: SupervisorProcess) -> None:
    """A 340 000-character model name: the NOT_FOUND reply quotes part of it and arrives, on
    the control-job thread (reload) as on the reactor (attach, load)."""
    with Client(roomy.socket, timeout_s=30) as client:
        for op in ("reload", "attach", "load", "unload"):
            with pytest.raises(NotFoundError, match=r"340002 characters") as caught:
                client.request(op, model=HUGE_NAME)
            assert len(caught.value.message) < 2000
        with pytest.raises(InvalidArgumentError, match="unknown control operation"):
            client.request(HUGE_NAME)
        # an id too large to echo is refused with an event (no reply could carry it)
        client._link.send_frame(json_frame({"id": HUGE_NAME, "op": "ping"}))
        event = client.next_event(timeout_s=30)
        assert isinstance(event, InvalidArgumentError) and "'id'" in event.message
        assert client.request("ping")["ok"]
    served(roomy)


def test_deeply_nested_json_is_a_clear_protocol_error(roomy: SupervisorProcess) -> None:
    with Client(roomy.socket) as client:
        client._link.send_frame(frame(FrameKind.JSON, b"[" * 200_000 + b"]" * 200_000))
        event = client.next_event(timeout_s=30)
        assert event is not None and "nested too deeply" in event.message
        client._link.wait_for(lambda: not client.connected, time.monotonic() + 30)
        assert not client.connected
    served(roomy)


def test_a_client_that_does_not_read_is_cut_off_at_its_unread_bound(
    roomy: SupervisorProcess,
) -> None:
    """Pipelined ``status`` requests, never read: cut off once its unread answers pass
    ``max_unread_bytes`` (8 MiB by default; the stall timeout, 30 s, is far off)."""
    greedy = Client(roomy.socket)
    request = json_frame({"id": 1, "op": "status"})
    started = time.monotonic()
    with pytest.raises(UnavailableError):
        for _ in range(100_000):
            greedy._link.send_frame(request)
    assert time.monotonic() - started < 25.0
    with Client(roomy.socket) as polite:  # the others were served all along
        for _ in range(20):
            polite.request("ping")
        assert polite.status().clients_cut_off >= 1
    greedy.close()
    served(roomy)


# -- limits: each one reached, and the supervisor still serving ---------------------------------


def test_an_image_that_would_cost_too_much_is_refused(roomy: SupervisorProcess) -> None:
    process = psutil.Process(roomy.pid)
    before = process.memory_info().rss
    with Client(roomy.socket, timeout_s=30) as client:
        classify = client.model("classify", slots=1)
        strip = np.zeros((1, 16_384, 3), dtype=np.uint8)  # 48 KiB: 224 × 3.7 M once resized
        with pytest.raises(InvalidArgumentError, match="max_resized_side 2048"):
            classify.infer(strip)
        with pytest.raises(InvalidArgumentError, match="max_resized_side"):
            classify.infer(strip.transpose(1, 0, 2).copy())
    assert process.memory_info().rss - before < 64 << 20
    served(roomy)


def test_unauthenticated_peers_hold_no_frame_buffers(roomy: SupervisorProcess) -> None:
    """200 peers that each announce a 1 MiB control frame before authenticating (which used to
    cost the supervisor 1 MiB each for 5 s): each is refused at once."""
    process = psutil.Process(roomy.pid)
    before = process.memory_info().rss
    peers = []
    for _ in range(200):
        sock = connected(roomy.socket)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused meanwhile
            sock.sendall(FRAME.pack(MAX_JSON_BYTES, FrameKind.JSON) + b"x" * (64 << 10))
        peers.append(sock)
    grown = process.memory_info().rss - before
    for sock in peers:
        with sock:
            reader = FrameReader()
            assert recv_frame(sock, reader)[0] is FrameKind.CHALLENGE
            refusal = parse_json(recv_frame(sock, reader)[1])  # its frame, or a newer peer
            assert refusal["event"] == "error", refusal
            assert any(
                why in str(refusal["message"])
                for why in ("authentication failed", "a newer peer needs the place")
            ), refusal
    print(f"\n200 unauthenticated peers: resident memory +{grown / 2**20:.1f} MiB")
    assert grown < 32 << 20
    served(roomy)


def test_a_client_attaching_ring_after_ring_stops_at_its_slot_bound(
    roomy: SupervisorProcess,
) -> None:
    """64 rings × 64 slots asked for (4 112 MiB of /dev/shm committed before): the default
    bound of 1024 slots per client stops it at the 17th ring."""
    with Client(roomy.socket) as client:
        for _ in range(16):
            client.model("affine", slots=64)
        with pytest.raises(ResourceExhaustedError, match=r"at most 1024 slots.*holds 1024"):
            client.model("affine", slots=64)
        shown = client.status()
        assert [c.slots for c in shown.clients if c.rings] == [1024]
    served(roomy)


def test_pipelined_slow_control_messages_add_no_thread(roomy: SupervisorProcess) -> None:
    """300 pipelined ``load`` messages: one control thread runs them in order; past the
    client's share of the queue they are answered RESOURCE_EXHAUSTED; every one is answered,
    and another client's message meanwhile is accepted."""
    process = psutil.Process(roomy.pid)
    served(roomy)
    threads_before = process.num_threads()
    sock, reader = authenticated(roomy.socket)
    with sock:
        sock.sendall(
            b"".join(json_frame({"id": i, "op": "load", "model": "affine"}) for i in range(300))
        )
        peak = process.num_threads()
        with Client(roomy.socket) as other:  # its share is its own: not refused for the flood
            assert other.request("load", model="affine", timeout_s=60)["ok"]
        got = replies(sock, reader, 300)
        peak = max(peak, process.num_threads())
    assert sorted(r["id"] for r in got) == list(range(300))
    ok = [r for r in got if r["ok"]]
    refused = [r for r in got if not r["ok"]]
    assert ok, got[:3]
    assert all(r["code"] == ResourceExhaustedError.code for r in refused)
    assert all("limits.control_queue_per_client: 8" in str(r["message"]) for r in refused)
    assert [r["id"] for r in ok] == sorted(r["id"] for r in ok)  # in the order they came
    assert peak <= threads_before
    poll(lambda: process.num_threads() <= threads_before)
    served(roomy)


def test_a_burst_of_connections_past_the_listen_backlog(roomy: SupervisorProcess) -> None:
    """64 clients connecting at once to a backlog of one: each retries and gets in."""
    errors: list[BaseException] = []
    start = threading.Barrier(64)

    def connect() -> None:
        try:
            start.wait()
            with Client(roomy.socket, timeout_s=30) as client:
                client.request("ping")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=connect) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    served(roomy)


def test_connections_past_the_cap_are_refused_politely(tight: SupervisorProcess) -> None:
    poll(lambda: len(status(tight).clients) == 0)
    held = [Client(tight.socket) for _ in range(6)]
    try:
        with pytest.raises(ResourceExhaustedError, match="at most 6 connections"):
            Client(tight.socket)
        held.pop().close()
        poll(lambda: _connects(tight))
    finally:
        for client in held:
            client.close()
    assert status(tight).connections_refused >= 1
    served(tight)


def _connects(sup: SupervisorProcess) -> bool:
    try:
        Client(sup.socket).close()
    except ResourceExhaustedError:
        return False
    return True


def test_before_authentication_only_the_response_is_read(tight: SupervisorProcess) -> None:
    """A peer that announces a 1 MiB control frame before authenticating is refused at the
    frame's 5-byte prefix, not after buffering it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    with sock:
        sock.connect(str(tight.socket))
        reader = FrameReader()
        assert recv_frame(sock, reader)[0] is FrameKind.CHALLENGE
        sock.sendall(FRAME.pack(1 << 20, FrameKind.JSON) + b"x" * 1000)
        kind, payload = recv_frame(sock, reader)
        message = parse_json(payload)["message"]
        assert kind is FrameKind.JSON
        assert message == "authentication failed: expected a RESPONSE frame, got JSON"
        with contextlib.suppress(ConnectionResetError):  # (closed with bytes of ours unread)
            assert sock.recv(1) == b""  # closed
    # one that sends nothing is closed at the authentication timeout (1 s here)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    with sock:
        sock.connect(str(tight.socket))
        reader = FrameReader()
        recv_frame(sock, reader)
        assert "authentication timed out" in recv_frame(sock, reader)[1].decode()
    served(tight)


def test_an_idle_connection_without_rings_is_closed(tight: SupervisorProcess) -> None:
    with Client(tight.socket) as idle, Client(tight.socket) as producer:
        affine = producer.model("affine", slots=1)
        idle._link.wait_for(lambda: not idle.connected, time.monotonic() + 30)
        assert not idle.connected
        assert affine.infer(np.ones((1, 4), dtype=np.float32))["y"][0, 0] == 3.0  # kept
    served(tight)


def test_a_client_that_stops_reading_is_cut_off_after_the_stall_timeout(
    tight: SupervisorProcess,
) -> None:
    """Its answers exceed its socket's buffer and it reads none of them for 1 s."""
    sock, _ = authenticated(tight.socket)
    with sock:
        sock.sendall(b"".join(json_frame({"id": i, "op": "models"}) for i in range(2000)))
        with Client(tight.socket) as other:
            poll(lambda: other.status().clients_cut_off >= 1, timeout_s=30)
    served(tight)


def test_slots_and_shared_memory_per_client_and_in_all(tight: SupervisorProcess) -> None:
    with Client(tight.socket) as first, Client(tight.socket) as second:
        first.model("affine", slots=64)
        with pytest.raises(ResourceExhaustedError, match=r"at most 100 slots.*holds 64.*64 more"):
            first.model("affine", slots=64)
        first.model("affine", slots=36)  # exactly the bound
        # classify commits 1 MiB of result area per slot: 3 of 4 MiB per client
        second.model("classify", slots=3)
        with pytest.raises(ResourceExhaustedError, match=r"at most 4\.0 MiB.*holds 3\.0 MiB"):
            second.model("classify", slots=2)
        with Client(tight.socket) as third:
            third.model("classify", slots=2)  # 5 of 6 MiB in all
            with pytest.raises(
                ResourceExhaustedError, match=r"at most 6\.0 MiB of ring memory in all"
            ):
                third.model("classify", slots=1)
        poll(lambda: first.status().shm_bytes < 4 << 20)  # third's rings were given back
    poll(lambda: status(tight).shm_bytes == 0)
    served(tight)


def test_slow_control_messages_past_the_queue_are_refused(tight: SupervisorProcess) -> None:
    sock, reader = authenticated(tight.socket)
    with sock:
        sock.sendall(b"".join(json_frame({"id": i, "op": "reload"}) for i in range(40)))
        got = replies(sock, reader, 40)
    refused = [r for r in got if not r["ok"]]
    assert len(got) == 40 and refused
    assert all("limits.control_queue: 4" in str(r["message"]) for r in refused)
    served(tight)


def test_out_of_file_descriptors_the_reactor_refuses_and_does_not_spin(
    tmp_path: Path, demo_config: object
) -> None:
    config = write_config(
        tmp_path, [], extra=[_affine_entry(tmp_path)], limits={"max_connections": 10_000}
    )
    probe = psutil.Process()
    with running_supervisor(config, max_fds=64) as sup:
        process = psutil.Process(sup.pid)
        free = 64 - process.num_fds()
        held: list[socket.socket] = []
        refusals: list[str] = []
        try:
            for _ in range(free + 20):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(30)
                sock.connect(str(sup.socket))
                kind, payload = recv_frame(sock, FrameReader())
                if kind is FrameKind.JSON:
                    refusals.append(json.loads(payload)["message"])
                    sock.close()
                else:
                    held.append(sock)
            assert refusals
            assert all("cannot take a connection now (Too many open files)" in r for r in refusals)
            cpu = process.cpu_times()
            time.sleep(1.0)  # the reactor must idle now, not spin on the listener
            spent = sum(process.cpu_times()[:2]) - sum(cpu[:2])
            assert spent < 0.5, spent
        finally:
            for sock in held:
                sock.close()
        poll(lambda: _connects(sup))
        with Client(sup.socket) as client:
            assert client.model("affine", slots=1).infer(np.ones((1, 4), dtype=np.float32))
            assert client.status().connections_refused >= len(refusals)
    assert probe.is_running()


def test_an_unexpected_error_is_internal_without_its_text(tmp_path: Path) -> None:
    """An executor bug (a slot dtype the wire cannot carry) makes attaching its model raise a
    ValueError: on the reactor for a loaded model, in a control job for one the attach loads.
    The client sees INTERNAL naming the operation and the model, never the exception's text;
    no segment is left behind, and the supervisor keeps serving."""
    broken = {"params": {"slot_dtype": "complex64"}}
    config = write_config(
        tmp_path, [], extra=[
            faulty_model("fine"), faulty_model("broken", **broken),
            faulty_model("lazy", preload=False, **broken),
        ],
    )  # fmt: skip
    with running_supervisor(config) as sup, Client(sup.socket, timeout_s=60) as client:
        segments = our_segments()
        for name in ("broken", "lazy"):
            with pytest.raises(InternalError) as caught:
                client.model(name)
            assert caught.value.message == (
                f"internal error in 'attach' for model {name!r}; the supervisor log has details"
            )
        shown = client.status()
        assert shown.models["lazy"].state == "READY"  # (the control job loaded it)
        assert shown.shm_bytes == 0 and our_segments() == segments
        assert client.request("ping")["ok"]
        out = client.model("fine", slots=1).infer(np.ones((2, 4), dtype=np.float32))
        np.testing.assert_array_equal(out["y"], np.full((2, 4), 3.0, dtype=np.float32))
