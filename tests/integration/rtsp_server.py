"""An RTSP camera for the video source's tests: GStreamer's RTSP server serving an H.264 MP4.

    /usr/bin/python3 tests/integration/rtsp_server.py VIDEO.mp4 --port PORT [--path /cam]

Run by Debian's own python3 (which imports ``gi``; the virtual environment does not): the
packages gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-good (qtdemux, rtph264pay) and
gstreamer1.0-plugins-bad (h264parse). Each client that connects gets the file from its start,
paced in real time, without re-encoding (``filesrc ! qtdemux ! h264parse ! rtph264pay``), over
RTP on the RTSP connection (TCP) or UDP as the client asks. Prints ``READY rtsp://…`` on stdout
once it listens; runs until SIGTERM or SIGINT. Imports nothing of Duomo's.
"""

from __future__ import annotations

import argparse
import signal
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("video")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/cam")
    args = parser.parse_args()
    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    location = args.video.replace("\\", "\\\\").replace('"', '\\"')
    factory.set_launch(
        f'( filesrc location="{location}" ! qtdemux ! h264parse '
        "! rtph264pay name=pay0 pt=96 config-interval=-1 )"
    )
    factory.set_shared(False)  # each client plays the file from its start
    server.get_mount_points().add_factory(args.path, factory)
    if server.attach(None) == 0:
        print(f"cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1
    loop = GLib.MainLoop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signum, loop.quit)
    print(f"READY rtsp://127.0.0.1:{args.port}{args.path}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
