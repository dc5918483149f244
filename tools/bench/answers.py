"""What counts as a correct answer in ``duomo bench``: a result's summary (classification: the
top-1 class; face detection: the number of faces; OCR: the texts in reading order) must equal the
one the same executor gave in-process, alone, for the same image.

Used by ``tools.bench.inprocess`` (which makes the expected summaries) and by every producer.
Summaries are plain JSON values, so they travel to producer processes as they are. A server's
answer reaches a producer as a ``Reply``: the result, and the time the server itself spent in
the executor for it (``compute_s``), so that a round trip can be split into the model's work and
what the server adds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    result: Any  # the result dict, as the executor gave it
    compute_s: float  # the server's own time in the executor (prepare + execute)


def summary(result: Any) -> Any:
    """The part of a result that must not change between modes (JSON-normalised)."""
    if isinstance(result, dict) and "top" in result:
        value: Any = int(result["top"][0]["index"])
    elif isinstance(result, dict) and "faces" in result:
        value = len(result["faces"])
    elif isinstance(result, dict) and "lines" in result:
        value = [str(line["text"]) for line in result["lines"]]
    else:
        raise ValueError(f"duomo bench checks classification, face and OCR results, not {result!r}")
    return json.loads(json.dumps(value))


def is_correct(result: Any, expected: Any) -> bool:
    try:
        return bool(summary(result) == expected)
    except (ValueError, KeyError, TypeError, IndexError):
        return False
