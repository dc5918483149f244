"""What an identity of a gallery is, and the checks on what goes into one.

An identity is a name (unique in its gallery), optional metadata (a JSON object) and one or more
embeddings. ``GalleryStore`` (``worker.galleries.store``) calls the checks here before it writes
anything, so a bad name, metadata or vector is an ``InvalidArgumentError`` naming what is wrong,
with nothing changed; ``exchange`` calls them on an import.

Names and metadata are shown to people and written to logs and events: no control or format
characters (category C: a terminal escape, a bidirectional override), no surrounding spaces,
bounded lengths. Vectors are stored at unit length, so a dot product is their cosine.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duomo.ipc.errors import InvalidArgumentError

MAX_NAME_CHARS = 128
MAX_METADATA_BYTES = 4096  # the metadata as compact JSON, UTF-8
MAX_METADATA_DEPTH = 4


@dataclass(frozen=True)
class Identity:
    """One identity as ``GalleryStore.identities`` lists it: ``created`` in seconds since the
    epoch, ``embeddings`` how many it has, and ``vectors`` (float32 embeddings × D, unit rows)
    only when they were asked for."""

    name: str
    metadata: dict[str, Any]
    created: float
    embeddings: int
    vectors: np.ndarray | None = None


def checked_name(name: object) -> str:
    """``name`` if it is fit to name an identity; InvalidArgumentError saying why not."""
    if not isinstance(name, str):
        raise InvalidArgumentError(
            f"an identity's name must be a string, got {type(name).__name__}"
        )
    if not name or name != name.strip():
        raise InvalidArgumentError(
            f"an identity's name must be non-empty, without surrounding spaces: {name!r}"
        )
    if len(name) > MAX_NAME_CHARS:
        raise InvalidArgumentError(
            f"an identity's name is {len(name)} characters, above the {MAX_NAME_CHARS} allowed"
        )
    _refuse_control(name, "the name")
    return name


def checked_metadata(metadata: object) -> dict[str, Any]:
    """``metadata`` (None: none) as a JSON object fit to keep: string keys, JSON values, no
    control characters in any string, at most ``MAX_METADATA_BYTES`` as JSON and
    ``MAX_METADATA_DEPTH`` levels deep; InvalidArgumentError saying what is wrong."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(
            f"an identity's metadata must be a JSON object, got {type(metadata).__name__}"
        )
    _check_json_value(metadata, "metadata", 0)
    size = len(metadata_json(dict(metadata)).encode())
    if size > MAX_METADATA_BYTES:
        raise InvalidArgumentError(
            f"an identity's metadata is {size} bytes as JSON, "
            f"above the {MAX_METADATA_BYTES} allowed"
        )
    return dict(metadata)


def metadata_json(metadata: Mapping[str, Any]) -> str:
    """The metadata as the file keeps it: compact JSON, keys sorted."""
    return json.dumps(metadata, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def unit_vectors(vectors: object, dimension: int) -> np.ndarray:
    """``vectors`` (one embedding of ``dimension`` numbers, or a sequence of them) as float32
    embeddings × ``dimension`` scaled to unit length; InvalidArgumentError for a wrong shape, a
    NaN or infinity, or a zero vector."""
    try:
        array = np.asarray(vectors, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(f"an embedding must be numbers: {err}") from None
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] != dimension or array.shape[0] == 0:
        raise InvalidArgumentError(
            f"expected one or more embeddings of {dimension} numbers, got shape {list(array.shape)}"
        )
    if not np.isfinite(array).all():
        raise InvalidArgumentError("an embedding holds a NaN or an infinity")
    norms = np.linalg.norm(array, axis=1, keepdims=True)
    if (norms == 0).any():
        raise InvalidArgumentError("an embedding is all zeros: it has no direction to compare")
    return np.ascontiguousarray(array / norms, dtype=np.float32)


def _check_json_value(value: object, where: str, depth: int) -> None:
    """``value`` is plain JSON (no NaN), its strings and keys without control characters."""
    if depth > MAX_METADATA_DEPTH:
        raise InvalidArgumentError(f"{where} is nested deeper than {MAX_METADATA_DEPTH} levels")
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{where} holds a NaN or an infinity")
        return
    if isinstance(value, str):
        _refuse_control(value, where)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(f"{where} has a key that is not a string: {key!r}")
            _refuse_control(key, f"{where}'s key {key!r}")
            _check_json_value(item, f"{where}.{key}", depth + 1)
        return
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]", depth + 1)
        return
    raise InvalidArgumentError(f"{where} is a {type(value).__name__}, not a JSON value")


def _refuse_control(text: str, what: str) -> None:
    for char in text:
        if unicodedata.category(char).startswith("C"):
            raise InvalidArgumentError(
                f"{what} holds the control or format character U+{ord(char):04X}: {text!r}"
            )
