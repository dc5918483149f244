"""A sink's delivery loop: one thread that moves events from the sink's outbox to its broker,
in seq order per source, and keeps the sink's state and figures.

The loop, on its own thread (``SinkDelivery.start``)::

    connect the publisher if it is not      refused → failing, wait failing_retry_s
                                             away    → retrying, wait the backoff
    every prune_every_s: outbox.prune()     (the age bound, while nothing is appended)
    batch = outbox.next_batch(batch_limit)  nothing → wait idle_poll_s
    published = publisher.publish(batch)
    outbox.ack(acked + rejected)            the rest stays and is sent again
    an error → close the publisher; retrying (backoff) or failing (slowly), as above

The backoff is exponential with jitter: ``first_retry_s`` doubling to ``max_retry_s``, each wait
drawn between half and all of it (so many sinks that lost one broker do not return in step),
reset by a batch that goes through. A refusal (bad credentials, TLS, URL, an unset secret) is
``failing`` with its reason, logged at every slow retry, never retried fast and never silently:
the operator may fix the broker's side, and the next slow retry then connects.

States (``SinkStatus.state``, a record of ``ipc.sink_records``): ``connecting`` (before the
first attempt ends), ``connected``, ``retrying`` (the broker is away or asked to try later;
``reason`` says what happened), ``failing`` (refused; ``reason``).

Threads: the delivery thread owns the publisher and the publishing side of the outbox; any
thread may call ``status()``, which reads the figures under ``_lock`` and the outbox's pending
and dropped counts from its database (as any process could). The producers append to the same
outbox from their own processes through their own ``Outbox``: nothing here is on their path.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from duomo.ipc.sink_records import SinkStatus
from duomo.sinks.config import SinkConfig
from duomo.sinks.outbox import Outbox, PendingEvent, outbox_path
from duomo.sinks.publisher import (
    Published,
    Publisher,
    SinkError,
    SinkRefusedError,
    SinkUnavailableError,
    publisher_for,
)

log = structlog.get_logger("duomo.sinks")

SinkState = Literal["connecting", "connected", "retrying", "failing"]


@dataclass(frozen=True)
class DeliveryTiming:
    """The loop's pace (the defaults suit a broker; tests shorten them)."""

    batch_limit: int = 256
    idle_poll_s: float = 0.05  # how often an empty outbox is looked at again
    first_retry_s: float = 0.5
    max_retry_s: float = 30.0
    failing_retry_s: float = 60.0  # a refused sink is tried again this often
    prune_every_s: float = 1.0
    delay_window: int = 1024  # acknowledgements the delay percentiles are taken over


class SinkDelivery:
    """The delivery loop of one sink: ``outbox`` (its publishing side, opened; closed by
    ``stop``) to ``publisher``. Nothing runs until ``start()``."""

    def __init__(
        self,
        name: str,
        kind: str,
        target: str,
        outbox: Outbox,
        publisher: Publisher,
        timing: DeliveryTiming | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.target = target
        self.timing = timing or DeliveryTiming()
        self._outbox = outbox
        self._publisher = publisher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # guarded by _lock (written by the delivery thread, read by status())
        self._state: SinkState = "connecting"
        self._reason: str | None = None
        self._published = 0
        self._rejected = 0
        self._errors = 0
        self._last_error: str | None = None
        self._delays_s: deque[float] = deque(maxlen=self.timing.delay_window)

    @classmethod
    def of(
        cls, config: SinkConfig, directory: Path, timing: DeliveryTiming | None = None
    ) -> SinkDelivery:
        """The delivery of the sink ``config``, its outbox under ``directory`` (opened now)."""
        outbox = Outbox(outbox_path(directory, config.name), config.outbox, config.name).open()
        return cls(config.name, config.kind, config.target, outbox, publisher_for(config), timing)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"sink-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 40.0) -> None:
        """End the loop (a publish in progress finishes or times out first), then close the
        publisher and the outbox."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._publisher.close()
        self._outbox.close()

    def status(self) -> SinkStatus:
        pending = self._outbox.pending()
        dropped = sum(self._outbox.dropped().values())
        with self._lock:
            delays = sorted(self._delays_s)
            return SinkStatus(
                name=self.name,
                kind=self.kind,
                target=self.target,
                state=self._state,
                reason=self._reason,
                published=self._published,
                pending_events=pending.events,
                pending_bytes=pending.bytes,
                dropped=dropped,
                rejected=self._rejected,
                errors=self._errors,
                last_error=self._last_error,
                delay_p50_ms=_percentile_ms(delays, 0.50),
                delay_p99_ms=_percentile_ms(delays, 0.99),
            )

    # -- the delivery thread ------------------------------------------------------------------

    def _run(self) -> None:
        attempts = 0  # failed tries since the last success, for the backoff
        connected = False
        next_prune = 0.0
        while not self._stop.is_set():
            try:
                if not connected:
                    self._publisher.connect()
                    connected = True
                    self._enter("connected", None)
                if time.monotonic() >= next_prune:
                    self._outbox.prune()
                    next_prune = time.monotonic() + self.timing.prune_every_s
                batch = self._outbox.next_batch(self.timing.batch_limit)
                if not batch:
                    self._stop.wait(self.timing.idle_poll_s)
                    continue
                published = self._publisher.publish(batch)
                self._settle(batch, published)
                if published.error is not None:
                    raise published.error
                attempts = 0
            except SinkError as err:
                connected = self._fallen(err)
                attempts += 1
                self._stop.wait(self._wait_after(err, attempts))
            except Exception as err:  # the outbox's database, or a publisher's bug
                log.exception("sink delivery error", sink=self.name)
                connected = self._fallen(SinkUnavailableError(f"{type(err).__name__}: {err}"))
                attempts += 1
                self._stop.wait(self._wait_after(None, attempts))

    def _settle(self, batch: Sequence[PendingEvent], published: Published) -> None:
        """Acknowledge what the broker took (and what it refused for good) in the outbox, and
        count it."""
        done = [*published.acked, *(event_id for event_id, _ in published.rejected)]
        if done:
            self._outbox.ack(done)
        now = time.time()
        acked = set(published.acked)
        delays = [now - event.created_at for event in batch if event.id in acked]
        with self._lock:
            self._published += len(published.acked)
            self._rejected += len(published.rejected)
            self._delays_s.extend(max(0.0, d) for d in delays)
        for event_id, why in published.rejected:
            log.warning(
                "sink refused an event for good: dropped", sink=self.name, id=event_id, why=why
            )

    def _fallen(self, err: SinkError) -> bool:
        """Count ``err``, close the publisher and enter the state it means; False (the loop is
        not connected any more)."""
        try:
            self._publisher.close()
        except Exception:  # closing a broken connection may fail too; it is gone either way
            log.debug("closing the publisher failed", sink=self.name, exc_info=True)
        state: SinkState = "failing" if isinstance(err, SinkRefusedError) else "retrying"
        with self._lock:
            self._errors += 1
            self._last_error = str(err)
        self._enter(state, str(err))
        return False

    def _enter(self, state: SinkState, reason: str | None) -> None:
        with self._lock:
            before, self._state, self._reason = self._state, state, reason
        if state == "failing":  # logged at every (slow) retry: never silent
            log.error("sink failing", sink=self.name, target=self.target, reason=reason)
        elif state != before and state == "retrying":
            log.warning("sink retrying", sink=self.name, target=self.target, reason=reason)
        elif state != before:
            log.info(f"sink {state}", sink=self.name, target=self.target)

    def _wait_after(self, err: SinkError | None, attempts: int) -> float:
        if isinstance(err, SinkRefusedError):
            return self.timing.failing_retry_s
        ceiling = min(
            self.timing.first_retry_s * 2 ** min(attempts - 1, 30), self.timing.max_retry_s
        )
        return random.uniform(ceiling / 2, ceiling)


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)
