"""Sinks: answers and object events leave the box through named sinks (MQTT, Redis Streams,
webhooks, JSON-lines files), at least once, through a durable outbox per sink (DESIGN.md §4d).

The modules, each one job::

    config             the ``sinks:`` section (pydantic), how a secret is read
    events             the event contract (JSON field names) and its encoding (orjson)
    sequencer          each source's contiguous seq, durable (one SQLite file for all sinks)
    outbox             a sink's durable, bounded queue (one SQLite file in WAL mode per sink)
    wal_database       how those SQLite files are opened and written
    publisher          the publisher interface, its errors, which publisher a sink gets
    mqtt_publisher     paho-mqtt: acknowledged on PUBACK
    redis_publisher    redis-py: XADD in a pipeline, acknowledged by its reply
    webhook_publisher  httpx: a signed POST, acknowledged by a 2xx
    file_publisher     JSON lines, rotated by size
    delivery           a sink's delivery loop (a thread): backoff, state, figures
    worker             the sink worker process: one delivery per configured sink, reported to
                       the supervisor (``sink_report``), following its sink definitions

Who runs what::

    thread / process                       runs                               hands off through
    source worker (producer), any thread   Sequencer.next, Outbox.append      the SQLite files
    sink worker (sinks.worker), main       sink_report every 0.5 s: starts,   the control socket
                                           stops and restarts deliveries
    sink worker, one thread per sink       SinkDelivery's loop: the outbox's  the outbox file;
                                           next_batch/ack/prune, publisher    status() under a lock
    paho's network thread (mqtt only)      the PUBACK callbacks               the publisher's
                                                                              condition

The producer side never touches the network: ``append`` commits to a local file and returns,
so a dead broker slows no decoding or inference. Imports only ``duomo.ipc``, the standard
library, pydantic, orjson, structlog and the protocols' client libraries (each imported only by
its publisher); never ``supervisor``, ``worker``, ``video`` or ``gateway``.
"""
