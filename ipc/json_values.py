"""What JSON gets for the numpy values answers carry: an array as nested lists, a numpy scalar
as its Python number (``json_default``, the ``default`` of ``json.dumps`` and ``orjson.dumps``).

Called wherever an answer becomes JSON outside the slots: ``duomo infer --json``
(``supervisor.operators.cli``), ``duomo stream``'s answer lines (``video.answer_lines``) and the
sinks' events (``sinks.events``).
"""

from __future__ import annotations

import numpy as np


def json_default(value: object) -> object:
    """``value`` as JSON can hold it (raw models answer arrays; orjson passes on arrays it does
    not take itself: not C-contiguous, float16, objects); TypeError for anything else."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
