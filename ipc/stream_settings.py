"""What a stream is opened with, checked once: one record on both sides of the socket.

A producer's ``Client.stream`` and ``Client.open_stream`` build a ``StreamSettings`` (a value
out of range is INVALID_ARGUMENT before anything is sent), ``ipc.stream.Stream`` runs with
it, and ``to_dict`` writes the ``stream_open`` fields it sends. The supervisor reads those
fields back with ``from_dict`` (``supervisor.process.control_messages``), which checks them by
the same rules in the same words, and keeps the record for the stream's life
(``supervisor.dataflow.streams``). A ``StreamSettings`` that exists is valid.

The rules (the ``stream_open`` row of the control protocol): ``models`` 1..16 distinct names;
``policy`` ``latest`` or ``fifo``; ``weight`` a number in [0.001, 1000] (its share against the
other flows of each model: the batchers' stride is 1 / weight, so the bounds keep it finite
and fair); ``fps`` none, or a number in (0, 1000]; ``stall_after_s`` a number in (0, 86400].
A boolean is no number. The source's own settings — ``max_fps``, ``every``, ``slots``,
``backlog``, ``timeout_s`` — stay with the producer and are never sent; the supervisor's
records have their defaults.

Imported by the producer's client and stream, and by the supervisor; it needs only
``ipc.errors``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from duomo.ipc.errors import InvalidArgumentError, echoed

POLICIES = ("latest", "fifo")
MAX_MODELS = 16  # models one stream feeds
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0  # a stream's weight (the batchers' ``Request.weight``)
MAX_FPS = 1000.0  # a nominal frame rate
MAX_STALL_AFTER_S = 86400.0
DEFAULT_STALL_AFTER_S = 5.0
DEFAULT_SLOTS = 3  # a producer's slots per model: three keep ``latest``'s age bound
DEFAULT_BACKLOG = 256  # fifo: frames that may wait at the source per model
WIRE_FIELDS = ("models", "policy", "weight", "fps", "stall_after_s")  # what ``stream_open`` sends


@dataclass(frozen=True)
class StreamSettings:
    """A stream's settings: what the supervisor is told (``stream_open``) and what the source
    keeps to itself. Checked when made (see the module docstring for the rules).

    Attributes:
        models: The models each frame goes to.
        policy: ``latest`` (a frame waiting for a model is superseded by the next) or
            ``fifo`` (every frame answered).
        weight: Its share, against the other streams and clients of each model.
        fps: Its nominal frame rate, if known (the status shows it; liveness uses it).
        stall_after_s: No frame for this long: the supervisor shows it ``stalled``.
        max_fps: (The source's) Drop frames above this rate.
        every: (The source's) Keep one frame in ``every``.
        slots: (The source's) Slots per model.
        backlog: (The source's) ``fifo``: frames that may wait per model.
        timeout_s: (The source's) Each frame's deadline in the supervisor; None: none.
    """

    models: tuple[str, ...]
    policy: str = "latest"
    weight: float = 1.0
    fps: float | None = None
    stall_after_s: float = DEFAULT_STALL_AFTER_S
    max_fps: float | None = None
    every: int | None = None
    slots: int = DEFAULT_SLOTS
    backlog: int = DEFAULT_BACKLOG
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        models = self.models
        if not (
            isinstance(models, (list, tuple))
            and 0 < len(models) <= MAX_MODELS
            and all(isinstance(m, str) for m in models)
            and len(set(models)) == len(models)
        ):
            raise _wrong("models", f"a list of 1..{MAX_MODELS} distinct names", models)
        if self.policy not in POLICIES:
            raise InvalidArgumentError(
                f"policy must be one of {list(POLICIES)}, not {echoed(self.policy)}"
            )
        object.__setattr__(self, "models", tuple(models))
        object.__setattr__(self, "weight", _number("weight", self.weight, MIN_WEIGHT, MAX_WEIGHT))
        if self.fps is not None:
            object.__setattr__(self, "fps", _number("fps", self.fps, None, MAX_FPS))
        stall_after_s = _number("stall_after_s", self.stall_after_s, None, MAX_STALL_AFTER_S)
        object.__setattr__(self, "stall_after_s", stall_after_s)
        if self.max_fps is not None and not self.max_fps > 0:
            raise InvalidArgumentError(f"max_fps must be above 0, not {self.max_fps!r}")
        if self.every is not None and not (isinstance(self.every, int) and self.every >= 1):
            raise InvalidArgumentError(f"every must be an integer ≥ 1, not {self.every!r}")
        if not (isinstance(self.slots, int) and self.slots >= 1) or self.backlog < 1:
            raise InvalidArgumentError("slots and backlog must be at least 1")

    @property
    def supersedes(self) -> bool:
        """A newer frame takes a waiting one's place (policy ``latest``)."""
        return self.policy == "latest"

    def to_dict(self) -> dict[str, Any]:
        """The ``stream_open`` fields (besides ``op`` and ``name``), as ``from_dict`` reads
        them."""
        return {
            "models": list(self.models),
            "policy": self.policy,
            "weight": self.weight,
            "fps": self.fps,
            "stall_after_s": self.stall_after_s,
        }

    @classmethod
    def from_dict(cls, message: Mapping[str, Any]) -> StreamSettings:
        """The settings a ``stream_open`` message carries: its ``WIRE_FIELDS``, each absent or
        null taking its default (but ``models``); the source's own take their defaults.

        Raises:
            InvalidArgumentError: A field missing or out of its range, naming it.
        """
        if message.get("models") is None:
            raise _wrong("models", f"a list of 1..{MAX_MODELS} distinct names", None)
        given = {name: message[name] for name in WIRE_FIELDS if message.get(name) is not None}
        return cls(**given)


def _number(name: str, value: object, least: float | None, high: float) -> float:
    """``value`` as a float: a number (no boolean) in [``least``, ``high``], or in (0,
    ``high``] without ``least``."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (least <= value <= high if least is not None else 0 < value <= high)
    ):
        return float(value)
    bounds = f"[{least:g}, {high:g}]" if least is not None else f"(0, {high:g}]"
    raise _wrong(name, f"a number in {bounds}", value)


def _wrong(name: str, expected: str, value: object) -> InvalidArgumentError:
    """INVALID_ARGUMENT for field ``name``, in the words of the supervisor's other fields."""
    problem = f"is missing ({expected})" if value is None else f"must be {expected}, not "
    shown = "" if value is None else echoed(value)
    return InvalidArgumentError(f"{name!r} {problem}{shown}")
