"""``duomo source``: the supervisor's camera fleet from the command line.

::

    duomo source add NAME URL (--model M … | --pipeline P) [--policy latest|fifo]
                     [--max-fps F] [--every N] [--weight W] [--slots N]
                     [--password-file FILE] [--failed-after S]
                     [--sink NAME …] [--emit answers|objects|both]
                     [--thumbnails none|left|appeared]
    duomo source remove NAME
    duomo source list [--json]          # a list of SourceStatus objects with --json
    duomo source show NAME [--json]
    duomo source tail NAME [--count N]  # its next N answers as JSON lines (duomo stream --out's)

Each is one control message to the running supervisor (``source_add``, ``source_remove``,
``sources``, ``source``: ``supervisor.process.control_messages``), except ``tail``, which asks the
supervisor which worker decodes the source and then reads that worker's tail socket
(``video.answer_tail``). Exit codes as every ``duomo`` command: 0, 1 (no supervisor, or it
failed), 2 (a bad argument, an unknown source, a name in use).

Registered by ``supervisor.operators.cli``'s parser (``add_parser``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duomo.ipc.client import Client
from duomo.ipc.command_line import EXIT_FAILED, EXIT_INVALID, EXIT_OK, exit_code
from duomo.ipc.errors import DuomoError
from duomo.ipc.runtime_dir import source_tail_path
from duomo.ipc.source_records import SourceStatus
from duomo.supervisor.operators import source_table


def add_parser(
    sub: Any, socket_arg: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """``duomo source …`` on the CLI's subparsers (``socket_arg`` adds ``--socket``)."""
    source = sub.add_parser("source", help="cameras the supervisor decodes: add, remove, list …")
    verbs = source.add_subparsers(dest="verb", required=True)

    add = verbs.add_parser("add", help="add a camera while the supervisor serves (kept)")
    add.add_argument("name")
    add.add_argument("url", help="rtsp:// rtmp:// http(s):// …, a file, /dev/videoN; ${VAR}: env")
    fed = add.add_mutually_exclusive_group(required=True)
    fed.add_argument("--model", action="append", metavar="M", help="a model to feed (repeat)")
    fed.add_argument("--pipeline", metavar="P", help="a pipeline to feed")
    add.add_argument("--policy", choices=("latest", "fifo"), default=None)
    add.add_argument("--max-fps", type=float, default=None, metavar="F")
    add.add_argument("--every", type=int, default=None, metavar="N", help="keep 1 frame in N")
    add.add_argument("--weight", type=float, default=None, metavar="W", help="[0.001, 1000]")
    add.add_argument(
        "--slots", type=int, default=None, metavar="N",
        help="frames in flight per model (3; 1: none sent is ever superseded)",
    )  # fmt: skip
    add.add_argument(
        "--password-file", default=None, metavar="FILE", help="the URL's password, read there"
    )
    add.add_argument(
        "--failed-after", type=float, default=None, metavar="S",
        help="failing this long (or 3 times with 401/403/404 or an unknown host): failed (30)",
    )  # fmt: skip
    add.add_argument(
        "--sink", action="append", metavar="NAME", dest="sinks",
        help="a sink of the config's sinks: its events go to (repeat)",
    )  # fmt: skip
    add.add_argument(
        "--emit", choices=("answers", "objects", "both"), default=None,
        help="what goes to its sinks (both where its pipeline has a tracker, else answers)",
    )  # fmt: skip
    add.add_argument(
        "--thumbnails", choices=("none", "left", "appeared"), default=None,
        help="a JPEG of the object's best frame in that object event (none)",
    )  # fmt: skip
    add.set_defaults(func=cmd_add)

    remove = verbs.add_parser("remove", help="remove a camera added at run time")
    remove.add_argument("name")
    remove.set_defaults(func=cmd_remove)

    listing = verbs.add_parser("list", help="every camera: state, figures, last error")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_list)

    show = verbs.add_parser("show", help="one camera")
    show.add_argument("name")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_show)

    tail = verbs.add_parser("tail", help="a camera's next answers, as JSON lines")
    tail.add_argument("name")
    tail.add_argument("--count", type=int, default=10, metavar="N", help="how many (10)")
    tail.set_defaults(func=cmd_tail)

    for verb in (add, remove, listing, show, tail):
        socket_arg(verb)
    return source


def _request(args: argparse.Namespace, op: str, **fields: Any) -> dict[str, Any] | int:
    """The reply to one control message, or the exit code after printing why it failed."""
    try:
        with Client(args.socket, timeout_s=30) as client:
            return client.request(op, **fields)
    except DuomoError as err:
        print(f"duomo source {args.verb}: {err.message}", file=sys.stderr)
        return exit_code(err)


def cmd_add(args: argparse.Namespace) -> int:
    given = {
        "name": args.name, "url": args.url, "models": args.model, "pipeline": args.pipeline,
        "policy": args.policy, "max_fps": args.max_fps, "every": args.every,
        "weight": args.weight, "password_file": args.password_file,
        "failed_after_s": args.failed_after, "slots": args.slots, "sinks": args.sinks,
        "emit": args.emit, "thumbnails": args.thumbnails,
    }  # fmt: skip
    reply = _request(args, "source_add", source={k: v for k, v in given.items() if v is not None})
    if isinstance(reply, int):
        return reply
    added = SourceStatus.from_dict(reply["source"])
    sinks = f", {added.emit} to {added.sinks}" if added.sinks else ""
    print(f"source {added.name} added: {added.url} -> {added.feeds}{sinks} (worker {added.worker})")
    return EXIT_OK


def cmd_remove(args: argparse.Namespace) -> int:
    reply = _request(args, "source_remove", name=args.name)
    if isinstance(reply, int):
        return reply
    print(f"source {args.name} removed")
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    reply = _request(args, "sources")
    if isinstance(reply, int):
        return reply
    sources = [SourceStatus.from_dict(s) for s in reply["sources"]]
    if args.json:
        print(json.dumps([s.to_dict() for s in sources], indent=2))
    elif not sources:
        print("no sources (add one: duomo source add NAME URL --model M)")
    else:
        print("\n".join(source_table.render(sources)))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    reply = _request(args, "source", name=args.name)
    if isinstance(reply, int):
        return reply
    shown = SourceStatus.from_dict(reply["source"])
    if args.json:
        print(json.dumps(shown.to_dict(), indent=2))
    else:
        width = max(len(key) for key in shown.to_dict())
        for key, value in shown.to_dict().items():
            print(f"{key:<{width}}  {'-' if value is None else value}")
    return EXIT_OK


def cmd_tail(args: argparse.Namespace) -> int:
    if args.count < 1:
        print("duomo source tail: --count must be at least 1", file=sys.stderr)
        return EXIT_INVALID
    reply = _request(args, "source", name=args.name)
    if isinstance(reply, int):
        return reply
    shown = SourceStatus.from_dict(reply["source"])
    if shown.worker_index is None:
        print(f"duomo source tail: {args.name} waits for a worker; try again", file=sys.stderr)
        return EXIT_FAILED
    path = source_tail_path(Path(args.socket), shown.worker_index)
    try:
        return _read_tail(path, args.name, args.count)
    except OSError as err:
        print(f"duomo source tail: {path}: {err.strerror or err}", file=sys.stderr)
        return EXIT_FAILED


def _read_tail(path: Path, name: str, count: int) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        conn.sendall(json.dumps({"source": name, "count": count}).encode() + b"\n")
        with conn.makefile("r", encoding="utf-8") as lines:
            for line in lines:
                if line.startswith('{"error"'):
                    print(f"duomo source tail: {json.loads(line)['error']}", file=sys.stderr)
                    return EXIT_FAILED
                sys.stdout.write(line)
                sys.stdout.flush()
    return EXIT_OK
