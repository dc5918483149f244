"""Duomo (多模): one supervisor process that serves many models on one accelerator.

The one package Duomo installs. Its subpackages are the design card's folders, which stand at
the root of the repository (``duomo/`` holds links to them; a wheel holds them inside it):
``duomo.ipc`` (the wire and the producer's client), ``duomo.supervisor``, ``duomo.worker`` and
``duomo.gateway``. A producer needs only this::

    from duomo import Client, ResourceExhaustedError

    with Client() as client:                   # $DUOMO_SOCKET or the standard runtime dir
        result = client.model("ocr").infer(frame)

``Client`` (with ``ModelHandle`` and ``Slot``) is loaded on first use, so a process that needs
only the errors does not load the client library; nothing here loads a backend.
"""

from __future__ import annotations

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

__all__ = [  # the same names as duomo.ipc's (tests/unit/test_producer_api.py pins them)
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
    from duomo import ipc

    if name in ipc.LAZY_NAMES:
        return getattr(ipc, name)
    raise AttributeError(f"module 'duomo' has no attribute {name!r}")
