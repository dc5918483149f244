"""Reading the supervisor's replies about itself, key by key: what ``duomo.ipc.model_records``
and ``duomo.ipc.status_records`` build their ``from_dict`` on.

A key that is missing, or holds a value of the wrong type, raises ``StatusRecordError`` naming
the record and the key: never a default, so a renamed key fails loudly instead of showing 0 or
"UNKNOWN".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from duomo.ipc.errors import InternalError

T = TypeVar("T")
JSON = dict[str, Any]


class StatusRecordError(InternalError):
    """A reply about the supervisor that does not have the documented shape: a key missing or
    of the wrong type (the supervisor and its reader disagree on the wire)."""


class RecordReader:
    """One JSON object read as one record: each key checked once, by name."""

    def __init__(self, record: str, data: object) -> None:
        if not isinstance(data, Mapping):
            raise StatusRecordError(f"status record {record}: expected an object, not {data!r:.80}")
        self.record = record
        self.data = data

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise StatusRecordError(f"status record {self.record}: missing key {key!r}")
        return self.data[key]

    def wrong(self, key: str, expected: str) -> StatusRecordError:
        value = self.data.get(key)
        return StatusRecordError(
            f"status record {self.record}: key {key!r} must be {expected}, not {value!r:.80}"
        )

    def integer(self, key: str) -> int:
        value = self._get(key)
        if type(value) is not int:
            raise self.wrong(key, "an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self._get(key) is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self._get(key)
        if type(value) not in (int, float):
            raise self.wrong(key, "a number")
        return value  # (an integer stays one: read back, the wire is unchanged)

    def optional_number(self, key: str) -> float | None:
        return None if self._get(key) is None else self.number(key)

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self.wrong(key, "a string")
        return value

    def optional_text(self, key: str) -> str | None:
        return None if self._get(key) is None else self.text(key)

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self.wrong(key, "true or false")
        return value

    def optional_flag(self, key: str) -> bool | None:
        return None if self._get(key) is None else self.flag(key)

    def object(self, key: str) -> dict[str, Any]:
        value = self._get(key)
        if not isinstance(value, Mapping):
            raise self.wrong(key, "an object")
        return dict(value)

    def optional_object(self, key: str) -> dict[str, Any] | None:
        return None if self._get(key) is None else self.object(key)

    def array(self, key: str) -> list[Any]:
        value = self._get(key)
        if not isinstance(value, list):
            raise self.wrong(key, "a list")
        return value

    def records(self, key: str, read: Callable[[Any], T]) -> tuple[T, ...]:
        return tuple(read(item) for item in self.array(key))


def read_counts(reader: RecordReader, key: str) -> dict[str, int]:
    counts = reader.object(key)
    if not all(type(v) is int for v in counts.values()):
        raise reader.wrong(key, "an object of integer counts")
    return counts
