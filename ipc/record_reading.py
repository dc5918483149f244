"""Reading one JSON object of the supervisor's replies as one record, key by key: the error every
reader of those replies raises (``StatusRecordError``), and the reader that ``ipc.records``
derives each record's ``from_dict`` on (a field whose wire form differs reads through it too).

A key that is missing, or holds a value of the wrong type, raises ``StatusRecordError`` naming
the record and the key: never a default, so a renamed key fails loudly instead of showing 0 or
"UNKNOWN".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from duomo.ipc.errors import InternalError

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

    def value(self, key: str) -> Any:
        """The value at ``key``, whatever it is; the error when the key is missing."""
        if key not in self.data:
            raise StatusRecordError(f"status record {self.record}: missing key {key!r}")
        return self.data[key]

    def wrong(self, key: str, expected: str) -> StatusRecordError:
        """The error for the value at ``key``, which is not ``expected``."""
        value = self.data.get(key)
        return StatusRecordError(
            f"status record {self.record}: key {key!r} must be {expected}, not {value!r:.80}"
        )

    def optional_number(self, key: str) -> float | None:
        value = self.value(key)
        if value is not None and type(value) not in (int, float):
            raise self.wrong(key, "a number or null")
        return value  # (an integer stays one: read back, the wire is unchanged)

    def object(self, key: str) -> dict[str, Any]:
        value = self.value(key)
        if not isinstance(value, Mapping):
            raise self.wrong(key, "an object")
        return dict(value)

    def array(self, key: str) -> list[Any]:
        value = self.value(key)
        if not isinstance(value, list):
            raise self.wrong(key, "a list")
        return value
