"""Every comment in ``configs/`` that names a document points at a page and section that exist.

A pointer is a Markdown page's path from the repository root (``docs/operations.md``; ``README``
alone is ``README.md``), optionally followed by a ``#anchor`` or by the section's heading in
double quotes (``docs/operations.md "Security and limits"``, ``README, "Ascend"``). A comment may
run over several lines; a path broken after its ``/`` is joined again. Headings and anchors are
read as ``tests/unit/test_docs.py`` reads them (``tests.doc_pages``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_pages import anchor, titles

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
POINTER = re.compile(
    r"(?<![\w./-])(README|(?:[\w.-]+/)*[\w.-]+\.md)"  # the page
    r"(?:#([\w-]+)|,?[ \t]+\"([^\"]+)\")?"  # then an anchor, or a heading in quotes
)


def comments(text: str) -> str:
    """The config's comments as one text: each line's comment, joined to the one before."""
    joined = ""
    for line in text.splitlines():
        if "#" not in line:
            continue
        comment = line.split("#", 1)[1].strip() if line.lstrip().startswith("#") else ""
        if not comment and " #" in line:  # a comment after a value
            comment = line.split(" #", 1)[1].strip()
        joined += comment if joined.endswith("/") else " " + comment
    return joined


def pointers(config: Path) -> list[tuple[str, str | None, str | None]]:
    return POINTER.findall(comments(config.read_text("utf-8")))


def test_pointers_are_read_as_written() -> None:
    text = """# see docs/operations.md "Security and limits"; every key: docs/
# configuration.md, and README, "Ascend".
max_batch: 1   # the rule: docs/benchmarks.md#batching-on-cpu
"""
    found = POINTER.findall(comments(text))
    assert [(page, fragment or heading) for page, fragment, heading in found] == [
        ("docs/operations.md", "Security and limits"),
        ("docs/configuration.md", ""),
        ("README", "Ascend"),
        ("docs/benchmarks.md", "batching-on-cpu"),
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_pointer_in_a_config_resolves(config: Path) -> None:
    for page, fragment, heading in pointers(config):
        path = ROOT / ("README.md" if page == "README" else page)
        assert path.is_file(), f"{page}: no such page"
        sections = titles(path.read_text("utf-8"))
        if heading:
            assert heading in sections, f'{page} "{heading}": no such heading'
        if fragment:
            assert fragment in {anchor(t) for t in sections}, f"{page}#{fragment}: no such heading"


def test_the_configs_point_somewhere() -> None:
    """The demo config's pointers are found at all (a pattern that matched none would pass)."""
    assert len(pointers(ROOT / "configs" / "default.yaml")) >= 5
