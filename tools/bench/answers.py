"""What counts as a correct answer in ``duomo bench``: a result's summary (classification: the
top-1 class; face detection: the number of faces; OCR: the texts in reading order) must equal the
one the same executor gave in-process, alone, for the same image.

Used by ``tools.bench.inprocess`` (which makes the expected summaries) and by every producer.
Summaries are plain JSON values, so they travel to producer processes as they are.
"""

from __future__ import annotations

import json
from typing import Any


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
