"""The RTSP server of ``duomo camera-sim``: looping cameras made of video files, on GStreamer.

    /usr/bin/python3 video/camera_sim_server.py FILE… [--host H] [--port P] [--fps F]
        [--clock-offset-s S] [--no-sender-reports]

It owns the cameras: one RTSP path per file, ``/<stem>`` (the file's name without its suffix;
characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``; a second file with
the same stem gets ``/<stem>-2``), and beside it ``/<stem>/corrupt``, the same stream with
damaged slices. Every other path answers 404. Each client that connects gets its own copy of the
camera from the file's first frame, paced in real time and looping forever, as H.264 over RTP on
the RTSP connection (TCP) or UDP as the client asks.
``video.camera_sim`` (the ``duomo camera-sim`` command, in the virtual environment) runs this
file with ``exec`` under Debian's own python3, which has ``gi`` (the virtual environment does
not), so the pid its caller holds is this server's: SIGTERM or SIGINT stops it (exit 0), SIGKILL
too, and a new one can listen on the same port at once. It imports only ``gi`` and the standard
library; ``gi`` is imported by ``main`` (``load_gstreamer``), so that ``video.camera_sim`` can
import ``DEBIAN_PACKAGES`` from here without it.

**What is served.** Every file is read once, at the start, into memory as H.264 access units;
each client's pipeline is ``appsrc ! rtph264pay`` fed from that memory, with timestamps that
count on across the loops (``CameraFeed``), and the sinks of GStreamer's RTSP server pace it.
Threads: the GLib main loop runs the server; each client's media has a streaming thread of its
own, which calls its own ``CameraFeed`` (whose only state is its frame count). A
file is **passed through** when it is already what a camera sends: H.264, one slice per frame,
no B-frames (its frames' timestamps rise in decoding order), a key frame first. Anything else is
**re-encoded** once by ``x264enc`` with one slice per frame (``sliced-threads=false``: frame
threads keep the encoder parallel), no B-frames and a key frame every second. The tests' street
video is re-encoded: PyAV made it with slice threads, two slices per frame on a 2-core machine.
Measured on a 2-core machine: reading a camera-like file through takes 0.01 s; re-encoding the
street video (640x480, 300 frames at 15 fps) 1.0 s, and a 720p25 clip of 20 s 6.5 s (9 CPU
seconds, so encoding while serving would take about half a core per 720p camera, and eight
cameras the cores the models' benchmark measures); serving from memory costs 1.1 % of a core
per 720p25 client (eight clients for 10 s: 0.89 CPU seconds). So each file is encoded once, and
only when it must be: a camera-like file plays bit for bit. The price is memory, the whole
encoded clip (0.8 MB for the street video, 5 MB for the 720p clip): this serves clips, not
hour-long recordings.

**Frame rate.** Each frame lasts 1/F s: F is ``--fps`` or the file's own rate (its caps, else
its frames' count over their span); ``--fps`` re-times the file without dropping or repeating a
frame, so the clip plays faster or slower.

**Damaged slices** (``/<stem>/corrupt``): in one frame in ``DAMAGE_EVERY`` (frames 2, 7, 12 …
of each loop, unless it is a key frame) the second half of the slice's bytes is cut off, as when
the tail of a frame is lost on the network. FFmpeg's decoder conceals the missing macroblocks
and flags the frame: PyAV's ``frame.is_corrupt`` is True for those frames (in the tests, for
exactly those), with PyAV's default decoder threads for a live stream (slice threads) as with
frame threads or one thread (PyAV 18.1, FFmpeg 8). One slice per frame matters here too: in a
stream of several slices per frame, FFmpeg's slice threads turn its error resilience off, and a
damaged slice is neither concealed nor flagged (the street video, two slices, cut the same way:
0 of 60 frames flagged with slice threads, 60 of 60 with one thread or frame threads).
A client that joins where the file starts never sees a frame before a key frame, so the clean
path decodes with no frame flagged.

**Clock.** RTCP sender reports carry the NTP time of the server's clock, which is the host's
wall clock plus ``--clock-offset-s`` (``report_clock``: a ``GstSystemClock`` of the real-time
kind, calibrated by the offset and the NTP epoch, given to every media, with rtpbin's
``ntp-time-source`` = ``clock-time``), so a test can tell the camera's clock from its own; the
reports come about every second (``REPORT_INTERVAL_NS``). FFmpeg takes ``start_time_realtime``
(the wall-clock time of presentation time 0) from the first report. Measured on one host: a
frame's RTP packets arrive 0.7 ms (at most 6 ms) after the time their timestamp has on the
reports' clock; PyAV hands the frame over one frame interval later (FFmpeg's H.264 parser ends a
frame when the next one begins). ``--no-sender-reports`` turns RTCP off altogether
(``set_enable_rtcp(False)``, GStreamer 1.20): no report is sent, and the client has no camera
time.

**Output.** On stdout, once it listens, one line per served URL (the URL, then what it is) and
then ``READY URL URL …`` (every URL, separated by single spaces); what goes wrong goes to
stderr. Exit codes: 0 after SIGTERM or SIGINT, 1 when it cannot serve (the port is taken,
GStreamer or one of its plugins is missing: the line names the Debian packages), 2 for a file
that is missing or is not a video, or bad arguments.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from typing import Any

# What GStreamer needs on Debian (the Makefile's PACKAGES names them too, for ``make test``)
DEBIAN_PACKAGES = (
    "python3-gi",
    "gir1.2-gstreamer-1.0",
    "gir1.2-gst-rtsp-server-1.0",
    "gstreamer1.0-plugins-base",
    "gstreamer1.0-plugins-good",
    "gstreamer1.0-plugins-bad",
    "gstreamer1.0-plugins-ugly",
    "gstreamer1.0-libav",
)
ELEMENTS = ("appsrc", "appsink", "parsebin", "decodebin", "h264parse", "x264enc", "rtph264pay")
EXIT_OK, EXIT_CANNOT_SERVE, EXIT_BAD_INPUT = 0, 1, 2
DAMAGE_EVERY = 5  # one frame in five of /<stem>/corrupt has its slice cut short …
DAMAGED_PHASE = 2  # … frames 2, 7, 12 … of each loop, unless it is a key frame
NTP_EPOCH_OFFSET_S = 2_208_988_800  # 1900-01-01 to 1970-01-01: NTP counts from 1900
SECOND_NS = 1_000_000_000
# RTCP's least interval. GStreamer's default, 5 s, sends the first report 1.25 to 3.75 s after
# the start; with 1 s a client knows the camera's time within a second, and a test waits less
REPORT_INTERVAL_NS = SECOND_NS
NON_IDR_SLICE, IDR_SLICE = 1, 5  # NAL unit types
ACCESS_UNITS = "video/x-h264,stream-format=byte-stream,alignment=au"
# one slice per frame (frame threads keep it parallel), no B-frames, quality near the source's
ENCODER = (
    "x264enc name=encoder speed-preset=veryfast pass=qual quantizer=20 bframes=0 "
    "sliced-threads=false"
)
PATH_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]")

# GStreamer's modules, bound by ``load_gstreamer`` (``main``): importing this file needs no gi
GLib: Any = None
Gst: Any = None
GstRtspServer: Any = None


class ClipError(Exception):
    """A file that cannot be served: missing, not a video, or no frame in it."""


@dataclass(frozen=True)
class Clip:
    """One file as a camera: H.264 access units in decoding order, one frame each."""

    path: str  # the RTSP path, /<stem>
    file: Path
    units: list[Any]  # GLib.Bytes, Annex B, the SPS and PPS before each key frame
    damaged: list[Any]  # the same, one frame in DAMAGE_EVERY cut short
    frame_rate: Fraction
    how: str  # "passed through" or "re-encoded"

    def frame_start_ns(self, index: int) -> int:
        """When frame ``index`` (counting on across the loops) starts, from the first."""
        return index * SECOND_NS * self.frame_rate.denominator // self.frame_rate.numerator


@dataclass(frozen=True)
class AccessUnit:
    """One frame's H.264 as a pipeline gave it."""

    pts_ns: int | None
    data: bytes


def load_gstreamer() -> str | None:
    """Import GStreamer into this module's globals; what is missing, or None."""
    global GLib, Gst, GstRtspServer
    try:
        import gi  # type: ignore[import-not-found]  # (Debian's; not in the venv mypy checks)

        gi.require_version("Gst", "1.0")
        gi.require_version("GstRtspServer", "1.0")
        from gi.repository import GLib, Gst, GstRtspServer  # type: ignore[import-not-found]
    except (ImportError, ValueError) as err:  # ValueError: gi without a typelib
        return str(err)
    Gst.init(None)
    missing = [name for name in ELEMENTS if Gst.ElementFactory.find(name) is None]
    return f"GStreamer elements {', '.join(missing)}" if missing else None


# -- H.264 access units ------------------------------------------------------------------------


def nal_units(unit: bytes) -> list[tuple[int, int]]:
    """(start, end) of each NAL unit's bytes (after its start code) in an Annex B access unit.
    H.264's emulation prevention keeps 00 00 01 out of a NAL unit's bytes."""
    starts = []
    at = unit.find(b"\x00\x00\x01")
    while at >= 0:
        starts.append(at + 3)
        at = unit.find(b"\x00\x00\x01", at + 3)
    spans = []
    for index, start in enumerate(starts):
        end = starts[index + 1] - 3 if index + 1 < len(starts) else len(unit)
        while end > start and unit[end - 1] == 0:  # the next start code's leading zero
            end -= 1
        spans.append((start, end))
    return spans


def slice_types(unit: bytes) -> list[int]:
    """The NAL unit type of each slice of the access unit."""
    types = [unit[start] & 0x1F for start, _ in nal_units(unit)]
    return [kind for kind in types if kind in (NON_IDR_SLICE, IDR_SLICE)]


def damage(unit: bytes) -> bytes:
    """The access unit with the second half of its first slice's bytes cut off."""
    for start, end in nal_units(unit):
        if unit[start] & 0x1F in (NON_IDR_SLICE, IDR_SLICE):
            return unit[: start + (end - start) // 2] + unit[end:]
    return unit


def camera_like(units: list[AccessUnit]) -> bool:
    """Already what a camera sends: a key frame first, one slice per frame, no B-frames (the
    frames' timestamps rise in decoding order)."""
    stamps = [unit.pts_ns if unit.pts_ns is not None else -1 for unit in units]
    rising = stamps[0] >= 0 and all(a < b for a, b in pairwise(stamps))
    key_first = slice_types(units[0].data) == [IDR_SLICE]
    return rising and key_first and all(len(slice_types(unit.data)) == 1 for unit in units)


# -- reading a file ----------------------------------------------------------------------------


def read_clip(file: Path, path: str, fps: Fraction | None) -> Clip:
    """The file as a camera's access units: passed through, or re-encoded once."""
    if not file.exists():
        raise ClipError("no such file")
    if not file.is_file():
        raise ClipError("not a file")
    how = "passed through"
    try:
        units, caps = pull_units(file, f"parsebin ! h264parse ! {ACCESS_UNITS}")
        if not camera_like(units):
            raise ClipError("not as a camera sends it")
    except ClipError:  # not H.264, or not one slice a frame, or B-frames
        launch = f"decodebin ! videoconvert ! {ENCODER} ! h264parse ! {ACCESS_UNITS}"
        try:
            units, caps = pull_units(file, launch, fps)
        except ClipError as err:
            raise ClipError(f"not a video GStreamer can decode ({err})") from err
        how = "re-encoded"
    frames = [unit.data for unit in units]
    damaged = [
        damage(data)
        if index % DAMAGE_EVERY == DAMAGED_PHASE and IDR_SLICE not in slice_types(data)
        else data
        for index, data in enumerate(frames)
    ]
    return Clip(
        path=path,
        file=file,
        units=[GLib.Bytes.new(data) for data in frames],
        damaged=[GLib.Bytes.new(data) for data in damaged],
        frame_rate=fps or frame_rate_of(units, caps),
        how=how,
    )


def pull_units(
    file: Path, launch: str, fps: Fraction | None = None
) -> tuple[list[AccessUnit], Any]:
    """Run ``filesrc ! LAUNCH ! appsink`` to its end: the access units and the caps the sink
    got; ``ClipError`` when it fails. An encoder named ``encoder`` in LAUNCH makes a key frame
    every second at ``fps``, else at the file's rate."""
    pipeline = Gst.parse_launch(
        f"filesrc name=file ! {launch} ! appsink name=units sync=false emit-signals=true"
    )
    pipeline.get_by_name("file").set_property("location", str(file))  # (no quoting to get wrong)
    units: list[AccessUnit] = []
    caps: list[Any] = []

    def collect(sink: Any) -> Any:
        sample = sink.emit("pull-sample")
        buffer = sample.get_buffer()
        pts = None if buffer.pts == Gst.CLOCK_TIME_NONE else buffer.pts
        units.append(AccessUnit(pts, buffer.extract_dup(0, buffer.get_size())))
        caps[:] = [sample.get_caps()]
        return Gst.FlowReturn.OK

    pipeline.get_by_name("units").connect("new-sample", collect)
    encoder = pipeline.get_by_name("encoder")
    if encoder is not None:
        encoder.get_static_pad("sink").add_probe(
            Gst.PadProbeType.EVENT_DOWNSTREAM, key_frame_every_second, (encoder, fps)
        )
    pipeline.set_state(Gst.State.PLAYING)
    ended = Gst.MessageType.EOS | Gst.MessageType.ERROR
    message = pipeline.get_bus().timed_pop_filtered(Gst.CLOCK_TIME_NONE, ended)
    pipeline.set_state(Gst.State.NULL)
    if message.type == Gst.MessageType.ERROR:
        raise ClipError(message.parse_error()[0].message)
    if not units:
        raise ClipError("no video frame in it")
    return units, caps[0]


def key_frame_every_second(_pad: Any, info: Any, encoder_and_fps: Any) -> Any:
    """Set x264enc's key frame interval from the caps it is about to take (or ``--fps``)."""
    encoder, fps = encoder_and_fps
    event = info.get_event()
    if event.type == Gst.EventType.CAPS:
        found, num, den = event.parse_caps().get_structure(0).get_fraction("framerate")
        rate = fps or (Fraction(num, den) if found and num > 0 and den > 0 else 25)
        encoder.set_property("key-int-max", max(1, round(rate)))
    return Gst.PadProbeReturn.OK


def frame_rate_of(units: list[AccessUnit], caps: Any) -> Fraction:
    """The file's frame rate: its caps' when they have one, else its frames over their span."""
    found, num, den = caps.get_structure(0).get_fraction("framerate")
    if found and num > 0 and den > 0:
        return Fraction(num, den)
    stamps = [unit.pts_ns for unit in units if unit.pts_ns is not None]
    if len(stamps) > 1 and stamps[-1] > stamps[0]:
        return Fraction(len(stamps) - 1) * SECOND_NS / (stamps[-1] - stamps[0])
    return Fraction(25)  # a lone frame or no timestamps: a common camera's rate


# -- serving -----------------------------------------------------------------------------------


class CameraFeed:
    """One client's camera: pushes the clip's access units into its ``appsrc`` when asked,
    with timestamps that count on across the loops. Called on the appsrc's streaming thread."""

    def __init__(self, clip: Clip, units: list[Any]) -> None:
        self.clip = clip
        self.units = units
        self.index = 0  # frames pushed so far, over all loops

    def push_next(self, appsrc: Any, _length: int) -> None:
        buffer = Gst.Buffer.new_wrapped_bytes(self.units[self.index % len(self.units)])
        start_ns = self.clip.frame_start_ns(self.index)
        buffer.pts = buffer.dts = start_ns
        buffer.duration = self.clip.frame_start_ns(self.index + 1) - start_ns
        self.index += 1
        appsrc.emit("push-buffer", buffer)


def media_factory(clip: Clip, units: list[Any], clock: Any, sender_reports: bool) -> Any:
    """A factory that gives each client its own ``CameraFeed`` of ``units``."""
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch("( appsrc name=camera ! rtph264pay name=pay0 pt=96 config-interval=-1 )")
    factory.set_shared(False)  # each client plays the clip from its first frame
    factory.set_clock(clock)
    factory.set_enable_rtcp(sender_reports)
    rate = clip.frame_rate
    caps = Gst.Caps.from_string(f"{ACCESS_UNITS},framerate={rate.numerator}/{rate.denominator}")

    def configure(_factory: Any, media: Any) -> None:
        appsrc = media.get_element().get_by_name("camera")
        appsrc.set_property("caps", caps)
        appsrc.set_property("format", Gst.Format.TIME)
        appsrc.connect("need-data", CameraFeed(clip, units).push_next)
        media.get_element().get_parent().connect("deep-element-added", configure_rtcp)

    factory.connect("media-configure", configure)
    return factory


def configure_rtcp(_pipeline: Any, _bin: Any, element: Any) -> None:
    """The sender reports' NTP time is the media's clock (``report_clock``), and they come
    every second or so, the first within a second of the start."""
    factory = element.get_factory()
    name = factory.get_name() if factory is not None else ""
    if name == "rtpbin":
        element.set_property("ntp-time-source", "clock-time")
    elif name == "rtpsession":
        element.set_property("rtcp-min-interval", REPORT_INTERVAL_NS)


def report_clock(offset_s: float) -> Any:
    """A clock that reads the host's wall clock plus ``offset_s``, counted from NTP's epoch."""
    clock = Gst.SystemClock(clock_type=Gst.ClockType.REALTIME)
    shift_ns = NTP_EPOCH_OFFSET_S * SECOND_NS + round(offset_s * SECOND_NS)
    clock.set_calibration(0, shift_ns, 1, 1)  # external = internal + shift
    return clock


def camera_paths(files: list[Path]) -> list[str]:
    """``/<stem>`` per file, in order (a repeated stem gets ``-2``, ``-3`` and so on)."""
    paths: list[str] = []
    for file in files:
        stem = PATH_CHARACTERS.sub("_", file.stem) or "camera"
        path, copy = f"/{stem}", 1
        while path in paths:
            copy += 1
            path = f"/{stem}-{copy}"
        paths.append(path)
    return paths


def describe(clip: Clip, args: argparse.Namespace) -> str:
    """What a camera's line says after its URL."""
    size_mb = sum(unit.get_size() for unit in clip.units) / 1e6
    reports = "no RTCP" if args.no_sender_reports else f"RTCP clock {args.clock_offset_s:+g} s"
    return (
        f"{clip.file.name}: {len(clip.units)} frames at {float(clip.frame_rate):g} fps, looping, "
        f"{clip.how}, {size_mb:.1f} MB, {reports}"
    )


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="camera_sim_server.py", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument("--host", required=True)  # (the defaults are duomo camera-sim's)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fps", type=float, default=None)
    parser.add_argument("--clock-offset-s", type=float, default=0.0)
    parser.add_argument("--no-sender-reports", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_arguments(argv)
    missing = load_gstreamer()
    if missing is not None:
        print(
            f"duomo camera-sim: GStreamer's RTSP server is missing for {sys.executable} "
            f"({missing}): install the Debian packages {' '.join(DEBIAN_PACKAGES)}",
            file=sys.stderr,
        )
        return EXIT_CANNOT_SERVE
    server = GstRtspServer.RTSPServer()
    server.set_address(args.host)
    server.set_service(str(args.port))
    try:
        listening = server.create_source(None)  # bound now; clients wait while files are read
    except GLib.Error as err:
        print(
            f"duomo camera-sim: cannot listen on {args.host}:{args.port}: {err.message}",
            file=sys.stderr,
        )
        return EXIT_CANNOT_SERVE
    fps = Fraction(args.fps).limit_denominator(1001) if args.fps is not None else None
    clips = []
    for file, path in zip(args.files, camera_paths(args.files)):
        try:
            clips.append(read_clip(file, path, fps))
        except ClipError as err:
            print(f"duomo camera-sim: {file}: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    clock = report_clock(args.clock_offset_s)
    mounts = server.get_mount_points()
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address
    base = f"rtsp://{host}:{server.get_bound_port()}"
    urls = []
    for clip in clips:
        cameras = (
            (clip.path, clip.units, describe(clip, args)),
            (f"{clip.path}/corrupt", clip.damaged, f"the same, one frame in {DAMAGE_EVERY} cut"),
        )
        for path, units, about in cameras:
            mounts.add_factory(path, media_factory(clip, units, clock, not args.no_sender_reports))
            urls.append(base + path)
            print(f"{base}{path}  {about}", flush=True)
    listening.attach(None)
    loop = GLib.MainLoop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signum, loop.quit)
    print("READY " + " ".join(urls), flush=True)
    loop.run()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
