"""The producer's import is a contract: ``from duomo import …`` (and ``duomo.ipc``, the same
names) offers exactly these names, each resolves to the class documented in
docs/producer-api.md, and importing them loads no backend."""

from __future__ import annotations

import subprocess
import sys

import duomo
import duomo.ipc
from tests.conftest import ROOT

PRODUCER_API = [
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


def test_the_producer_api_is_pinned() -> None:
    assert sorted(duomo.__all__) == PRODUCER_API == sorted(duomo.ipc.__all__)
    for name in PRODUCER_API:
        assert getattr(duomo, name) is getattr(duomo.ipc, name), name
    assert duomo.Client.__module__ == "duomo.ipc.client"
    assert issubclass(duomo.ResourceExhaustedError, duomo.DuomoError)


def test_the_whole_producer_api_loads_no_backend() -> None:
    probe = (
        "import sys; from duomo import *; from duomo import Client; "
        "heavy = ('cv2', 'onnxruntime', 'acl', 'duomo.supervisor', 'duomo.worker', 'pydantic'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
