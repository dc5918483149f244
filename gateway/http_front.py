"""The HTTP/REST transport: the v2 endpoints and Triton's extensions as an ASGI application,
served by uvicorn with the httptools parser (chosen by measurement: docs/gateway.md, "The HTTP
stack").

Routes (``{m}`` a model, ``{v}`` its version, optional wherever Triton makes it so):

==============================================  ================================================
``GET /v2``                                     server metadata (the extensions implemented)
``GET /v2/health/live`` · ``/ready``            200, or 503 while no supervisor answers
``GET /v2/models/{m}[/versions/{v}]``           model metadata
``GET …/ready`` · ``…/config`` · ``…/stats``    readiness, Triton's model configuration, stats
``POST …/infer``                                inference: JSON tensors or binary data
``GET /v2/models/stats``                        every model's statistics
``POST /v2/repository/index``                   the models and their states
``POST /v2/repository/models/{m}/load|unload``  ``duomo load|unload``
``/v2/systemsharedmemory/…``                    register, status, unregister (``allow_shm``)
``GET|POST /v1/sources``, ``GET|DELETE …/{n}``  the supervisor's managed sources
                                                (``gateway.sources_api``)
``/v1/galleries[/{g}[/identities[/{n}]]]``      the supervisor's galleries: list, enrol from
``POST /v1/galleries/{g}/search``               images, remove, search (``gateway.galleries_api``)
==============================================  ================================================

Called by uvicorn on the worker's event loop. Every error is ``{"error": message}`` with the
status of ``protocol.HTTP_STATUS``; a bug answers 500 "internal error" and is logged, never
shown. A body over ``max_body_bytes`` is 413 before it is read; a wrong or missing bearer
token 401 (health probes need none); a client that sends its headers or body too slowly is
disconnected (``GuardedHttpTools``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from duomo.gateway import protocol
from duomo.gateway.galleries_api import GalleriesApi, route_of
from duomo.gateway.http_errors import HttpError, only
from duomo.gateway.inference import Answer, read_answer, write_inputs
from duomo.gateway.link import SupervisorLink
from duomo.gateway.regions import Regions
from duomo.gateway.sources_api import SourcesApi
from duomo.ipc.errors import DuomoError, InvalidArgumentError, NotFoundError

log = structlog.get_logger("duomo.gateway.http")
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
JSON = b"application/json"


@dataclass(frozen=True)
class HttpOptions:
    """What the HTTP front is run with: the largest body it reads, the bearer token (None: none
    asked), and the extensions and version ``GET /v2`` reports."""

    max_body_bytes: int
    token: str | None  # a bearer token every endpoint but the health probes needs
    extensions: tuple[str, ...]
    version: str


@dataclass
class Reply:
    """One HTTP response as the front sends it; ``header_length`` is set when binary data follows
    its JSON header."""

    status: int
    body: bytes
    content_type: bytes = JSON
    header_length: int | None = None  # Inference-Header-Content-Length (binary data follows)


class HttpFront:
    """The ASGI application: checks the token, reads the body within ``max_body_bytes`` and
    routes each request to the endpoint that answers it."""

    def __init__(self, link: SupervisorLink, regions: Regions, options: HttpOptions) -> None:
        self.link = link
        self.regions = regions
        self.options = options
        self.sources = SourcesApi(link)
        self.galleries = GalleriesApi(link)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # (lifespan is off; websockets are not served)
            return
        method: str = scope["method"]
        headers = dict(scope["headers"])
        try:
            self.authorize(scope["path"], headers)  # before the body is read
            body = await self._body(receive, headers) if method == "POST" else b""
        except HttpError as err:
            reply = _error(err.status, err.message)
        else:
            reply = await self.respond(
                method, scope["path"], headers, body, scope.get("query_string", b""),
                scope.get("raw_path"),
            )  # fmt: skip
        response_headers = [
            (b"content-type", reply.content_type),
            (b"content-length", b"%d" % len(reply.body)),
        ]
        if reply.header_length is not None:
            response_headers.append(
                (b"inference-header-content-length", b"%d" % reply.header_length)
            )
        await send(
            {"type": "http.response.start", "status": reply.status, "headers": response_headers}
        )
        await send({"type": "http.response.body", "body": reply.body})

    def authorize(self, path: str, headers: dict[bytes, bytes]) -> None:
        """HttpError 401 unless the bearer token is right (or none is configured, or ``path``
        is a health probe). ``headers``' names are lower-case bytes."""
        if self.options.token is None or path.startswith("/v2/health/"):
            return
        given = headers.get(b"authorization", b"")
        expected = f"Bearer {self.options.token}".encode()
        if not hmac.compare_digest(given, expected):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    async def respond(
        self,
        method: str,
        path: str,
        headers: dict[bytes, bytes],
        body: bytes,
        query: bytes = b"",
        raw_path: bytes | None = None,
    ) -> Reply:
        """The reply to one request, whatever goes wrong (any HTTP stack can serve this);
        ``path`` percent-decoded, ``raw_path`` as sent (None: ``path``), ``query`` after its
        ``?``."""
        try:
            return await self._route(method, path, headers, body, query, raw_path)
        except DuomoError as err:
            return _error(protocol.HTTP_STATUS[err.code], err.message)
        except HttpError as err:
            return _error(err.status, err.message)
        except Exception:
            log.exception("request failed", path=path[:200])
            return _error(500, "internal error")

    async def _route(
        self,
        method: str,
        path: str,
        headers: dict[bytes, bytes],
        body: bytes,
        query: bytes,
        raw_path: bytes | None,
    ) -> Reply:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["v1", "sources"]:
            return await self._sources(method, parts[2:], body)
        if parts[:2] == ["v1", "galleries"]:
            route = parts[2:] if raw_path is None else route_of(raw_path)
            status, value = await self.galleries.respond(method, route, query, _json_body(body))
            return Reply(status, orjson.dumps(value))
        if parts[:1] != ["v2"]:
            raise HttpError(404, f"no endpoint {path[:100]!r}")
        route = parts[1:]
        if not route:
            only(method, "GET")
            return _json(protocol.server_metadata(self.options.version, self.options.extensions))
        if route[0] == "health" and len(route) == 2 and route[1] in ("live", "ready"):
            ready = route[1] == "live" or self.link.ready
            return Reply(200 if ready else 503, b"" if ready else b'{"error":"not ready"}')
        if route[0] == "models":
            return await self._models(method, route[1:], headers, body)
        if route[0] == "repository":
            return await self._repository(method, route[1:], body)
        if route[0] == "systemsharedmemory":
            return self._shared_memory(method, route[1:], body)
        raise HttpError(404, f"no endpoint {path[:100]!r}")

    async def _body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes:
        limit = self.options.max_body_bytes
        declared = protocol.length_header(headers.get(b"content-length"))
        if declared is not None and declared > limit:
            raise HttpError(413, f"the body of {declared} bytes is over {limit} (max_body_mb)")
        return await self._read_body(receive, limit)  # (GuardedHttpTools bounds its time)

    @staticmethod
    async def _read_body(receive: Receive, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"the body is over {limit} bytes (max_body_mb)")
            chunks.append(chunk)
            if not message.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # -- endpoints ----------------------------------------------------------------------------

    async def _models(
        self, method: str, route: list[str], headers: dict[bytes, bytes], body: bytes
    ) -> Reply:
        if not route:
            raise HttpError(404, "name a model: /v2/models/{model}")
        if route == ["stats"]:
            only(method, "GET")
            return await self._stats(None)
        name, rest = route[0], route[1:]
        version = None
        if rest[:1] == ["versions"]:
            if len(rest) < 2:
                raise HttpError(404, "name a version: …/versions/{version}")
            version, rest = rest[1], rest[2:]
        protocol.check_version(name, version)
        if not rest:
            only(method, "GET")
            return _json(protocol.model_metadata(await self.link.view(name)))
        action = rest[0] if len(rest) == 1 else ""
        if action == "ready":
            only(method, "GET")
            view = await self.link.view(name)
            return Reply(
                200 if view.ready else 503, b"" if view.ready else b'{"error":"not ready"}'
            )
        if action == "config":
            only(method, "GET")
            return _json(protocol.model_config(await self.link.view(name)))
        if action == "stats":
            only(method, "GET")
            return await self._stats(name)
        if action == "infer":
            only(method, "POST")
            return await self._infer(name, headers, body)
        raise HttpError(404, f"no endpoint for model {name[:100]!r}: {'/'.join(rest)[:100]!r}")

    async def _infer(self, name: str, headers: dict[bytes, bytes], body: bytes) -> Reply:
        header_length = headers.get(b"inference-header-content-length")
        view = memoryview(body)
        split = protocol.length_header(header_length)
        if header_length is None:
            split = len(body)
        elif split is None or split > len(body):
            raise InvalidArgumentError(
                f"Inference-Header-Content-Length {header_length[:20]!r} is not a length within "
                f"the body's {len(body)} bytes"
            )
        try:
            header = orjson.loads(view[:split])
        except orjson.JSONDecodeError as err:
            raise InvalidArgumentError(f"the request's JSON is not valid: {err}") from None
        request = protocol.parse_infer_json(name, header, view[split:])
        model = await self.link.view(name)
        answer = await self.link.run(
            name,
            functools.partial(write_inputs, model, request, regions=self.regions),
            functools.partial(read_answer, model, request, regions=self.regions),
            request.timeout_s,
            request.stream,
        )
        return _infer_reply(name, request, answer)

    async def _stats(self, name: str | None) -> Reply:
        views = [await self.link.view(name)] if name is not None else list(self.link.views.values())
        statuses = await self.link.model_statuses(name)  # (name's alone: not all of them)
        return _json({
            "model_stats": [
                protocol.model_statistics(v, statuses.get(v.name)) for v in views
            ]
        })  # fmt: skip

    async def _sources(self, method: str, route: list[str], body: bytes) -> Reply:
        status, value = await self.sources.respond(method, route, _json_body(body))
        return Reply(status, orjson.dumps(value))

    async def _repository(self, method: str, route: list[str], body: bytes) -> Reply:
        only(method, "POST")
        if route == ["index"]:
            ready_only = protocol.flag_of(_json_body(body), "ready", "request")
            await self.link.refresh()
            return _json([
                {"name": v.name, "version": protocol.VERSION, "state": v.state,
                 "reason": ""}
                for v in self.link.views.values() if v.ready or not ready_only
            ])  # fmt: skip
        if len(route) == 3 and route[0] == "models" and route[2] in ("load", "unload"):
            name, op = route[1], route[2]
            await self.link.view(name)  # 404 for a model the supervisor does not declare
            if op == "unload":
                self.link.forget(name)
            await self.link.control(op, timeout_s=600, model=name)
            await self.link.refresh()
            return Reply(200, b"")
        raise HttpError(404, f"no repository endpoint {'/'.join(route)[:100]!r}")

    def _shared_memory(self, method: str, route: list[str], body: bytes) -> Reply:
        name = None
        if route[:1] == ["region"] and len(route) == 3:
            name, route = route[1], route[2:]
        if route == ["status"]:
            only(method, "GET")
            return _json(self.regions.status(name))
        only(method, "POST")
        if route == ["register"] and name is not None:
            args = _json_body(body)
            self.regions.register(
                name, args.get("key"), args.get("offset", 0), args.get("byte_size")
            )
            return Reply(200, b"")
        if route == ["unregister"]:
            self.regions.unregister(name)
            return Reply(200, b"")
        raise NotFoundError(f"no shared-memory endpoint {'/'.join(route)[:100]!r}")


def _infer_reply(name: str, request: protocol.InferRequest, answer: Answer) -> Reply:
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor, asked in answer.outputs:
        entry: dict[str, Any] = {
            "name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
        }  # fmt: skip
        if asked.region is not None:
            entry["parameters"] = {
                "shared_memory_region": asked.region.region,
                "shared_memory_offset": asked.region.offset,
                "shared_memory_byte_size": tensor.byte_size,
            }
        elif asked.binary:
            raw = tensor.raw()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = tensor.json_data()
        outputs.append(entry)
    response: dict[str, Any] = {
        "model_name": name, "model_version": protocol.VERSION,
        "parameters": answer.parameters, "outputs": outputs,
    }  # fmt: skip
    if request.id is not None:
        response["id"] = request.id
    header = orjson.dumps(response)
    if not blobs:
        return Reply(200, header)
    return Reply(200, header + b"".join(blobs), b"application/octet-stream", len(header))


def _json(value: Any) -> Reply:
    return Reply(200, orjson.dumps(value))


def _json_body(body: bytes) -> dict[str, Any]:
    if not body:
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise InvalidArgumentError(f"the request's JSON is not valid: {err}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError("the request body must be a JSON object")
    return value


def _error(status: int, message: str) -> Reply:
    return Reply(status, orjson.dumps(protocol.error_body(message)))


# -- the server ----------------------------------------------------------------------------------


MAX_HEADER_BYTES = 64 << 10  # a request's line and headers together; past it: 431
REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its answer


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds against slow and hostile clients.

    - Deadlines: a new connection must begin a request within ``idle_timeout_s``, a request's
      headers must arrive within ``header_timeout_s`` of its first byte, its body within
      ``body_timeout_s`` of its headers; past any of them the connection is closed. uvicorn's
      own keep-alive timeout (the same ``idle_timeout_s``) closes connections idle between
      requests. (Timers on the connection, not ``asyncio.wait_for`` around the app: no task
      per request.)
    - Size: a request line and headers over ``max_header_bytes`` together are answered 431
      (Request Header Fields Too Large) and the connection closed, without parsing more of
      them. The bound is also what keeps one caller from holding the worker's event loop:
      httptools joins a header's pieces as they come, a copy of all of it for each piece, so an
      unbounded 75 MiB header took seconds of the loop. Bytes are counted before the parser
      sees them; a read that holds the end of the headers and body after it is fed in two
      parts, so a large body right behind small headers is never mistaken for them.
    """

    idle_timeout_s = 30.0
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_body_bytes = 64 << 20
    max_header_bytes = MAX_HEADER_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes: int | None = 0  # None: past the headers (in a body)
        self._refused = False
        self._arm(self.idle_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # (nothing more is parsed; the connection is about to close)
        counted = self._header_bytes
        if counted is None or self.transport.is_closing():
            super().data_received(data)
            return
        room = self.max_header_bytes - counted
        if len(data) <= room:
            self._header_bytes = counted + len(data)
            super().data_received(data)
            return
        super().data_received(data[:room])  # as much as the bound lets the headers take
        if self._header_bytes is None and not self.transport.is_closing():
            super().data_received(data[room:])  # they ended in it: the rest is body
        elif not self.transport.is_closing():
            self._refuse_header()

    def _refuse_header(self) -> None:
        """431, then close: reading stops at once, and the socket closes after a moment, so
        the caller can read the answer before unread bytes make the kernel reset it."""
        self._refused = True
        self.transport.pause_reading()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # (no earlier answer still being written)
            message = f"the request's headers are over {self.max_header_bytes} bytes"
            body = orjson.dumps(protocol.error_body(message))
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (len(body), body)
            )
        self._arm(REFUSED_LINGER_S)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._header_bytes = None
        self._arm(self.body_timeout_s)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        """The body, kept whole until the request is complete. (uvicorn's own pauses reading at
        every 64 KiB until the application has taken what came, and wakes it for each piece:
        a 720 KB image took a dozen turns of the loop, 1.6 ms more than one of 260 KB.) The
        application is woken early only to refuse a body over ``max_body_bytes``; one that
        says its length is refused before any of it is read."""
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > self.max_body_bytes:
            self.flow.pause_reading()
            cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._disarm()
        self._header_bytes = 0  # the next request's headers count afresh
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self.transport.close)

    def _disarm(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._deadline = None


class QuietServer(uvicorn.Server):
    """uvicorn's server without its own signal handlers: the worker decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(
    front: HttpFront,
    header_timeout_s: float,
    body_timeout_s: float,
    idle_timeout_s: float,
    tls: tuple[Path, Path] | None,
) -> QuietServer:
    """The uvicorn server for ``front`` (``tls``: certificate and key files)."""
    settings = {
        "idle_timeout_s": idle_timeout_s,
        "header_timeout_s": header_timeout_s,
        "body_timeout_s": body_timeout_s,
        "max_body_bytes": front.options.max_body_bytes,
    }
    protocol_class = type("GuardedHttpTools", (GuardedHttpTools,), settings)
    config = uvicorn.Config(
        front,
        http=protocol_class,
        lifespan="off",
        access_log=False,
        log_config=None,
        log_level="warning",
        timeout_keep_alive=max(1, round(idle_timeout_s)),
        server_header=False,
        proxy_headers=False,  # (its middleware costs every request; nothing here uses it)
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )
    return QuietServer(config)
