"""Where a supervisor's socket, key, pid and log files live, and how they are protected.

Used by the supervisor (creates them) and by clients and the CLI (find and read them).

Default socket: ``$DUOMO_SOCKET``, else ``$XDG_RUNTIME_DIR/duomo/duomo.sock``, else
``/tmp/duomo-<uid>/duomo.sock``. Beside the socket: ``<socket>.key`` (the client key, mode 0600),
``<socket>.pid``, ``<socket>.log``, and each source worker's tail socket
(``<socket>.source-worker-<index>.sock``: ``source_tail_path``). The directory is created with
mode 0700 and must be owned by the current user, so no other user can place or read anything
there.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32


def default_socket_path() -> Path:
    env = os.environ.get("DUOMO_SOCKET")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "duomo" if runtime else Path(f"/tmp/duomo-{os.getuid()}")
    return base / "duomo.sock"


def key_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".key")


def pid_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".pid")


def source_tail_path(socket_path: Path, index: int) -> Path:
    """Where source worker ``index`` of the supervisor at ``socket_path`` serves its tails."""
    return socket_path.with_name(f"{socket_path.name}.source-worker-{index}.sock")


def log_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".log")


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` with mode 0700, or check that an existing one is ours and private."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise PermissionError(f"{directory} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)


def write_key(socket_path: Path) -> bytes:
    """A fresh random key in ``<socket>.key`` (mode 0600); returns the key."""
    key = secrets.token_bytes(KEY_BYTES)
    path = key_path(socket_path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, key.hex().encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


def read_key(socket_path: Path) -> bytes:
    path = key_path(socket_path)
    info = path.stat()
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {oct(info.st_mode & 0o777)})")
    return bytes.fromhex(path.read_text().strip())
