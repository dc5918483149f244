"""Real brokers for the sink tests: Debian's mosquitto and redis-server, each started by the test
on a free loopback port, in the test's own folder with its own config file, and stopped at the
end. Nothing of the host's is touched: no system service, no default port, no file outside the
folder.

``running_mosquitto(folder, users)`` (a password file with ``users``, anonymous clients refused)
and ``running_redis(folder, password)`` yield a ``Broker`` that a test may ``stop()`` and
``start()`` again on the same port (an outage). Without the program the test skips, and with
CI=true that skip is a failure (tests/conftest.py): ``make test`` installs them (Makefile,
TOOLS and PACKAGES).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import require_tool
from tests.integration.harness import free_port
from tools.bench.brokers import Broker, find_program


def broker_program(name: str, package: str) -> str:
    """The broker program's path; without it the test skips (fails with CI=true)."""
    try:
        return find_program(name, package)
    except RuntimeError:
        return require_tool(name, f"the sink tests run a real broker (apt-get install {package})")


@contextlib.contextmanager
def running_mosquitto(
    folder: Path,
    users: dict[str, str],
    durable: bool = False,
    tls: tuple[Path, Path] | None = None,
) -> Iterator[Broker]:
    """mosquitto on a free port, accepting only ``users`` (name: password). ``durable``: the
    sessions and their queued messages saved when it stops and loaded when it starts again.
    ``tls``: (certificate, key): the port speaks TLS only."""
    program = broker_program("mosquitto", "mosquitto")
    passwd_tool = broker_program("mosquitto_passwd", "mosquitto")
    folder.mkdir(parents=True, exist_ok=True)
    passwords = folder / "passwd"
    for n, (user, password) in enumerate(users.items()):
        create = ["-c"] if n == 0 else []
        subprocess.run(
            [passwd_tool, "-b", *create, str(passwords), user, password],
            check=True,
            capture_output=True,
        )
    passwords.chmod(0o600)
    port = free_port()
    lines = [
        f"listener {port} 127.0.0.1",
        "allow_anonymous false",
        f"password_file {passwords}",
        # as root it would drop to the 'mosquitto' user, who cannot read the test's folder
        "user root",
        "log_type error",
        "log_type warning",
        "log_type notice",
    ]
    if tls is not None:
        lines += [f"certfile {tls[0]}", f"keyfile {tls[1]}"]
    if durable:
        lines += ["persistence true", f"persistence_location {folder}/",
                  "max_queued_messages 100000"]  # fmt: skip
    else:
        lines.append("persistence false")
    config = folder / "mosquitto.conf"
    config.write_text("\n".join(lines) + "\n")
    broker = Broker("mosquitto", port, [program, "-c", str(config)], folder / "mosquitto.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, signed by itself (a client trusts it by naming it as its
    CA), and its key, made by openssl in ``folder``."""
    openssl = require_tool("openssl", "the TLS sink test makes a certificate")
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def running_redis(
    folder: Path, password: str | None = None, durable: bool = False
) -> Iterator[Broker]:
    """redis-server on a free port (with ``requirepass`` when ``password`` is given). A stream
    node holds 5 entries, so an approximate MAXLEN trims close to its bound. ``durable``: an
    append-only file written at every command, so what it acknowledged survives a restart."""
    program = broker_program("redis-server", "redis-server")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = folder / "redis.conf"
    lines = [
        f"port {port}",
        "bind 127.0.0.1",
        f"dir {folder}",
        'save ""',
        "daemonize no",
        "stream-node-max-entries 5",
        f"appendonly {'yes' if durable else 'no'}",
        "appendfsync always",
    ]
    if password is not None:
        lines.append(f"requirepass {password}")
    config.write_text("\n".join(lines) + "\n")
    config.chmod(0o600)
    broker = Broker("redis-server", port, [program, str(config)], folder / "redis.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
