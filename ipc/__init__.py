"""The wire between producers and the supervisor, and the error vocabulary both sides share.

A producer needs only this package (and numpy)::

    from duomo import Client, ResourceExhaustedError

    with Client() as client:                   # $DUOMO_SOCKET or the standard runtime dir
        result = client.model("ocr").infer(frame)

Imported by producers and by the supervisor; it must never import ``supervisor`` or ``worker``
and needs nothing heavier than numpy, so a producer starts in milliseconds. ``Client`` (with
``ModelHandle`` and ``Slot``) is imported from ``ipc.client`` on first use, so a process that
only needs the errors (``import ipc.errors``) does not load the client library. The records of
the supervisor's ``models`` and ``status`` replies (``ModelInfo``, ``SupervisorStatus`` …) are
in ``ipc.status_records``: ``client.models()`` returns the ``ModelInfo`` records and
``client.status()`` the ``SupervisorStatus`` (``.to_dict()``: the JSON on the wire).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from duomo.ipc.errors import (
    DeadlineExceededError,
    DuomoError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    ModelChangedError,
    NotFoundError,
    ResourceExhaustedError,
    SupersededError,
    UnavailableError,
)
from duomo.ipc.status_records import (
    ClientStatus,
    DeviceStatus,
    ModelInfo,
    ModelStatus,
    StatusRecordError,
    StreamStatus,
    SupervisorStatus,
)

if TYPE_CHECKING:
    from duomo.ipc.client import Client, ModelHandle, Slot
    from duomo.ipc.galleries import GalleryHandle
    from duomo.ipc.gallery_faces import EnrolmentError
    from duomo.ipc.gallery_records import GalleryInfo
    from duomo.ipc.stream import Filler, FrameTime, Stream, StreamAnswer

_FROM_CLIENT = ("Client", "ModelHandle", "Slot")
_FROM_STREAM = ("Filler", "FrameTime", "Stream", "StreamAnswer")
_FROM_GALLERIES = {  # a gallery's handle, record and enrolment error, by module
    "GalleryHandle": "duomo.ipc.galleries",
    "GalleryInfo": "duomo.ipc.gallery_records",
    "EnrolmentError": "duomo.ipc.gallery_faces",
}
# loaded on first use (``duomo`` forwards them here)
LAZY_NAMES = _FROM_CLIENT + _FROM_STREAM + tuple(_FROM_GALLERIES)

__all__ = [
    "Client",
    "ClientStatus",
    "DeadlineExceededError",
    "DeviceStatus",
    "DuomoError",
    "EnrolmentError",
    "ErrorCode",
    "Filler",
    "FrameTime",
    "GalleryHandle",
    "GalleryInfo",
    "InternalError",
    "InvalidArgumentError",
    "ModelChangedError",
    "ModelHandle",
    "ModelInfo",
    "ModelStatus",
    "NotFoundError",
    "ResourceExhaustedError",
    "Slot",
    "StatusRecordError",
    "Stream",
    "StreamAnswer",
    "StreamStatus",
    "SupersededError",
    "SupervisorStatus",
    "UnavailableError",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_CLIENT:
        return getattr(importlib.import_module("duomo.ipc.client"), name)
    if name in _FROM_STREAM:
        return getattr(importlib.import_module("duomo.ipc.stream"), name)
    if name in _FROM_GALLERIES:
        return getattr(importlib.import_module(_FROM_GALLERIES[name]), name)
    raise AttributeError(f"module 'ipc' has no attribute {name!r}")
