"""The documented shape of the supervisor's ``status`` and ``models`` replies
(``tests/fixtures/status.json``, ``models.json``: taken from a running supervisor), and entries
built from it with a test's own values: a view under test reads complete records, as it does
from the wire, so a key the supervisor renames fails here too."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
DOCUMENTED_STATUS: dict[str, Any] = json.loads((FIXTURES / "status.json").read_text())
DOCUMENTED_MODELS: list[dict[str, Any]] = json.loads((FIXTURES / "models.json").read_text())
MERGED = ("memory", "compute", "totals")  # a model's objects a test gives in part


def model_entry(**fields: Any) -> dict[str, Any]:
    """The documented model's entry with ``fields`` in its place (``memory``, ``compute`` and
    ``totals`` merged into the documented ones)."""
    entry = copy.deepcopy(DOCUMENTED_STATUS["models"]["classify"])
    for key, value in fields.items():
        entry[key] = {**entry[key], **value} if key in MERGED else value
    return entry


def device_entry(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(DOCUMENTED_STATUS["devices"][0]), **fields}


def gateway_entry(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(DOCUMENTED_STATUS["gateways"][0]), **fields}


def client_entry(rings: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A client with ``rings`` (each completed from the documented ring)."""
    documented = DOCUMENTED_STATUS["clients"][0]
    shown = [{**documented["rings"][0], **ring} for ring in rings]
    return {**copy.deepcopy(documented), "rings": shown, **fields}


def status_entry(models: dict[str, dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The documented status with ``models`` and ``fields`` in their place."""
    return {**copy.deepcopy(DOCUMENTED_STATUS), "models": models, **fields}
