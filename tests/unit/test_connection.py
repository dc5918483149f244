"""A connection's send rule on a real socket pair: the outbox, its bounds, the stall rule and
corking (``supervisor.process.connection``); its stage, which only moves forward; every reply fits a
frame; the framing's own guards."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from duomo.ipc.errors import ErrorCode, echoed
from duomo.ipc.framing import FrameReader, ProtocolError, json_frame, parse_json
from duomo.ipc.wire import FRAME, MAX_JSON_BYTES, FrameKind, frame
from duomo.supervisor.process.connection import (
    CHALLENGED,
    CLOSING,
    CUT,
    DROPPED,
    OPEN,
    Connection,
    fitted_json,
)
from duomo.supervisor.process.limits import LimitsConfig, resolve_limits
from duomo.supervisor.process.loan import Loan


def make_limits(**overrides: object) -> object:
    return resolve_limits(LimitsConfig.model_validate(overrides))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # fills quickly
    ours.setblocking(False)
    theirs.settimeout(10)
    yield ours, theirs
    ours.close()
    theirs.close()


def connection(sock: socket.socket, blocked: list[Connection], **limits: object) -> Connection:
    return Connection(sock, 1, b"\0" * 32, make_limits(**limits), blocked.append, Loan())  # type: ignore[arg-type]


def frames(count: int, size: int = 100) -> list[bytes]:
    return [frame(FrameKind.JSON, (b"%06d" % i).ljust(size, b"x")) for i in range(count)]


def read_all(sock: socket.socket, nbytes: int) -> bytes:
    got = bytearray()
    while len(got) < nbytes:
        chunk = sock.recv(1 << 20)
        assert chunk, "the connection closed early"
        got += chunk
    return bytes(got)


def test_what_the_socket_does_not_take_waits_in_order_and_is_all_delivered(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    blocked: list[Connection] = []
    conn = connection(ours, blocked)
    sent = frames(2000)
    for data in sent:
        conn.send(data)
    assert conn.unread_bytes > 0 and conn.wants_write
    assert blocked == [conn]  # the reactor is asked to watch for room once
    expected = b"".join(sent)
    got = bytearray()
    while len(got) < len(expected):  # the client reads; the reactor flushes when it may
        got += theirs.recv(1 << 16)
        conn.flush()
    assert bytes(got) == expected
    assert conn.flush() and not conn.wants_write and conn.unread_bytes == 0
    assert not conn.closed


def test_past_its_unread_bytes_the_client_is_cut_off(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    conn = connection(ours, [], max_unread_bytes=64 << 10)
    for data in frames(5000):
        conn.send(data)
        if conn.closed:
            break
    assert conn.closed and conn.cut_reason is not None
    assert "max_unread_bytes (65536)" in conn.cut_reason
    assert conn.unread_bytes == 0  # what waited is dropped
    received = b""
    while chunk := theirs.recv(1 << 16):  # what the socket took, then EOF
        received += chunk
    assert 0 < len(received) < 5000 * 105


def test_past_its_unread_frames_the_client_is_cut_off(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, _ = pair
    conn = connection(ours, [], max_unread_frames=64)
    for data in frames(5000, size=8):
        conn.send(data)
    assert conn.closed and "max_unread_frames (64)" in str(conn.cut_reason)


def test_answers_waiting_without_progress_past_the_stall_timeout(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    conn = connection(ours, [], stall_timeout_s=2.0)
    assert not conn.stalled(time.monotonic() + 100)  # nothing waits: never stalled
    for data in frames(1000):
        conn.send(data)
    now = time.monotonic()
    assert not conn.stalled(now) and conn.stalled(now + 2.5)
    theirs.recv(1 << 16)  # the client reads some: the flush makes progress
    conn.flush()
    assert not conn.stalled(time.monotonic() + 1.5)


def test_corked_sends_go_out_in_one_write(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    conn = connection(ours, [])
    conn.cork()
    for data in frames(20, size=20):
        conn.send(data)
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):
        theirs.recv(1)  # nothing sent while corked
    conn.uncork()
    theirs.settimeout(10)
    assert theirs.recv(1 << 16) == b"".join(frames(20, size=20))  # one write, whole


def test_a_connections_stage_only_moves_forward(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    conn = connection(ours, [])
    assert conn.stage is CHALLENGED and not conn.authenticated
    assert conn.reader.only is FrameKind.RESPONSE  # nothing but the challenge's answer is read
    conn.authenticate()
    assert conn.stage is OPEN and conn.authenticated and conn.reader.only is None
    conn.close_after_read()  # it broke the protocol
    assert conn.stage is CLOSING and not conn.authenticated and not conn.closed
    conn.send(b"the error")  # (the reason still goes out)
    assert theirs.recv(64) == b"the error"
    conn.cut_off(None)
    assert conn.stage is CUT and conn.closed
    conn.close_after_read()
    conn.authenticate()
    assert conn.stage is CUT  # (no step back)
    conn.drop()
    assert conn.stage is DROPPED and conn.closed and conn.cut_reason is None


def test_a_peer_cut_before_it_authenticates_never_counts_as_authenticated(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, _ = pair
    conn = connection(ours, [])
    conn.cut_off("its challenge could not be sent")
    conn.authenticate()  # (a response read after the cut)
    assert conn.stage is CUT and not conn.authenticated
    assert conn.reader.only is FrameKind.RESPONSE


def test_a_reply_too_large_for_a_frame_becomes_an_error_with_its_id() -> None:
    reply = parse_json(fitted_json({"id": 7, "ok": True, "status": "x" * MAX_JSON_BYTES})[5:])
    assert reply["id"] == 7 and not reply["ok"]
    assert reply["code"] == ErrorCode.RESOURCE_EXHAUSTED
    assert str(MAX_JSON_BYTES) in reply["message"]
    odd = parse_json(fitted_json({"id": "a", "ok": True, "value": {1, 2}})[5:])
    assert odd == {
        "ok": False, "code": int(ErrorCode.INTERNAL), "id": "a",
        "message": "internal error: the reply could not be encoded",
    }  # fmt: skip


def test_echoed_values_are_cut() -> None:
    assert echoed("ocr") == "'ocr'"
    shown = echoed("m" * 340_000)
    assert len(shown) < 300 and shown.endswith("… (340002 characters)")


def test_a_reader_expecting_one_kind_refuses_another_at_its_prefix() -> None:
    reader = FrameReader(only=FrameKind.RESPONSE)
    with pytest.raises(ProtocolError, match="expected a RESPONSE frame, got JSON"):
        list(reader.feed(FRAME.pack(1 << 20, FrameKind.JSON)))  # 5 bytes: nothing buffered
    reader = FrameReader(only=FrameKind.RESPONSE)
    response = frame(FrameKind.RESPONSE, b"r" * 32)
    follows = json_frame({"op": "ping"})
    got = []
    for kind, _ in reader.feed(response + follows):  # pipelined after the response
        got.append(kind)
        reader.only = None  # (the reactor: authenticated)
    assert got == [FrameKind.RESPONSE, FrameKind.JSON]


def test_deeply_nested_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_json(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_json(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
