"""Running real supervisor processes for the integration tests, and finding what they leave.

``running_supervisor`` starts ``duomo start --foreground`` as a child process on a private
socket, waits for its readiness line (no sleeping), and always stops it afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml

from duomo.ipc.framing import FrameReader, answer, parse_json, recv_frame
from duomo.ipc.readiness import read_ready_line
from duomo.ipc.runtime_dir import read_key
from duomo.ipc.wire import FrameKind, frame
from tests.conftest import DEMO_CONFIG, ROOT
from tests.conftest import poll as poll  # (the integration tests import it from here)

READY_TIMEOUT_S = 180.0


@dataclass
class SupervisorProcess:
    process: subprocess.Popen[bytes]
    socket: Path

    @property
    def pid(self) -> int:
        return self.process.pid


def our_segments() -> set[str]:
    """Every ring this test process and its children (the supervisors and producers it
    started) hold, as "pid:inode" of each mapped or open ``memfd:duomo-ring``, and any
    ``duomo-`` name in /dev/shm that one of them maps or holds open, as its path (there should
    never be one: rings have no name). Only these processes are looked at, never the whole of
    /dev/shm: another program's segments, or another test's, are not this test's business."""
    held: set[str] = set()
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(OSError, psutil.Error):
            for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines():
                if "/memfd:duomo-ring" in line:
                    held.add(f"{process.pid}:{line.split()[4]}")
                elif (named := _named_segment(line.split(maxsplit=5)[-1])) is not None:
                    held.add(named)
            for fd in os.listdir(f"/proc/{process.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{process.pid}/fd/{fd}")
                    if target.startswith("/memfd:duomo-ring"):
                        held.add(f"{process.pid}:fd{fd}")
                    elif (named := _named_segment(target)) is not None:
                        held.add(named)
    return held


def _named_segment(path: str) -> str | None:
    """``path`` (of a mapping or a descriptor) as "/dev/shm/duomo-…" if it is one of those."""
    path = path.removesuffix(" (deleted)")
    return path if path.startswith("/dev/shm/duomo-") else None


def short_socket_dir() -> Path:
    """AF_UNIX paths are limited to 107 bytes: keep sockets out of pytest's long tmp paths."""
    return Path(tempfile.mkdtemp(prefix="duomo-t-", dir="/tmp"))


def write_config(
    folder: Path,
    models: list[str],
    extra: list[dict[str, object]] = (),  # type: ignore[assignment]
    overrides: dict[str, dict[str, object]] | None = None,
    **top: object,
) -> Path:
    """The demo config with only ``models`` (each updated by ``overrides[name]``), the
    ``extra`` model entries after them, and top-level keys set from ``top``. A gallery model
    (``people``) gets its own file in ``folder``: a test enrols only in its own."""
    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["model_root"] = str(ROOT / "models")
    for model in raw["models"]:
        if model["task"] == "gallery":
            model["file"] = str(folder / f"{model['name']}.gallery")
    chosen = [{**m, **(overrides or {}).get(m["name"], {})} for m in raw["models"]]
    raw["models"] = [m for m in chosen if m["name"] in models] + list(extra)
    raw.pop("gateway", None)  # (its fixed ports): a test that wants one passes gateway=...
    raw.pop("metrics", None)  # (the same): metrics={"http": ...}
    raw.pop("pipelines", None)  # (over models a test may leave out): pipelines=[...]
    raw.update(top)
    path = folder / "supervisor.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


FAULTY_TASK = "tests.fakes.faulty_executor:FaultyExecutor"


def faulty_model(name: str, max_batch: int = 4, **entry: object) -> dict[str, object]:
    """A config entry for the test-only faulty executor (``params`` go in ``entry``)."""
    return {"name": name, "task": FAULTY_TASK, "files": {}, "max_batch": max_batch, **entry}


def duomo(
    socket_path: Path, *args: str, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run one ``duomo`` command against the supervisor at ``socket_path``."""
    return subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", *args, "--socket", str(socket_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def affine_model(path: Path) -> Path:
    """y = 2x + 1 and s = sum(x) per row, float32, dynamic batch: a checkable raw model."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 1])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["x2"]),
            helper.make_node("Add", ["x2", "one"], ["y"]),
            helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
        ],
        "affine",
        [x],
        [y, s],
        initializer=[two, one, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@contextlib.contextmanager
def running_supervisor(
    config: Path,
    max_fds: int | None = None,
    socket_path: Path | None = None,
    log: Path | None = None,
) -> Iterator[SupervisorProcess]:
    """``max_fds``: the supervisor process's file-descriptor limit (soft and hard);
    ``socket_path``: where it listens (default: in a new private folder, removed after);
    ``log``: a file its log (and its children's) is appended to (default: this process's)."""
    folder = short_socket_dir() if socket_path is None else socket_path.parent
    socket_path = socket_path or folder / "duomo.sock"
    read_fd, write_fd = os.pipe()
    with contextlib.ExitStack() as logging:
        output = logging.enter_context(log.open("a")) if log is not None else None
        process = subprocess.Popen(
            [
                sys.executable, "-m", "duomo.supervisor", "start", "-c", str(config),
                "--socket", str(socket_path), "--foreground", "--ready-fd", str(write_fd),
            ],
            cwd=ROOT,
            pass_fds=(write_fd,),
            preexec_fn=None if max_fds is None else functools.partial(_limit_fds, max_fds),
            stdout=output, stderr=output,
        )  # fmt: skip
    os.close(write_fd)
    try:
        line = read_ready_line(read_fd, READY_TIMEOUT_S)
        os.close(read_fd)
        if line != "READY":
            raise RuntimeError(f"supervisor did not start: {line or 'no readiness line'}")
        yield SupervisorProcess(process, socket_path)
    finally:
        stop_gracefully(process)
        if socket_path == folder / "duomo.sock" and folder.name.startswith("duomo-t-"):
            shutil.rmtree(folder, ignore_errors=True)


def stop_gracefully(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within ``timeout_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _limit_fds(count: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- raw clients, for tests that speak the protocol themselves ---------------------------------


def connected(socket_path: Path) -> socket.socket:
    """A raw connection (retried while the listen backlog is full, as the client does)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    deadline = time.monotonic() + 30
    while True:
        try:
            sock.connect(str(socket_path))
            return sock
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)  # the retry's back-off, as the client's


def authenticated(socket_path: Path) -> tuple[socket.socket, FrameReader]:
    """A raw connection past the challenge, for a client that writes frames itself."""
    sock = connected(socket_path)
    reader = FrameReader()
    _, challenge = recv_frame(sock, reader)
    sock.sendall(frame(FrameKind.RESPONSE, answer(read_key(socket_path), challenge)))
    kind, hello = recv_frame(sock, reader)
    assert kind is FrameKind.JSON and parse_json(hello)["event"] == "hello"
    return sock, reader


def replies(sock: socket.socket, reader: FrameReader, count: int) -> list[dict[str, object]]:
    return [parse_json(recv_frame(sock, reader)[1]) for _ in range(count)]


def logged_events(log: Path, event: str) -> list[dict[str, str]]:
    """The ``key=value`` fields of each line the supervisor logged as ``event`` (its console
    format: the event, then its fields), in order."""
    line_of = re.compile(rf"{re.escape(event)}\s+(.*)$")
    found = []
    for line in log.read_text().splitlines():
        match = line_of.search(line)
        if match is not None:
            found.append(dict(re.findall(r"(\w+)=(\S+)", match.group(1))))
    return found
