"""The video source: cameras and files decoded straight into a supervisor's slots as streams.

A producer process like the gateway, importing only ``duomo.ipc`` and ``duomo.sinks`` (and
PyAV, numpy): ``duomo stream`` runs it, and a producer that wants the loop in its own process
imports it from here::

    from duomo import Client
    from duomo.video import VideoSource

    with Client() as client, VideoSource("cam.mp4", "cam", models=["face"], client=client) as cam:
        for answer in cam.answers():
            print(answer.to_json())

Given a ``SupervisorLink`` instead of a ``Client``, the sources outlive the supervisor: they wait
for it and open their streams again after it restarts (``duomo stream`` does this).

The modules, one job each: ``locations`` (what a SOURCE names, stream names), ``media`` (PyAV
open, decode, pacing, the frame's time), ``conversion`` (the frame into the slot as RGB),
``backoff`` (the reconnect schedule), ``health`` (playing, reconnecting, failed: which errors are
permanent), ``supervisor_link`` (the shared connection, made again when the supervisor
restarts), ``figures`` (the source's counts and rates), ``source`` (``VideoSource``: the decode
thread), ``answer_lines`` (the JSON-lines contract), ``command`` (``duomo stream``),
``source_worker`` and ``answer_tail`` (a worker process of the supervisor's camera fleet, and
its ``duomo source tail`` socket), ``sink_events``, ``object_visits`` and ``thumbnails`` (a
source's answers and object events into its sinks' outboxes), ``camera_sim`` and
``camera_sim_server`` (``duomo camera-sim``) and ``preview`` (the live page). ``VideoSource``
and ``SupervisorLink`` are loaded on first use, so importing the package loads neither PyAV nor
OpenCV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duomo.video.source import VideoSource
    from duomo.video.supervisor_link import SupervisorLink

__all__ = ["SupervisorLink", "VideoSource"]


def __getattr__(name: str) -> Any:
    if name == "VideoSource":
        from duomo.video.source import VideoSource

        return VideoSource
    if name == "SupervisorLink":
        from duomo.video.supervisor_link import SupervisorLink

        return SupervisorLink
    raise AttributeError(f"module 'duomo.video' has no attribute {name!r}")
