"""One connection's lending state: who reads its socket, the reactor or its model's idle worker
(``Loan``, held as ``Connection.loan``).

Defined here, apart from ``supervisor.process.lending`` which makes every change of it (the state
diagram and the rules: that module's docstring), so that ``supervisor.process.connection`` can hold
one without importing the lending that imports it. Read and changed under the connection's
``owner`` lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Reading(Enum):
    """Who reads a connection's socket: the reactor, or its model's idle worker (the state
    diagram: the module docstring). Its members are also module names (``LENT``, …): every
    request's path reads them, and an enum's attribute costs about 0.1 µs on Python 3.11."""

    REACTOR = "reactor"  # the reactor, in its epoll
    LENT = "lent"  # its model's idle worker, out of the reactor's epoll
    # the reactor, which must read it before it is lent again: the worker left it a control
    # message, several frames or part of one (``Loan.carried``), or EOF
    LEFT_TO_REACTOR = "left to reactor"


REACTOR, LENT, LEFT_TO_REACTOR = Reading


@dataclass(slots=True)
class Loan:
    """One connection's lending state (``Connection.loan``), read and changed under the
    connection's ``owner`` lock, by this module and by the reactor."""

    reading: Reading = REACTOR  # who reads its socket
    model: str | None = None  # the one model its rings attach (lendable), or None
    carried: bytes = b""  # what its idle worker read but only the reactor handles
    wanted: bool = False  # an idle worker could not borrow it: told once it can (``settled``)

    @property
    def lent(self) -> bool:
        """Its model's idle worker reads it (``status``)."""
        return self.reading is LENT
