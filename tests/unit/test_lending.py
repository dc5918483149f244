"""Lending on real sockets (``supervisor.process.lending``): an idle worker borrows its model's
connections, queues a lone notice itself and gives them back; anything else is left to the
reactor; a connection is never read by two threads, nor lent while answers wait on it."""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from duomo.supervisor.process.connection import Connection
from duomo.supervisor.process.lending import Lending
from duomo.supervisor.process.loan import LEFT_TO_REACTOR, LENT, REACTOR, Loan
from tests.conftest import poll
from tests.unit.test_connection import make_limits

NOTICE = b"N"  # what the fake ``receive`` takes for a lone notice


class Intake:
    """The intake as lending uses it: one read, which queues a lone notice (``NOTICE``)."""

    def __init__(self) -> None:
        self.queued: list[Connection] = []  # the notices queued, by connection

    def receive(self, conn: Connection) -> bytes | None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return None
        if data == NOTICE:
            self.queued.append(conn)
            return None
        return data


class Reactor:
    """The reactor as lending sees it: its epoll, its intake, its reads it is asked for."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.intake = Intake()
        self.queued = self.intake.queued
        self.soon: list[Callable[[], None]] = []
        self.read_by_reactor: list[Connection] = []
        self.woken: list[str] = []  # the models whose idle workers were woken
        self.lending = Lending(self.epoll, self.intake, self.read_soon, self.woken.append)  # type: ignore[arg-type]
        self.peers: list[socket.socket] = []
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # the worker's

    def read_soon(self, conn: Connection) -> None:
        self.soon.append(lambda: self.read_by_reactor.append(conn))

    def connection(self, model: str = "m") -> Connection:
        """An authenticated connection whose one ring attaches ``model``, in the epoll."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self.peers.append(theirs)
        conn = Connection(ours, len(self.peers), b"\0" * 32, make_limits(), lambda c: None, Loan())  # type: ignore[arg-type]
        conn.authenticate()
        conn.attachments[1] = SimpleNamespace(model_name=model, reader=model)  # type: ignore[assignment]
        self.epoll.register(conn.fd, select.EPOLLIN)
        self.lending.dedicate(conn)
        return conn

    def idle_read(self, model: str = "m") -> bool:
        """One wait of ``model``'s idle worker (without a spin)."""
        return self.lending.read_when_idle(model, self.wake_fd, 0.0, lambda: False)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.epoll.close()
        os.close(self.wake_fd)


@pytest.fixture
def reactor() -> Iterator[Reactor]:
    r = Reactor()
    yield r
    r.close()


def reported(reactor: Reactor, conn: Connection) -> bool:
    """Whether the reactor's epoll reports ``conn`` readable now (it is armed again)."""
    return any(fd == conn.fd for fd, _ in reactor.epoll.poll(0))


def test_a_connection_attached_to_one_model_wakes_that_models_workers(reactor: Reactor) -> None:
    reactor.connection("m")
    assert reactor.woken == ["m"]
    assert not reactor.idle_read("other")  # none of its connections: it sleeps in its batcher


def test_the_idle_worker_queues_a_lone_notice_and_gives_the_connection_back(
    reactor: Reactor,
) -> None:
    conn = reactor.connection()
    reactor.peers[0].send(NOTICE)
    assert reactor.idle_read()
    assert reactor.queued == [conn] and reactor.soon == []
    assert conn.loan.reading is REACTOR
    reactor.peers[0].send(NOTICE)
    assert reported(reactor, conn)  # back in the reactor's epoll


def test_anything_else_is_left_to_the_reactor(reactor: Reactor) -> None:
    conn = reactor.connection()
    reactor.peers[0].send(b"a control message")
    assert reactor.idle_read()
    assert reactor.queued == []
    assert conn.loan.reading is LEFT_TO_REACTOR and conn.loan.carried == b"a control message"
    assert len(reactor.soon) == 1  # the reactor reads it even if no event comes
    reactor.soon.pop()()
    assert reactor.read_by_reactor == [conn]
    # not lent again until the reactor has read it; the worker that wanted it is told then
    assert not reactor.idle_read() and conn.loan.wanted
    reactor.woken.clear()
    with conn.owner:
        assert reactor.lending.reactor_reads(conn)
        conn.loan.carried = b""  # (what the reactor's read does with it)
        reactor.lending.settled(conn)
    assert conn.loan.reading is REACTOR and not conn.loan.wanted and reactor.woken == ["m"]


def test_eof_stays_in_the_socket_for_the_reactor(reactor: Reactor) -> None:
    conn = reactor.connection()
    reactor.peers[0].close()
    assert reactor.idle_read()
    assert conn.loan.reading is LEFT_TO_REACTOR and conn.loan.carried == b""
    assert reactor.soon == []  # the epoll reports the EOF itself
    assert reported(reactor, conn)


def test_a_connection_with_answers_waiting_is_not_lent(reactor: Reactor) -> None:
    conn = reactor.connection()
    conn.wants_write = True  # (its outbox waits for room: the reactor watches it)
    assert not reactor.idle_read()
    assert conn.loan.wanted and conn.loan.reading is REACTOR


def test_the_wake_fd_ends_the_wait(reactor: Reactor) -> None:
    conn = reactor.connection()
    waited: list[bool] = []
    worker = threading.Thread(target=lambda: waited.append(reactor.idle_read()))
    worker.start()
    poll(lambda: conn.loan.reading is LENT)
    os.eventfd_write(reactor.wake_fd, 1)  # (what the batcher does when a request is queued)
    worker.join(10)
    assert waited == [True] and reactor.queued == [] and conn.loan.reading is REACTOR


def test_a_lent_connection_is_not_lent_again_and_its_wanter_is_told(reactor: Reactor) -> None:
    conn = reactor.connection()
    worker = threading.Thread(target=reactor.idle_read)
    worker.start()
    poll(lambda: conn.loan.reading is LENT)
    assert not reactor.idle_read()  # (a worker of the model's next generation, say)
    assert conn.loan.wanted
    reactor.woken.clear()
    reactor.peers[0].send(NOTICE)
    worker.join(10)
    assert reactor.queued == [conn]
    assert not conn.loan.wanted and reactor.woken == ["m"]


def test_one_dropped_while_lent_is_closed_as_it_is_given_back(reactor: Reactor) -> None:
    conn = reactor.connection()
    worker = threading.Thread(target=reactor.idle_read)
    worker.start()
    poll(lambda: conn.loan.reading is LENT)
    with conn.owner:  # (the reactor's ``_drop``: a lent socket is its worker's to close)
        conn.drop()
        assert not reactor.lending.reactor_reads(conn)
    worker.join(10)
    assert reactor.queued == [] and conn.sock.fileno() == -1
