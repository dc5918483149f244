"""What a managed source is: one entry of the config's ``sources:`` section, of ``duomo source add``
and of ``POST /v1/sources`` — the same fields, checked by the same model.

::

    sources:
      - name: gate-3                       # its stream's name too (a model's name's rules)
        url: rtsp://admin:${GATE3_PASSWORD}@10.0.0.3/main  # ${NAME}: from the environment
        password_file: /run/secrets/gate3  # optional: the URL's password from a file
        models: [face]                     # or: pipeline: faces (exactly one of the two)
        policy: latest                     # latest | fifo
        max_fps: 10                        # optional: frames above this rate are skipped
        every: 1                           # optional: keep one frame in N
        weight: 1.0                        # its share of each model, [0.001, 1000]
        slots: 3                           # frames in flight per model (default: auto)
        failed_after_s: 30                 # failing this long (or a permanent error 3 times):
                                           #   failed, then tried again every retry_failed_s
        retry_failed_s: 60
        loop: true                         # a file starts again at its end
        sinks: [broker, lake]              # optional: named sinks (the config's sinks:) its
                                           #   events go to
        emit: both                         # answers | objects | both (default: both where its
                                           #   pipeline has a tracker, else answers)
        thumbnails: left                   # none | left | appeared: a JPEG of the object's
                                           #   best frame in that object event (default none)

A source naming sinks, or asking for object events, is checked against the config's ``sinks:``
and its pipeline's tracker where the config is (``supervisor.config.source_problems``, and the
fleet on ``source add``): a sink must exist, and ``objects``/``both`` (and thumbnails) need a
pipeline with a tracker.

``SourceDefinition.wire()`` is the dict that is kept (in the database), the defaults left out,
and ``assignment`` the one a source worker is sent, every field there; both have the URL as
written, never filled in or read from a file here. The secrets are filled in only by the source
worker (``ipc.source_urls.expand_url``).

Used by ``supervisor.config`` (the section), ``supervisor.sources.fleet`` (add, reload) and its
control messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from duomo.ipc.source_urls import check_url, mask_url
from duomo.ipc.stream_settings import MAX_WEIGHT, MIN_WEIGHT
from duomo.worker.config_model import NAME_PATTERN, StrictModel

MAX_FEEDS = 16  # models one source feeds (a stream's bound)
MAX_SINKS = 16  # sinks one source's events go to
Emit = Literal["answers", "objects", "both"]
SinkName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


class SourceDefinition(StrictModel):
    """One managed source (the module docstring's fields)."""

    name: str = Field(pattern=NAME_PATTERN)
    url: str = Field(min_length=1, max_length=2048)
    password_file: Path | None = None
    models: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=MAX_FEEDS)
    pipeline: str | None = None
    policy: Literal["latest", "fifo"] = "latest"
    max_fps: float | None = Field(default=None, gt=0, le=1000)
    every: int | None = Field(default=None, ge=1, le=10_000)
    weight: float = Field(default=1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT)
    slots: int | None = Field(default=None, ge=1, le=64)  # None: auto (``SourceFleet``)
    stall_after_s: float = Field(default=5.0, gt=0, le=86400)
    failed_after_s: float = Field(default=30.0, gt=0, le=86400)
    retry_failed_s: float = Field(default=60.0, gt=0, le=86400)
    loop: bool = True
    sinks: tuple[SinkName, ...] = Field(default=(), max_length=MAX_SINKS)
    emit: Emit | None = None  # None: both with a tracker, answers otherwise (``emits``)
    thumbnails: Literal["none", "left", "appeared"] = "none"

    @field_validator("url")
    @classmethod
    def _a_source(cls, url: str) -> str:
        return check_url(url)

    @model_validator(mode="after")
    def _feeds_one_thing(self) -> SourceDefinition:
        if (self.models is None) == (self.pipeline is None):
            raise ValueError("give models (a list) or pipeline (a name), not both")
        if self.models is not None and len(set(self.models)) != len(self.models):
            raise ValueError(f"models lists a model twice: {list(self.models)}")
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"sinks lists a sink twice: {list(self.sinks)}")
        if (self.emit is not None or self.thumbnails != "none") and not self.sinks:
            raise ValueError("emit and thumbnails say what goes to the source's sinks: give sinks")
        if self.thumbnails != "none" and self.emit == "answers":
            raise ValueError("thumbnails go in object events: emit objects or both")
        return self

    def emits(self, tracked: bool) -> Emit:
        """What its sinks get: ``emit`` as given, else ``both`` when its pipeline has a tracker
        (``tracked``), ``answers`` otherwise."""
        if self.emit is not None:
            return self.emit
        return "both" if tracked else "answers"

    @property
    def feeds(self) -> tuple[str, ...]:
        """The models (or the one pipeline) its frames go to."""
        return self.models if self.models is not None else (self.pipeline or "",)

    @property
    def shown_url(self) -> str:
        return mask_url(self.url)

    def resolved(self, base: Path) -> SourceDefinition:
        """Its ``password_file`` made absolute against ``base`` (the config file's folder)."""
        if self.password_file is None or self.password_file.is_absolute():
            return self
        return self.model_copy(update={"password_file": (base / self.password_file).resolve()})

    def wire(self) -> dict[str, Any]:
        """The fields that are kept, the defaults left out (the URL as written: secrets are
        references)."""
        return self.model_dump(mode="json", exclude_defaults=True)

    def assignment(self, slots: int, events: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the source worker decoding it is sent: every field, the defaults included (the
        worker keeps no copy of them), with ``slots`` as chosen (``auto`` resolved) and
        ``events``, where its events go (``supervisor.sinks.hub.SinkHub.plan``; None: no
        sinks)."""
        return {**self.model_dump(mode="json"), "slots": slots, "events": events}
