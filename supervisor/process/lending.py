"""Lending: a model's idle worker reads its producers' connections itself.

While a model's worker has nothing queued, it borrows the connections whose rings all attach
its model: it disarms them in the reactor's epoll, waits in ``poll`` on them and its wake-up
eventfd, queues the lone notice that arrives on its own thread through the intake it shares
with the reactor (``supervisor.process.intake``), and gives them back before it runs the request. No
thread hands the request to another, which on this kind of machine costs a wake-up and a cold
start per request (docs/design-notes.md, "Lending").

**A connection's lending state** is its ``Loan`` (``Connection.loan``; defined in
``supervisor.process.loan``): who reads it (``Reading``), the one model its rings attach, what a
worker read that only the reactor handles, and whether a worker is waiting to borrow it. Every
change of ``Loan.reading`` is made here::

    REACTOR ─lend→ LENT ─give back→ REACTOR
                     └─give back with what only the reactor handles→ LEFT_TO_REACTOR
    LEFT_TO_REACTOR ─the reactor reads it→ REACTOR

What holds:

- **One reader of a socket at a time.** A connection's ``owner`` lock is held by whichever
  thread reads it or changes who does, and to attach and detach its rings.
- **The worker handles only a lone notice.** Anything else it read (a control message, several
  frames, part of one) it leaves to the reactor (``Loan.carried``), EOF it leaves in the
  socket, and the connection is not lent again until the reactor has read it
  (``LEFT_TO_REACTOR``). While the worker is busy, the reactor reads every notice as before.
- **Given back before the batch runs**, on the worker's thread, with one ``epoll_ctl``.
- **Not lent while answers wait** in its outbox: the reactor watches it for room, and wakes the
  worker that holds it to give it back (``call_workers``).
- A worker that cannot borrow a connection (another has it, or the reactor must read it first)
  marks it ``wanted``; its model's workers are woken once it can be lent (``settled``).

**The idle spin** (docs/design-notes.md, "Idle spin"). The wait polls without sleeping for up to
``idle_spin_us`` before it sleeps, only while that pays (the model's last wait ended within
that time) and only while no instance of the process is at work (``Activity``): a thread that
has just run an inference wakes from sleep 50–70 µs later than one that has not
(``tools/bench/experiments/bench_wake.py`` on the 2-vCPU host), and a producer that sends its
next request at once does so within about half a millisecond.

Who calls what: the engine owns the ``IdleSpin`` (``supervisor.core.idle_spin``), the idle
reader of every model's batcher (``worker.batcher.IdleReader``). The reactor builds the
``Lending`` with what it needs (its epoll, the intake, its ``read_soon``, and the engine's
``wake_idle`` to wake a model's idle workers), dedicates connections as rings attach and
detach, asks ``reactor_reads`` before it reads one, calls ``settled`` once it has read one or
emptied its outbox, and ``call_workers`` when a lent one has answers waiting. The supervisor
hands the reactor's ``Lending.read_when_idle`` to the ``IdleSpin`` while the reactor runs
(``IdleSpin.read_from``).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable

from duomo.supervisor.process.connection import DROPPED, Connection
from duomo.supervisor.process.intake import Intake
from duomo.supervisor.process.loan import LEFT_TO_REACTOR, LENT, REACTOR


class Lending:
    """The reactor's side: which connections each model's idle worker may borrow, and the
    borrowing itself (``read_when_idle``, on the worker's thread)."""

    def __init__(
        self,
        epoll: select.epoll,
        intake: Intake,
        read_soon: Callable[[Connection], None],
        wake: Callable[[str], None] | None,
    ) -> None:
        """``epoll``: the reactor's; ``intake``: the one the reactor reads with;
        ``read_soon``: has the reactor read a connection on its thread (``Reactor.read_soon``);
        ``wake``: wakes a model's idle workers (``Engine.wake_idle``; None: there are none)."""
        self._epoll = epoll
        self._intake = intake
        self._read_soon = read_soon
        self._wake = wake
        # model -> the connections whose rings all attach it (replaced whole, never changed in
        # place: an idle worker reads it from its own thread)
        self._lendable: dict[str, tuple[Connection, ...]] = {}

    # -- the reactor's side (its thread) ----------------------------------------------------

    def dedicate(self, conn: Connection) -> None:
        """Keep the lendable connections in step with the models ``conn``'s rings attach (a
        pipeline's: its first step's model, whose workers take its requests first)."""
        models = {a.reader for a in conn.attachments.values()}
        model = models.pop() if len(models) == 1 and not conn.closed else None
        loan = conn.loan
        if model == loan.model:
            return
        if loan.model is not None:
            rest = tuple(c for c in self._lendable.get(loan.model, ()) if c is not conn)
            if rest:
                self._lendable[loan.model] = rest
            else:
                self._lendable.pop(loan.model, None)
        if model is not None:
            self._lendable[model] = (*self._lendable.get(model, ()), conn)
        loan.model = model
        self.call_workers(conn)

    def reactor_reads(self, conn: Connection) -> bool:
        """With ``conn.owner`` held: whether the reactor may read ``conn`` now (not while it is
        lent, nor once dropped). It then reads what a worker left it first."""
        loan = conn.loan
        if loan.reading is LENT or conn.stage is DROPPED:
            return False
        loan.reading = REACTOR
        return True

    def settled(self, conn: Connection) -> None:
        """With ``conn.owner`` held: the reactor has read ``conn`` or emptied its outbox; a
        worker that wanted it is woken once it can be lent."""
        loan = conn.loan
        if loan.wanted and conn.reader.empty and not conn.closed and not conn.wants_write:
            loan.wanted = False
            self.call_workers(conn)

    def call_workers(self, conn: Connection) -> None:
        """Wake the idle workers of ``conn``'s model: to borrow it or, the one that has it, to
        give it back (answers wait to be sent on it)."""
        model = conn.loan.model
        if model is not None and self._wake is not None:
            self._wake(model)

    # -- the idle worker's side (its thread) --------------------------------------------------

    def read_when_idle(
        self,
        model: str,
        wake_fd: int,
        spin_s: float,
        keep_spinning: Callable[[], bool],
    ) -> bool:
        """As ``model``'s idle worker: borrow the connections lent to it, wait until one of them
        or ``wake_fd`` is readable, queue the notices that arrived, and give the connections
        back. False (at once) when there is none to borrow.

        The wait polls without sleeping for up to ``spin_s`` first, for as long as
        ``keep_spinning()`` is true, and only then sleeps (``poll_spinning_first``)."""
        borrowed: list[Connection] = []
        left: set[Connection] = set()  # those it read something of that is the reactor's
        try:
            borrowed.extend(conn for conn in self._lendable.get(model, ()) if self._borrow(conn))
            if not borrowed:
                return False
            poller = select.poll()
            poller.register(wake_fd, select.POLLIN)
            for conn in borrowed:
                poller.register(conn.fd, select.POLLIN)
            ready = {fd for fd, _ in poll_spinning_first(poller, spin_s, keep_spinning)}
            for conn in borrowed:
                if conn.fd in ready and self._read(conn):
                    left.add(conn)
        finally:
            for conn in borrowed:
                self._give_back(conn, conn in left)
        return True

    def _borrow(self, conn: Connection) -> bool:
        with conn.owner:  # (waits while the reactor reads it: this worker is idle anyway)
            if conn.closed:
                return False
            loan = conn.loan
            if loan.reading is not REACTOR or conn.wants_write or not conn.reader.empty:
                loan.wanted = True  # another worker or the reactor has it: told when done
                return False
            try:  # (one-shot: a hang-up meanwhile is reported once, not until it is read)
                self._epoll.modify(conn.fd, select.EPOLLONESHOT)
            except (OSError, ValueError):  # (ValueError: the reactor has stopped)
                return False
            loan.reading = LENT
            return True

    def _read(self, conn: Connection) -> bool:
        """Queue the notice that arrived on a borrowed connection (the intake); True when what
        arrived is the reactor's to handle instead (the data is carried over, EOF stays in the
        socket)."""
        with conn.owner:
            if conn.stage is DROPPED:
                return False
            data = self._intake.receive(conn)
            if data is None:
                return False
            conn.loan.carried = data  # (b"": EOF, left in the socket for the reactor to read)
            return True

    def _give_back(self, conn: Connection, left: bool) -> None:
        with conn.owner:
            loan = conn.loan
            loan.reading = LEFT_TO_REACTOR if left else REACTOR
            try:
                if conn.stage is DROPPED:
                    conn.sock.close()
                else:  # (one the supervisor stopped writing to: the reactor now reads its EOF)
                    out = select.EPOLLOUT if conn.wants_write else 0  # (answers wait for room)
                    self._epoll.modify(conn.fd, select.EPOLLIN | out)
                    if loan.carried:  # no event may come for it: the reactor reads it anyway
                        self._read_soon(conn)
                    elif loan.wanted:  # another model's worker wanted it meanwhile
                        loan.wanted = False
                        self.call_workers(conn)
            except (OSError, ValueError):
                pass


def poll_spinning_first(
    poller: select.poll, spin_s: float, keep_spinning: Callable[[], bool]
) -> list[tuple[int, int]]:
    """``poller``'s events: polled without sleeping for up to ``spin_s`` while
    ``keep_spinning()``, then in one poll that sleeps until there are some. Each turn of the
    spin yields the core (and the GIL) to whatever else is ready to run."""
    events: list[tuple[int, int]] = []
    if spin_s > 0:  # (no spin: straight to the poll that sleeps, one call as before)
        end = time.perf_counter() + spin_s
        while not (events := poller.poll(0)) and time.perf_counter() < end and keep_spinning():
            os.sched_yield()
    return events or poller.poll()
