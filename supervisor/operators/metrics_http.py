"""The operators' HTTP port (config ``metrics: {http: HOST:PORT}``): ``/metrics`` for Prometheus
and the health probes for deployments without the gateway.

Owned by ``Supervisor``, which starts it before it loads the models (so probes answer while
they load) and stops it last. It runs on its own threads (``ThreadingWSGIServer``), one per
connection, at most ``MAX_CONNECTIONS`` at once (more are closed at once) and each closed after
``IDLE_TIMEOUT_S`` without a request, so an idle or slow peer cannot hold the port or the
process's file descriptors; a scrape reads what the workers keep without making them wait
(``supervisor.operators.metrics``). HEAD is answered like GET, without the body.

==========================  ===============================================================
``GET /metrics``            the ``duomo_*`` series (text format; OpenMetrics when the
                            scraper asks for it; gzip when it accepts it)
``GET /v2/health/live``     200 while the supervisor is starting or its reactor runs a task
                            within ``LIVE_TIMEOUT_S``; 503 otherwise
``GET /v2/health/ready``    200 when every ``preload`` model serves: READY or DEGRADED (what
                            the gateway calls a ready model), or evicted and loaded again on
                            its next request; 503 with the ones that do not
==========================  ===============================================================
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector
from pydantic import field_validator

from duomo.ipc.endpoints import parse_endpoint
from duomo.worker.config_model import StrictModel

log = structlog.get_logger("duomo.metrics")
LIVE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16  # Prometheus, a kubelet and an operator's curl need a handful
IDLE_TIMEOUT_S = 10.0
StartResponse = Callable[..., Any]


class MetricsConfig(StrictModel):
    """The ``metrics`` section: where the operators' HTTP port listens."""

    http: str = "127.0.0.1:8002"  # HOST:PORT; 0.0.0.0 for Prometheus and probes from outside

    @field_validator("http")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        parse_endpoint(value)  # ValueError, reported with the key by the config loader
        return value


class ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A WSGI server with a thread per connection and at most ``MAX_CONNECTIONS`` at once; one
    more is closed unanswered."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: this one is closed unanswered
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ThreadingWSGIServer6(ThreadingWSGIServer):
    """The same server on an IPv6 address."""

    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S  # a connection silent this long is closed

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the supervisor's log


class MetricsServer:
    """``/metrics`` and the probes on one port, until ``stop``."""

    def __init__(
        self,
        config: MetricsConfig,
        collector: Collector,
        live: Callable[[], bool],
        not_ready: Callable[[], list[str]],
    ) -> None:
        self.config = config
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._metrics = make_wsgi_app(self.registry)
        self._live = live
        self._not_ready = not_ready  # the preload models that are not serving, with states
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve; RuntimeError naming the port when it cannot be bound."""
        host, port = parse_endpoint(self.config.http)
        server_class = ThreadingWSGIServer6 if ":" in host else ThreadingWSGIServer
        try:
            self._server = make_server(host, port, self._app, server_class, _QuietHandler)
        except OSError as err:
            raise RuntimeError(f"metrics.http {self.config.http} cannot be bound: {err}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="duomo-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics and probes listening", http=self.config.http)

    @property
    def port(self) -> int:
        return self._server.server_port if self._server is not None else 0

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        body = self._route(environ, start_response)
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else body

    def _route(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _reply(start_response, "405 Method Not Allowed", {"error": "GET only"})
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/v2/health/live":
            if self._live():
                return _reply(start_response, "200 OK", None)
            why = f"the reactor did not answer within {LIVE_TIMEOUT_S:g}s"
            return _reply(start_response, "503 Service Unavailable", {"error": why})
        if path == "/v2/health/ready":
            waiting = self._not_ready()
            if not waiting:
                return _reply(start_response, "200 OK", None)
            body = {"error": "not ready", "models": waiting}
            return _reply(start_response, "503 Service Unavailable", body)
        return _reply(start_response, "404 Not Found", {"error": f"no route {path[:200]!r}"})


def _reply(start_response: StartResponse, status: str, body: Any) -> list[bytes]:
    data = b"" if body is None else json.dumps(body).encode()
    headers = [("Content-Length", str(len(data)))]
    if data:
        headers.append(("Content-Type", "application/json"))
    start_response(status, headers)
    return [data]
