"""``ipc.records``: a record's dict form derived from its fields — nested records, lists and
objects of records, ``X | None``, enums, and the overrides (a key left out, derived keys, a field's
own ``write`` and ``read``) — and every key missing or of the wrong type an error naming the
record and the key."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from duomo.ipc.record_reading import RecordReader, StatusRecordError
from duomo.ipc.records import LEFT_OUT_WHEN_EMPTY, LEFT_OUT_WHEN_NONE, Record, left_out_with, wire


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass(frozen=True)
class Part(Record):
    name: str
    size: int
    weight: float | None


@dataclass(frozen=True)
class Whole(Record):
    id: int
    colour: Colour
    parts: tuple[Part, ...]
    by_name: dict[str, Part]
    counts: dict[str, int]
    shape: tuple[int | None, ...]
    extra: dict[str, Any]
    spare: Part | None = field(default=None, metadata=LEFT_OUT_WHEN_NONE)
    tail: str | None = field(default=None, metadata=left_out_with("spare"))
    tags: tuple[str, ...] = field(default=(), metadata=LEFT_OUT_WHEN_EMPTY)

    @property
    def total(self) -> int:
        return sum(p.size for p in self.parts)


@dataclass(frozen=True)
class Pair(Record):
    """Two fields that are one object on the wire, and a key derived from the record."""

    low: int = field(
        metadata=wire(
            write=lambda p: {"range": [p.low, p.high]},
            read=lambda r: r.array("range")[0],
        )
    )
    high: int = field(metadata=wire(write=lambda p: {}, read=lambda r: r.array("range")[1]))
    label: str = field(metadata=wire(then=lambda p: {"width": p.high - p.low}))


BOLT = {"name": "bolt", "size": 3, "weight": 1.5}
NUT = {"name": "nut", "size": 2, "weight": None}
WHOLE = {
    "id": 7,
    "colour": "green",
    "parts": [BOLT, NUT],
    "by_name": {"bolt": BOLT},
    "counts": {"ok": 4},
    "shape": [None, 4],
    "extra": {"anything": [1, "two"]},
}


def test_the_dict_form_reads_back_exactly_key_for_key_in_order() -> None:
    whole = Whole.from_dict(WHOLE)
    assert whole.colour is Colour.GREEN and whole.parts[1] == Part("nut", 2, None)
    assert whole.by_name == {"bolt": Part("bolt", 3, 1.5)} and whole.shape == (None, 4)
    assert whole.total == 5 and (whole.spare, whole.tail, whole.tags) == (None, None, ())
    assert json.dumps(whole.to_dict()) == json.dumps(WHOLE)  # left out: spare, tail, tags


def test_keys_left_out_come_and_go_together() -> None:
    full = {**WHOLE, "spare": BOLT, "tail": None, "tags": ["a"]}
    whole = Whole.from_dict(full)
    assert whole.spare == Part("bolt", 3, 1.5) and whole.tags == ("a",)
    assert whole.to_dict() == full
    without_tail = dict(full)
    del without_tail["tail"]  # there once ``spare`` is
    with pytest.raises(StatusRecordError, match="status record Whole: missing key 'tail'"):
        Whole.from_dict(without_tail)


def test_an_integer_stays_an_integer_where_a_number_is_declared() -> None:
    entry = {**BOLT, "weight": 2}
    part = Part.from_dict(entry)
    assert type(part.weight) is int and json.dumps(part.to_dict()) == json.dumps(entry)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"id": True}, "Whole: key 'id' must be an integer, not True"),
        ({"colour": "blue"}, "Whole: key 'colour' must be one of ['green', 'red']"),
        ({"shape": [1, "2"]}, "Whole: key 'shape' must be a list, each item an integer or null"),
        ({"counts": {"ok": 1.5}}, "Whole: key 'counts' must be an object, each value an integer"),
        ({"extra": []}, "Whole: key 'extra' must be an object, not []"),
        ({"parts": [BOLT, {**NUT, "size": "2"}]}, "Part: key 'size' must be an integer"),
        ({"parts": [BOLT, {"name": "nut", "size": 2}]}, "Part: missing key 'weight'"),
        ({"by_name": {"bolt": 3}}, "Part: expected an object, not 3"),
    ],
)
def test_a_key_of_the_wrong_type_names_its_record_and_key(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(StatusRecordError, match=message.replace("[", r"\[")):
        Whole.from_dict({**WHOLE, **change})


def test_a_missing_key_is_an_error_never_a_default() -> None:
    entry = dict(WHOLE)
    del entry["counts"]
    with pytest.raises(StatusRecordError) as raised:
        Whole.from_dict(entry)
    assert raised.value.message == "status record Whole: missing key 'counts'"


def test_a_fields_own_write_and_read_and_a_derived_key() -> None:
    pair = Pair(2, 5, "mid")
    assert json.dumps(pair.to_dict()) == json.dumps({"range": [2, 5], "label": "mid", "width": 3})
    assert Pair.from_dict({"range": [2, 5], "label": "mid", "width": 99}) == pair  # never read
    with pytest.raises(StatusRecordError, match="Pair: missing key 'range'"):
        Pair.from_dict({"label": "mid"})


def test_the_reader_names_the_record() -> None:
    with pytest.raises(StatusRecordError, match="status record Thing: expected an object"):
        RecordReader("Thing", [1])
