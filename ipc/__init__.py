"""The wire between producers and the supervisor, and the error vocabulary both sides share.

Imported by producers and by the supervisor; it must never import ``supervisor`` or ``worker``
and needs nothing heavier than numpy, so a producer starts in milliseconds.
"""

from ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)

__all__ = [
    "DeadlineExceededError",
    "DuomoError",
    "ErrorCode",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
]
