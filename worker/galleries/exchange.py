"""A gallery's export and import: one JSON document, the format below (``EXCHANGE_FORMAT``).

::

    {
      "format": "duomo-gallery-export",
      "format_version": 1,
      "embedding_model": "sface",
      "dimension": 128,
      "identities": [
        {"name": "Ada", "metadata": {"badge": 7}, "created": 1796600000.0,
         "embeddings": [[0.0123, -0.0456, ...], ...]},
        ...
      ]
    }

Each embedding is D numbers, unit length, each float32 written exactly (as the float64 that
equals it); an import scales each vector to unit length again, so export → import gives the same
vectors to float32 rounding (measured: within 1e-7). ``created`` is
informative: an import enrols at the time of the import. The document holds biometric data:
whoever exports a gallery keeps the export as carefully as the gallery.

An import checks the whole document first (its format, the gallery's embedding model and
dimension, every name, metadata and vector, the bounds) and enrols every identity in one
transaction: all of them, or, on any error, none. Callers: the gallery tools (the CLI's
``export`` / ``import``), tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from duomo.ipc.errors import InvalidArgumentError
from duomo.worker.galleries.store import DEFAULT_LIMITS, GalleryLimits, GalleryStore, NewIdentity

EXCHANGE_FORMAT = "duomo-gallery-export"
EXCHANGE_VERSION = 1


def export_document(store: GalleryStore) -> dict[str, Any]:
    """Every identity of ``store``, with its embeddings, as the export document."""
    return {
        "format": EXCHANGE_FORMAT,
        "format_version": EXCHANGE_VERSION,
        "embedding_model": store.embedding_model,
        "dimension": store.dimension,
        "identities": [
            {
                "name": identity.name,
                "metadata": identity.metadata,
                "created": identity.created,
                "embeddings": [] if identity.vectors is None else identity.vectors.tolist(),
            }
            for identity in store.identities(with_embeddings=True)
        ],
    }


def export_gallery(store: GalleryStore, path: Path) -> int:
    """Write ``store``'s export document to ``path`` (owner-only); how many identities."""
    document = export_document(store)
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(json.dumps(document, ensure_ascii=False))
    return len(document["identities"])


def import_document(
    store: GalleryStore,
    document: Any,
    replace: bool = False,
    limits: GalleryLimits = DEFAULT_LIMITS,
) -> int:
    """Enrol every identity of an export ``document`` into ``store`` (one transaction: all or
    none); with ``replace`` a name already there is replaced, else it is an error. How many."""
    if not isinstance(document, dict) or document.get("format") != EXCHANGE_FORMAT:
        raise InvalidArgumentError(f"not a gallery export (its format is not {EXCHANGE_FORMAT!r})")
    version = document.get("format_version")
    if not isinstance(version, int) or version > EXCHANGE_VERSION:
        raise InvalidArgumentError(
            f"gallery export format {version!r}, newer than this Duomo reads ({EXCHANGE_VERSION})"
        )
    model, dimension = document.get("embedding_model"), document.get("dimension")
    if (model, dimension) != (store.embedding_model, store.dimension):
        raise InvalidArgumentError(
            f"an export of {model!r} embeddings of {dimension}, and {store.path.name} holds "
            f"{store.embedding_model!r} embeddings of {store.dimension}"
        )
    entries = document.get("identities")
    if not isinstance(entries, list):
        raise InvalidArgumentError("a gallery export's 'identities' must be a list")
    identities = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "name" not in entry or "embeddings" not in entry:
            raise InvalidArgumentError(f"identities[{i}] needs a 'name' and 'embeddings'")
        identities.append(NewIdentity(entry["name"], entry["embeddings"], entry.get("metadata")))
    return store.add_many(identities, replace, limits)


def import_gallery(
    store: GalleryStore,
    path: Path,
    replace: bool = False,
    limits: GalleryLimits = DEFAULT_LIMITS,
) -> int:
    """``import_document`` of the export at ``path``; InvalidArgumentError if it is not JSON."""
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidArgumentError(f"{path}: not a readable gallery export ({err})") from None
    return import_document(store, document, replace, limits)
