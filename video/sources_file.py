"""The sources file of ``duomo stream --sources FILE``: the cameras of a deployment, as YAML.

A list, one entry per source (docs/deployment.md, "Cameras")::

    - name: gate-3                       # the stream's name (required, unique in the file)
      url: rtsp://10.0.3.17/stream1      # what PyAV opens: a URL, a file or /dev/videoN
      models: [face, ocr]                # required unless the command line gives --model
      policy: latest                     # optional: latest | fifo (else --policy)
      max_fps: 10                        # optional (else --max-fps)

Any other key is an error, and so is a repeated name; ``read_sources`` raises
``SourcesFileError`` naming the file, the entry and the field. Read by ``video.command`` when
the command starts; imports pydantic and yaml only then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class SourcesFileError(ValueError):
    """A sources file that cannot be read or is not valid; the message says where."""


@dataclass(frozen=True)
class SourceEntry:
    """One source to play: where, under which stream name, into which models, how."""

    url: str
    name: str | None  # None: derived from the url (``locations.stream_names``)
    models: tuple[str, ...]
    policy: str
    max_fps: float | None


def read_sources(
    path: Path, models: Sequence[str], policy: str, max_fps: float | None
) -> list[SourceEntry]:
    """The entries of the file ``path``; ``models``, ``policy`` and ``max_fps`` (the command
    line's) fill what an entry leaves out."""
    import yaml
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    class Entry(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(min_length=1, max_length=64)
        url: str = Field(min_length=1)
        models: list[str] | None = Field(default=None, min_length=1)
        policy: str | None = Field(default=None, pattern="^(latest|fifo)$")
        max_fps: float | None = Field(default=None, gt=0)

    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SourcesFileError(f"{path}: cannot read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise SourcesFileError(f"{path}: not YAML ({err})") from None
    if not isinstance(raw, list) or not raw:
        raise SourcesFileError(f"{path}: must be a list of sources (name, url, models …)")
    entries: list[SourceEntry] = []
    for index, item in enumerate(raw):
        try:
            entry = Entry.model_validate(item)
        except ValidationError as err:
            problem = err.errors()[0]
            where = ".".join(str(part) for part in problem["loc"]) or "(entry)"
            raise SourcesFileError(f"{path}: [{index}].{where}: {problem['msg']}") from None
        if any(e.name == entry.name for e in entries):
            raise SourcesFileError(f"{path}: [{index}].name: {entry.name!r} is given twice")
        chosen = tuple(entry.models or models)
        if not chosen:
            raise SourcesFileError(f"{path}: [{index}].models: required (or give --model)")
        entries.append(
            SourceEntry(
                entry.url,
                entry.name,
                chosen,
                entry.policy or policy,
                entry.max_fps if entry.max_fps is not None else max_fps,
            )
        )
    return entries
