"""``duomo camera-sim``: RTSP cameras made of video files, to try streams without a camera.

``run(args)`` is the command's body (``supervisor.operators.cli`` parses the arguments and calls
it): it finds Debian's own python3 (``DEBIAN_PYTHON``, which has ``gi``; the virtual environment
does not) and replaces this process with the GStreamer program ``video/camera_sim_server.py`` under
it (``os.execv``), so that whoever started ``duomo camera-sim`` holds the server's own pid: a
signal stops the server itself and nothing is left behind listening on the port, even after
SIGKILL. That program serves ``/<stem>`` and ``/<stem>/corrupt`` per file, looping, prints a
line per URL and ``READY URL …``, and runs until SIGTERM or SIGINT; its docstring says how and
why. Without Debian's python3 this says which packages to install and returns 1; the program
itself says so when GStreamer or one of its plugins is missing.

The argument types below (``frame_rate``, ``port_number``, ``clock_offset``) are the command's
checks, used by ``supervisor.operators.cli``; the defaults are there too. Imports nothing of Duomo's
but its program's constants (that file imports ``gi`` only when it runs).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from duomo.ipc.command_line import checked_number
from duomo.video.camera_sim_server import DEBIAN_PACKAGES, EXIT_CANNOT_SERVE

DEBIAN_PYTHON = Path("/usr/bin/python3")
SERVER = Path(__file__).resolve().with_name("camera_sim_server.py")
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8554  # RTSP's usual port when 554 needs root
MAX_FPS = 1000.0


def server_arguments(args: argparse.Namespace) -> list[str]:
    """The GStreamer program's command line for the parsed ``duomo camera-sim`` arguments."""
    argv = [*(str(path) for path in args.files), "--host", args.host, "--port", str(args.port)]
    if args.fps is not None:
        argv += ["--fps", repr(args.fps)]
    argv += ["--clock-offset-s", repr(args.clock_offset_s)]
    if args.no_sender_reports:
        argv.append("--no-sender-reports")
    return argv


def run(args: argparse.Namespace) -> int:
    """Become the camera server; return only when it cannot start (1)."""
    if not os.access(DEBIAN_PYTHON, os.X_OK):
        print(
            f"duomo camera-sim runs GStreamer's RTSP server under Debian's {DEBIAN_PYTHON}, "
            f"which is missing: install the Debian packages python3 {' '.join(DEBIAN_PACKAGES)}",
            file=sys.stderr,
        )
        return EXIT_CANNOT_SERVE
    sys.stdout.flush()
    sys.stderr.flush()
    # -I: isolated from this environment's PYTHONPATH and user site, which are not for it
    command = [str(DEBIAN_PYTHON), "-I", str(SERVER), *server_arguments(args)]
    try:
        os.execv(command[0], command)
    except OSError as err:
        print(f"duomo camera-sim: cannot run {DEBIAN_PYTHON}: {err}", file=sys.stderr)
    return EXIT_CANNOT_SERVE


# the options' argparse types (``supervisor.operators.cli`` registers the command)
frame_rate = checked_number(float, lambda f: 0 < f <= MAX_FPS, f"above 0 and at most {MAX_FPS:g}")
port_number = checked_number(int, lambda p: 0 <= p <= 65535, "a port from 0 to 65535")
clock_offset = checked_number(float, math.isfinite, "a number of seconds")
