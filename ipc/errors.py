"""Status codes and the exception hierarchy shared by the engine, the wire and the client.

Every failure a caller can see carries one ``ErrorCode``; the code travels on the wire and the
client raises the matching exception class, so callers catch by meaning, not by message::

    DuomoError                    (base; .code, .message)
    ├── InvalidArgumentError      the request itself is wrong: bad image, shape, dtype, field
    ├── NotFoundError             no such model (or slot, or file)
    ├── UnavailableError          the model is not serving now (stopping, loading, failed)
    │   └── ModelChangedError     a reload changed the model's inputs/outputs: attach again
    ├── ResourceExhaustedError    a bounded queue is full; retry later
    ├── DeadlineExceededError     the request's deadline passed before it could run
    └── InternalError             a bug or a backend failure; details are in the supervisor log

Code that handles a request needs one ``except DuomoError as err: status = err.code`` and one
generic fallback that answers INTERNAL without leaking details.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Outcome of one request. Values are part of the wire format: never renumber."""

    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    UNAVAILABLE = 3
    RESOURCE_EXHAUSTED = 4
    DEADLINE_EXCEEDED = 5
    INTERNAL = 6
    MODEL_CHANGED = 7
    SUPERSEDED = 8  # a stream's newer frame took its place in the queue: an outcome, not a fault


class DuomoError(Exception):
    """Base of every error Duomo reports to a caller."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(DuomoError):
    """The request itself is wrong (a bad image, shape, dtype or field); sent again unchanged,
    it fails again."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFoundError(DuomoError):
    """No such model (or slot, or file): what the request names does not exist."""

    code = ErrorCode.NOT_FOUND


class UnavailableError(DuomoError):
    """The model is not serving now (stopping, loading, failed), or the supervisor is gone; a
    later try may succeed."""

    code = ErrorCode.UNAVAILABLE


class ModelChangedError(UnavailableError):
    """The model was reloaded with another slot layout; the client library re-attaches."""

    code = ErrorCode.MODEL_CHANGED


class ResourceExhaustedError(DuomoError):
    """A bounded queue is full (a model's queue, a client's slots or ring memory); retry later."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(DuomoError):
    """The request's deadline passed before it could run."""

    code = ErrorCode.DEADLINE_EXCEEDED


class SupersededError(DuomoError):
    """A stream's frame was answered without running: a newer frame of the same stream took its
    place in the model's queue (policy ``latest``). Not a fault: ``Stream.answers`` reports it
    as the outcome ``SUPERSEDED``; only a plain ``Slot.wait`` on a stream's slot raises it."""

    code = ErrorCode.SUPERSEDED


class InternalError(DuomoError):
    """A bug or a backend failure; the details are in the supervisor log, not in the message."""

    code = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[DuomoError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        UnavailableError,
        ResourceExhaustedError,
        DeadlineExceededError,
        InternalError,
        ModelChangedError,
        SupersededError,
    )
}


ECHO_CHARS = 200  # the most of a peer's value that a message quotes back


def echoed(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for a message that quotes what a peer sent, cut to ``limit`` characters
    (a 340 000-character model name must not make the reply too large to send)."""
    shown = repr(value)
    if len(shown) <= limit:
        return shown
    return f"{shown[:limit]}… ({len(shown)} characters)"


def error_for(code: int, message: str) -> DuomoError:
    """The exception instance for a status code received from the other side."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except (ValueError, KeyError):
        return InternalError(f"unknown status code {code}: {message}")
    return cls(message)
