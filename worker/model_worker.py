"""One model instance: a thread that loads its own sessions and serves batches from the batcher.

Created and started by ``ServedModel``. Everything the executor owns (sessions, I/O buffers, and
for ACL the context and stream) is created on this thread and used only by it. A worker serves
one generation of its model's batcher: once that generation is retired (unload, re-initialization)
it finishes its batch, closes its executor on its own thread and ends. ``busy_since`` and
``current`` show the watchdog the batch in progress; a hung worker is abandoned, never joined.
The process's ``Activity`` counts it from its load to its warm-up's end and through each batch
(the supervisor's idle spin reads it: ``supervisor.process.lending``).

After its warm-up the executor is settled: a request far larger than what warm-up sized is a
one-off, and once its batch is answered the worker has the sessions give back what it took
(``worker.backends.base``).

Per batch: expired requests are answered DEADLINE_EXCEEDED; each request is prepared alone (a bad
one fails alone with its own error); the rest execute together. An exception from ``execute``
fails every member of the batch: a ``DuomoError`` with its own code, anything else as INTERNAL
with the traceback in the log and not in the answer. A request's stage timings add up to its
time in the executor: ``prepare`` and the preprocess stage, the infer stage, then the rest of
``execute`` as postprocess.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from duomo.ipc.errors import DeadlineExceededError, DuomoError, InternalError, UnavailableError
from duomo.worker.batcher import Batcher, TakenBatch
from duomo.worker.executors.base import Executor, StageTimer
from duomo.worker.request import Request

log = structlog.get_logger("duomo.worker")


class Activity:
    """How many model instances of the process are warming up or serving a batch right now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._working = 0

    def enter(self) -> None:
        with self._lock:
            self._working += 1

    def leave(self) -> None:
        with self._lock:
            self._working -= 1

    def idle(self) -> bool:
        """No instance is at work (a racy read: it is asked again and again while it matters)."""
        return self._working == 0


class ModelWorker:
    """One model instance: a thread that opens its own executor, warms it up, and runs batches
    from its generation of the batcher until retired."""

    def __init__(
        self,
        model: str,
        index: int,
        load: Callable[[], Executor],
        batcher: Batcher,
        on_batch: Callable[[ModelWorker, int, bool, float], None],
        generation: int = 0,
        activity: Activity | None = None,
        serving: threading.Event | None = None,
    ) -> None:
        self.model = model
        self.index = index
        self.generation = generation
        self._load = load
        self._batcher = batcher
        # (worker, batch size, whether the model failed it, seconds in ``execute``)
        self._on_batch = on_batch
        self._activity = activity or Activity()  # the process's, shared by every instance
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        # set when its generation may take requests (``Instances.start``: once every instance
        # is warmed up and the load measured); none given: at once
        self._serving = serving
        self.load_error: BaseException | None = None
        self.executor: Executor | None = None
        self.busy_since: float | None = None  # monotonic start of the batch in progress
        self.current: tuple[Request, ...] = ()  # that batch's requests
        self.abandoned = False  # let go of by its model; its batch was answered for it
        self.batches = 0  # batches served (where work went: ``status``'s placement)

    @property
    def native_id(self) -> int:
        """Its thread's id in the operating system (0 before it starts)."""
        return (self._thread.native_id or 0) if self._thread is not None else 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"duomo-{self.model}-{self.index}", daemon=True
        )
        self._thread.start()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._ready.wait(timeout_s)

    def join(self, timeout_s: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        log_ = log.bind(model=self.model, instance=self.index)
        activity = self._activity
        activity.enter()  # loading and warming up take the cores as a batch does
        try:
            started = time.perf_counter()
            executor = self._load()
            try:
                executor.warmup()  # every batch size it will run: nothing is sized under load
                executor.settle()  # what warm-up sized is the usual; far more is a one-off
            except BaseException:
                executor.close()
                raise
            self.executor = executor
            log_.info("instance ready", load_ms=round((time.perf_counter() - started) * 1e3, 1))
        except BaseException as err:  # the caller re-raises it with the model's name
            self.load_error = err
            self._ready.set()
            return
        finally:
            activity.leave()
        self._ready.set()
        if self._serving is not None:
            self._serving.wait()
        try:
            for taken in self._batcher.batches(self.generation):
                activity.enter()
                self.batches += 1
                self.busy_since = time.monotonic()
                self.current = batch = (*taken.run, *taken.expired)
                try:
                    self._serve(executor, taken)
                except Exception:
                    # A bug in the serving path itself must not end the thread: whatever this
                    # batch has not answered yet is answered, and the next batch is served.
                    failure = InternalError(f"model {self.model!r}: internal error")
                    for request in (*taken.run, *taken.expired):
                        request.complete(error=failure)
                    log.exception("serving loop error", model=self.model)
                finally:
                    self.busy_since, self.current = None, ()
                    self._release_one_offs(executor)
                    activity.leave()
                    if self.abandoned:  # whatever was held back for this batch is free now
                        for request in batch:
                            request.batch_over()
        finally:
            self.executor = None
            executor.close()

    def _release_one_offs(self, executor: Executor) -> None:
        """The batch is answered: what a one-off request in it took goes back (its buffers went
        with it; this is the runtime's pools), before the next batch is taken."""
        try:
            if executor.release_one_offs():
                log.info("one-off request's memory given back", model=self.model)
        except Exception:  # the pools keep it; serving goes on
            log.exception("could not give back a one-off request's memory", model=self.model)

    def _serve(self, executor: Executor, taken: TakenBatch) -> None:
        now = time.monotonic()
        for request in taken.expired:
            request.timings.queue_s = now - request.enqueued_s
            request.complete(error=DeadlineExceededError("deadline passed while queued"))
        live: list[Request] = []
        prepared: list[Any] = []
        for request in taken.run:
            if request.cancelled:
                request.complete(error=UnavailableError("request cancelled: its client left"))
                continue
            start = time.perf_counter()
            request.timings.queue_s = time.monotonic() - request.enqueued_s
            try:
                prepared.append(executor.prepare(request.payload))
                live.append(request)
            except DuomoError as err:
                request.complete(error=err)
            except Exception:
                log.exception("prepare failed", model=self.model)
                request.complete(error=InternalError(f"model {self.model!r}: preprocessing failed"))
            request.timings.preprocess_s = time.perf_counter() - start
        if not live:
            return
        failed, spent_s = True, 0.0
        try:
            failed, spent_s = self._execute(executor, live, prepared)
        finally:
            self._on_batch(self, len(live), failed, spent_s)  # after the answers went out

    def _execute(
        self, executor: Executor, live: list[Request], prepared: list[Any]
    ) -> tuple[bool, float]:
        """Run the batch and answer it; whether the model failed it (what the watchdog counts:
        an exception other than a request's own error, or output it cannot split), and the
        seconds ``execute`` took."""
        timer = StageTimer()
        start = time.perf_counter()
        try:
            results = executor.execute(prepared, timer)
        except DuomoError as err:
            spent_s = time.perf_counter() - start
            self._finish(live, timer, spent_s, error=err)
            return isinstance(err, InternalError), spent_s
        except Exception:
            spent_s = time.perf_counter() - start
            log.exception("batch failed", model=self.model, batch=len(live))
            failure = InternalError(f"model {self.model!r}: inference failed")
            self._finish(live, timer, spent_s, error=failure)
            return True, spent_s
        spent_s = time.perf_counter() - start
        if not isinstance(results, list) or len(results) != len(live):
            log.error(
                "executor returned the wrong number of results",
                model=self.model,
                expected=len(live),
                got=len(results) if isinstance(results, list) else type(results).__name__,
            )
            failure = InternalError(f"model {self.model!r}: bad executor output")
            self._finish(live, timer, spent_s, error=failure)
            return True, spent_s
        self._finish(live, timer, spent_s, results=results)
        return False, spent_s

    def _finish(
        self,
        live: list[Request],
        timer: StageTimer,
        spent_s: float,
        results: list[Any] | None = None,
        error: DuomoError | None = None,
    ) -> None:
        """Answer the batch. Its time in ``execute`` is split over the stages: preprocess and
        infer as the executor timed them, postprocess the rest (so the stages add up to all
        the time the request spent in the executor)."""
        preprocess_s, infer_s = timer.seconds["preprocess"], timer.seconds["infer"]
        postprocess_s = spent_s - preprocess_s - infer_s  # (the postprocess stage and the rest)
        size = len(live)
        for i, request in enumerate(live):
            t = request.timings
            t.preprocess_s += preprocess_s
            t.infer_s = infer_s
            t.postprocess_s = postprocess_s
            result = results[i] if results is not None else None
            if isinstance(result, DuomoError):
                request.complete(error=result, batch_size=size)
            else:
                request.complete(result=result, error=error, batch_size=size)
