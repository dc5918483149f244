"""The wire form of a record, derived once from its dataclass fields: ``Record.to_dict`` and
``Record.from_dict`` for every record of the supervisor's replies (``ipc.status_records``,
``ipc.model_records``, ``ipc.source_records``).

The rule: each field is one key, by its name, in field order, and its value follows its declared
type —

=============================  ===============================  ==================================
declared                       written                          read (else an error)
=============================  ===============================  ==================================
``int`` ``float`` ``str``      as it is                         an integer (never ``true``); an
``bool``                                                        integer or a decimal (kept as it
                                                                came); a string; true or false
``X | None``                   ``null`` or X                    ``null`` or X
an ``Enum``                    its value                        one of its values
``tuple[X, ...]``              a list                           a list of X
``dict[str, X]``               an object                        an object of X
a ``Record``                   its ``to_dict``                  its ``from_dict``
``Any``                        as it is                         anything
=============================  ===============================  ==================================

A key that is missing, or holds a value of the wrong type, raises ``StatusRecordError`` naming the
record and the key (``ipc.record_reading``): never a default, so a renamed key fails loudly. Where a
field's wire form differs from the rule, its ``dataclasses.field`` says how with ``wire(...)``
(``Wire``), and the record's docstring says why: a key left out (``LEFT_OUT_WHEN_NONE``,
``LEFT_OUT_WHEN_EMPTY``, ``left_out_with``), keys derived from the record and written after the
field (``then``), or the field's own ``write`` and ``read``.

A record's plan (each field's key, codec and overrides) is made on its first use and kept. This
module imports nothing but the standard library and ``ipc.record_reading``: ``ipc`` stays light.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from duomo.ipc.record_reading import JSON, RecordReader

R = TypeVar("R", bound="Record")
LeftOut = Callable[[Any, Mapping[str, Any]], bool]  # (the field's value, every field's) -> left out
WIRE = "duomo.wire"  # the key of a field's ``Wire`` in its metadata


@dataclasses.dataclass(frozen=True)
class Wire:
    """How one field's wire form differs from the rule (the module docstring).

    ``left_out``: the key is left out of the JSON when this holds of the field's value (and the
    record's fields); a missing key reads back as the field's default when this holds of that
    default, else it is an error as ever. ``then``: keys derived from the record, written right
    after the field and never read (one definition). ``write``: the record → the field's keys (any
    number of them, in place of its own). ``read``: the whole object → the field's value."""

    left_out: LeftOut | None = None
    then: Callable[[Any], JSON] | None = None
    write: Callable[[Any], JSON] | None = None
    read: Callable[[RecordReader], Any] | None = None


def wire(
    left_out: LeftOut | None = None,
    then: Callable[[Any], JSON] | None = None,
    write: Callable[[Any], JSON] | None = None,
    read: Callable[[RecordReader], Any] | None = None,
) -> dict[str, Wire]:
    """A field's metadata saying how its wire form differs: ``field(metadata=wire(...))``."""
    return {WIRE: Wire(left_out, then, write, read)}


LEFT_OUT_WHEN_NONE = wire(left_out=lambda value, _: value is None)
LEFT_OUT_WHEN_EMPTY = wire(left_out=lambda value, _: not value)


def left_out_with(other: str) -> dict[str, Wire]:
    """Left out, and may be missing, exactly when the field ``other`` (an earlier one) is None:
    keys that come and go together."""
    return wire(left_out=lambda _, fields: fields.get(other) is None)


class _Mismatch(Exception):
    """A value that is not what its field declares (the field's reader names the key)."""


@dataclasses.dataclass(frozen=True)
class _Codec:
    what: str  # what a value must be, for the error
    write: Callable[[Any], Any]
    read: Callable[[Any], Any]  # raises _Mismatch (a nested record: StatusRecordError)


def _is(check: Callable[[Any], bool]) -> Callable[[Any], Any]:
    def read(value: Any) -> Any:
        if not check(value):
            raise _Mismatch
        return value

    return read


def _same(value: Any) -> Any:
    return value


_SCALARS = {
    int: _Codec("an integer", _same, _is(lambda v: type(v) is int)),
    float: _Codec("a number", _same, _is(lambda v: type(v) in (int, float))),
    str: _Codec("a string", _same, _is(lambda v: isinstance(v, str))),
    bool: _Codec("true or false", _same, _is(lambda v: isinstance(v, bool))),
    Any: _Codec("anything", _same, _same),
}


def _codec(tp: Any) -> _Codec:
    """How a value of the declared type ``tp`` is written and read."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        [rest] = [a for a in args if a is not type(None)]  # (X | None: one X)
        inner = _codec(rest)
        return _Codec(
            f"{inner.what} or null",
            lambda v: None if v is None else inner.write(v),
            lambda v: None if v is None else inner.read(v),
        )
    if origin is tuple:
        return _tuple_codec(args)
    if origin is dict:
        return _dict_codec(args[1])
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = {member.value: member for member in tp}

        def read_member(v: Any) -> Any:
            if v not in values:
                raise _Mismatch
            return values[v]

        return _Codec(f"one of {sorted(values)}", lambda v: v.value, read_member)
    if isinstance(tp, type) and issubclass(tp, Record):
        return _Codec("an object", lambda v: v.to_dict(), tp.from_dict)
    raise TypeError(f"no wire form for the type {tp!r}")


def _tuple_codec(args: tuple[Any, ...]) -> _Codec:
    if len(args) == 2 and args[1] is Ellipsis:
        item = _codec(args[0])

        def read_items(v: Any) -> tuple[Any, ...]:
            if not isinstance(v, list):
                raise _Mismatch
            return tuple(item.read(x) for x in v)

        return _Codec(f"a list, each item {item.what}", lambda v: [item.write(x) for x in v],
                      read_items)  # fmt: skip
    items = [_codec(a) for a in args]

    def read_fixed(v: Any) -> tuple[Any, ...]:
        if not isinstance(v, list) or len(v) != len(items):
            raise _Mismatch
        return tuple(c.read(x) for c, x in zip(items, v))

    return _Codec(
        f"a list of {len(items)}: " + ", ".join(c.what for c in items),
        lambda v: [c.write(x) for c, x in zip(items, v)],
        read_fixed,
    )


def _dict_codec(value_type: Any) -> _Codec:
    item = _codec(value_type)

    def read_object(v: Any) -> dict[str, Any]:
        if not isinstance(v, Mapping):
            raise _Mismatch
        return {k: item.read(x) for k, x in v.items()}

    what = "an object" if value_type is Any else f"an object, each value {item.what}"
    return _Codec(what, lambda v: {k: item.write(x) for k, x in v.items()}, read_object)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    codec: _Codec
    wire: Wire
    default: Callable[[], Any] | None  # the field's default, made afresh (None: it has none)


def _plan(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    planned = []
    for f in dataclasses.fields(cls):
        default: Callable[[], Any] | None = None
        if f.default is not dataclasses.MISSING:
            default = (lambda value: lambda: value)(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        planned.append(_Field(f.name, _codec(hints[f.name]), f.metadata.get(WIRE, Wire()), default))
    return tuple(planned)


class Record:
    """A frozen dataclass of the supervisor's replies, whose dict form is derived from its
    fields (the module docstring). Subclasses are ``@dataclasses.dataclass(frozen=True)``."""

    _plans: ClassVar[dict[type, tuple[_Field, ...]]] = {}

    @classmethod
    def _fields(cls) -> tuple[_Field, ...]:
        planned = Record._plans.get(cls)
        if planned is None:  # (made twice by two threads at once: the same plan)
            planned = Record._plans[cls] = _plan(cls)
        return planned

    def to_dict(self) -> JSON:
        """The JSON object on the wire, key for key and in field order."""
        values = {f.name: getattr(self, f.name) for f in self._fields()}
        shown: JSON = {}
        for f in self._fields():
            value, w = values[f.name], f.wire
            if w.left_out is not None and w.left_out(value, values):
                continue
            if w.write is not None:
                shown.update(w.write(self))
            else:
                shown[f.name] = f.codec.write(value)
            if w.then is not None:
                shown.update(w.then(self))
        return shown

    @classmethod
    def from_dict(cls: type[R], data: object) -> R:
        """The record of the JSON object ``data``; StatusRecordError (naming the record and the
        key) for a key missing or of the wrong type."""
        r = RecordReader(cls.__name__, data)
        values: dict[str, Any] = {}
        for f in cls._fields():
            w = f.wire
            if w.read is not None:
                values[f.name] = w.read(r)
            elif f.name in r.data:
                try:
                    values[f.name] = f.codec.read(r.data[f.name])
                except _Mismatch:
                    raise r.wrong(f.name, f.codec.what) from None
            else:
                values[f.name] = _absent(r, f, values)
        return cls(**values)


def _absent(r: RecordReader, f: _Field, values: Mapping[str, Any]) -> Any:
    """The value of a field whose key is missing: its default where the field may be left out
    (and is, with that value), else the error."""
    if f.wire.left_out is not None and f.default is not None:
        default = f.default()
        if f.wire.left_out(default, values):
            return default
    return r.value(f.name)  # (raises: the key is missing)
