"""A source's URL: what it may name, and its secrets — written as references, filled in only
where the camera is opened, and masked wherever a URL or a message about it is shown.

A source names a network URL (``NETWORK_SCHEMES``), a V4L2 device (``/dev/videoN``) or a file
(``check_url`` says which may be given). Its URL is kept as written
(``rtsp://admin:${GATE3_PASSWORD}@10.0.0.3/main``): in the config, the supervisor's source
database, its replies, its logs. Only the process that opens the camera fills it in
(``expand_url``): each ``${NAME}`` from its environment (percent-encoded inside the user and
password), and the password from ``password_file`` when the source names one (its first line, as
Docker and Kubernetes secrets are mounted). What is shown is ``mask_url``'s: the password (and a
``${…}`` reference in it) as ``***``; ``mask_text`` does the same inside any message (FFmpeg's
errors name the URL they failed on, with its password).

Used by the supervisor's source fleet (``supervisor.sources``: checks, status, replies, logs), by
the source worker and ``duomo stream`` (``video``: opening, logs), and by the gateway (what it
returns comes from the supervisor already masked). Standard library only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

NETWORK_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "srt", "udp", "tcp")
DEVICE_PATTERN = re.compile(r"^/dev/video\d+$")
MASK = "***"
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# user:password@ in any URL-looking text (scheme://user:password@host)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*):(?P<secret>[^@\s/]*)@")


class SecretError(ValueError):
    """A reference that cannot be filled in (an unset variable, an unreadable file)."""


def check_url(url: str) -> str:
    """``url`` if a source may name it: a URL of a known scheme, ``file://`` or an absolute
    path, or a V4L2 device; ValueError saying what may be given otherwise."""
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in NETWORK_SCHEMES or scheme == "file" or (not scheme and url.startswith("/")):
        return url
    known = ", ".join(f"{s}://" for s in NETWORK_SCHEMES)
    raise ValueError(
        f"{mask_url(url)!r} is not a source: give a URL ({known}), an absolute file path or "
        "/dev/videoN"
    )


def references(url: str) -> list[str]:
    """The environment variables ``url`` refers to, in order."""
    return _REFERENCE.findall(url)


def expand_url(url: str, password_file: str | Path | None = None) -> str:
    """``url`` with each ``${NAME}`` replaced by the environment's value, and its password by
    the first line of ``password_file`` when given (percent-encoded as a URL needs). SecretError
    names what is missing, never a value."""
    userinfo_end = _userinfo_end(url)

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        found = os.environ.get(name)
        if found is None:
            raise SecretError(f"the environment variable {name} is not set")
        # a user or password is percent-encoded ("p@ss" would end the userinfo early)
        return quote(found, safe="") if match.start() < userinfo_end else found

    expanded = _REFERENCE.sub(value, url)
    if password_file is None:
        return expanded
    try:
        lines = Path(password_file).read_text().splitlines()
    except OSError as err:
        raise SecretError(f"password_file {password_file}: {err.strerror or err}") from None
    password = lines[0] if lines else ""
    parts = urlsplit(expanded)
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    netloc = f"{user}:{quote(password, safe='')}@{host}{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def mask_url(url: str) -> str:
    """``url`` as it may be shown: its password (a value or a reference) replaced by ``***``."""
    return mask_text(url)


def mask_text(text: str, *secrets: str) -> str:
    """``text`` with every URL password in it masked, and each of ``secrets`` (a password known
    to the caller, as it may appear decoded) replaced by ``***`` too."""
    masked = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    for secret in secrets:
        if secret:
            masked = masked.replace(secret, MASK)
    return masked


def _userinfo_end(url: str) -> int:
    """Where ``url``'s userinfo ends (its ``@``), or 0 when it has none."""
    start = url.find("://")
    if start < 0:
        return 0
    start += 3
    authority_end = len(url)
    for stop in "/?#":
        found = url.find(stop, start)
        if found >= 0:
            authority_end = min(authority_end, found)
    at = url.rfind("@", start, authority_end)
    return max(at, 0)
