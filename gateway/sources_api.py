"""The camera fleet over the gateway's HTTP port: the supervisor's managed sources, for callers
that are not on its host (an operator's console, an orchestrator).

==============================  ===============================================================
``GET /v1/sources``             every source: a list of ``SourceStatus`` objects (as ``duomo
                                source list --json``)
``GET /v1/sources/{name}``      one (404 when there is none)
``POST /v1/sources``            add one: a JSON object with a ``sources:`` entry's fields
                                (``name``, ``url``, ``models`` or ``pipeline``, ``policy``,
                                ``max_fps``, ``every``, ``weight``, ``password_file`` …); 201
                                with its ``SourceStatus``; 400 for a bad field or a name in use,
                                404 for a model not served
``DELETE /v1/sources/{name}``   remove a source added at run time: 200 (400 for a config source,
                                404 for none)
==============================  ===============================================================

The same rules as every endpoint of the gateway: the bearer token when one is configured,
loopback unless a token or TLS protects the port, errors as ``{"error": message}``. Each call is
one control message to the supervisor (``source``, ``sources``, ``source_add``,
``source_remove``); the records come from it with URLs already masked. Called by
``gateway.http_front`` for paths under ``/v1/sources``.
"""

from __future__ import annotations

from typing import Any

from duomo.gateway.http_errors import HttpError, only
from duomo.gateway.link import SupervisorLink

SOURCES_TIMEOUT_S = 30.0


class SourcesApi:
    """``/v1/sources`` on one gateway worker's link."""

    def __init__(self, link: SupervisorLink) -> None:
        self.link = link

    async def respond(self, method: str, route: list[str], body: dict[str, Any]) -> tuple[int, Any]:
        """(status, JSON value) for ``method`` on ``/v1/sources/<route…>``; DuomoError, and
        HttpError for a path (404) or a method (405) it does not take, for the caller to
        answer."""
        if not route:
            only(method, "GET", "POST")
            if method == "GET":
                reply = await self.link.control("sources", timeout_s=SOURCES_TIMEOUT_S)
                return 200, reply["sources"]
            reply = await self.link.control("source_add", timeout_s=SOURCES_TIMEOUT_S, source=body)
            return 201, reply["source"]
        if len(route) != 1:
            raise HttpError(404, "no endpoint: /v1/sources/{name}")
        name = route[0]
        only(method, "GET", "DELETE")
        if method == "GET":
            reply = await self.link.control("source", timeout_s=SOURCES_TIMEOUT_S, name=name)
            return 200, reply["source"]
        await self.link.control("source_remove", timeout_s=SOURCES_TIMEOUT_S, name=name)
        return 200, {"removed": name}
