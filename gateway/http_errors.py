"""The gateway's HTTP-level refusals, as opposed to the supervisor's ``ipc.errors`` codes:
``HttpError`` (a status and a message, answered as ``{"error": message}``) and ``only``, the
methods a route takes (405 for another).

Raised by the routes of ``gateway.http_front`` and by ``gateway.sources_api``; answered by
``http_front``.
"""

from __future__ import annotations


class HttpError(Exception):
    """An HTTP-level refusal (not an ``ipc.errors`` code): its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def only(method: str, *allowed: str) -> None:
    """HttpError 405 unless ``method`` is one of ``allowed``."""
    if method not in allowed:
        raise HttpError(405, f"this endpoint takes {' or '.join(allowed)}")
