"""Where a video comes from: a file, a network URL or a V4L2 device, and the stream name it gets.

``parse_location`` turns what the user typed (``duomo stream SOURCE…``, or a producer's
``VideoSource(url_or_path, …)``) into a ``SourceLocation``: what PyAV opens, with which format
and options, whether it is live (a camera or a network feed: never paced, reconnected when it
drops) or a file (paced at its own frame rate, ended or looped at its end). ``stream_names``
derives the default stream names: a file's stem, a URL's host and path, a device's name, made
unique by a ``-2``, ``-3`` … suffix. Called by ``video.source`` and ``video.command``; imports
nothing heavier than the standard library.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from duomo.ipc.source_urls import DEVICE_PATTERN, NETWORK_SCHEMES, mask_url

MAX_STREAM_NAME = 64  # the supervisor's bound on a stream name
# a live network source that sends nothing for this long is treated as dropped
NETWORK_READ_TIMEOUT_S = 5.0
NETWORK_OPEN_TIMEOUT_S = 10.0


class SourceKind(enum.Enum):
    """What a location names: it decides pacing (files only) and reconnecting (live only)."""

    FILE = "file"
    NETWORK = "network"
    DEVICE = "device"


class SourceError(ValueError):
    """A source that can never play: an unknown scheme, a missing or undecodable file."""


@dataclass(frozen=True)
class SourceLocation:
    """What ``av.open`` gets for one source, and how the source treats it."""

    text: str  # as the user wrote it, its password masked (what messages show)
    kind: SourceKind
    url: str  # what PyAV opens (a path for files and devices)
    format: str | None = None  # a demuxer to force ("v4l2" for devices)
    options: dict[str, str] = field(default_factory=dict)  # FFmpeg options

    @property
    def live(self) -> bool:
        """Live sources are never paced and are reconnected when they drop or fail to open."""
        return self.kind is not SourceKind.FILE

    @property
    def timeout_s(self) -> tuple[float, float] | None:
        """PyAV's (open, read) timeouts: a stopped server must not block a read for ever."""
        if self.kind is SourceKind.NETWORK:
            return (NETWORK_OPEN_TIMEOUT_S, NETWORK_READ_TIMEOUT_S)
        return None


def parse_location(text: str) -> SourceLocation:
    """The location ``text`` names; ``SourceError`` for an unknown URL scheme or a file that
    does not exist (a network source is only tried when it plays)."""
    if DEVICE_PATTERN.match(text):
        return SourceLocation(text, SourceKind.DEVICE, text, format="v4l2")
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme:
        if scheme == "file":
            return _file(text, urlsplit(text).path)
        if scheme not in NETWORK_SCHEMES:
            known = ", ".join(f"{s}://" for s in NETWORK_SCHEMES)
            raise SourceError(
                f"{mask_url(text)}: unknown scheme {scheme}:// (known: {known}, a file)"
            )
        options = {"rtsp_transport": "tcp"} if scheme.startswith("rtsp") else {}
        return SourceLocation(mask_url(text), SourceKind.NETWORK, text, options=options)
    return _file(text, text)


def _file(text: str, path: str) -> SourceLocation:
    if not Path(path).is_file():
        raise SourceError(f"{text}: no such file")
    return SourceLocation(text, SourceKind.FILE, path)


def default_name(location: SourceLocation) -> str:
    """A readable stream name: the file's stem, the URL's host and path, the device's name."""
    if location.kind is SourceKind.FILE:
        name = Path(location.url).stem
    elif location.kind is SourceKind.DEVICE:
        name = Path(location.url).name
    else:
        parts = urlsplit(location.url)
        name = (parts.hostname or "") + parts.path.rstrip("/")
    name = "".join(c if c.isprintable() and not c.isspace() else "_" for c in name)
    return name[:MAX_STREAM_NAME] or "stream"


def stream_names(
    locations: Sequence[SourceLocation], given: Sequence[str | None] = ()
) -> list[str]:
    """One name per location: the ``given`` one (by position; None or missing: the default),
    made unique with a ``-N`` suffix (the supervisor refuses two live streams of one name)."""
    names: list[str] = []
    for index, location in enumerate(locations):
        chosen = given[index] if index < len(given) else None
        base = chosen or default_name(location)
        name, count = base, 1
        while name in names:
            count += 1
            suffix = f"-{count}"
            name = base[: MAX_STREAM_NAME - len(suffix)] + suffix
        names.append(name)
    return names
