"""``HOST:PORT`` endpoints as Duomo's configuration and processes name them: parsing one, and
whether its host is loopback.

Used by the supervisor's ``gateway`` section (validated at ``duomo check`` and ``duomo start``)
and by a gateway worker (its own check at start); in ``ipc`` because the gateway imports
nothing else of Duomo's.
"""

from __future__ import annotations

import ipaddress


def parse_endpoint(value: str) -> tuple[str, int]:
    """``("host", port)`` of ``HOST:PORT`` (an IPv6 host in brackets); ValueError otherwise."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
