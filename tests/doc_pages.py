"""What a Markdown page offers to a link: its headings and their ``#anchors``, code left out.

Shared by the tests that keep pointers resolvable: ``tests/unit/test_docs.py`` (links between
pages) and ``tests/unit/test_doc_pointers.py`` (config comments that name a page and section).
Anchors follow GitHub's rule: the heading lower-cased, punctuation other than ``-`` and ``_``
dropped (CJK characters kept), spaces made ``-``.
"""

from __future__ import annotations

import re

FENCE = re.compile(r"^(```+)[^\n]*\n.*?^\1[ \t]*$", re.S | re.M)
HEADING = re.compile(r"^(#{1,6}) (.+?)[ \t]*$", re.M)


def without_code(text: str) -> str:
    return FENCE.sub("", text)


def headings(text: str) -> list[str]:
    """Each heading's level (``##``), in order."""
    return [m.group(1) for m in HEADING.finditer(without_code(text))]


def titles(text: str) -> list[str]:
    """Each heading's text as a reader sees it: without backticks and emphasis."""
    return [
        re.sub(r"`|\*\*?", "", m.group(2)).strip() for m in HEADING.finditer(without_code(text))
    ]


def anchor(title: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", re.sub(r"`|\*\*?", "", title).strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {anchor(title) for title in titles(text)}
