"""The documents keep in step: every English page has its Chinese twin with the same headings
and the same fenced code blocks, each links the other, and every relative link (and its
``#anchor``) resolves.

The pages: ``README.md`` ↔ ``README.zh-CN.md``, and each ``docs/NAME.md`` ↔ ``docs/zh/NAME.md``;
a generated reference's twin (``GENERATED``) is a translated introduction, held to the links only.
Headings and anchors (GitHub's rule) come from ``tests.doc_pages``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_pages import FENCE, anchors, headings, without_code

ROOT = Path(__file__).resolve().parents[2]
ENGLISH = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Generated references (tools/api_reference.py): their twin is a translated introduction that
# links to the English page, so only the links both ways are required of it.
GENERATED = {ROOT / "docs" / "producer-api.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def twin(page: Path) -> Path:
    if page == ROOT / "README.md":
        return ROOT / "README.zh-CN.md"
    return page.parent / "zh" / page.name


def relative_links(page: Path) -> list[str]:
    return [
        link
        for link in LINK.findall(without_code(page.read_text("utf-8")))
        if not re.match(r"[a-z]+:", link)
    ]


@pytest.mark.parametrize("page", ENGLISH, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_has_a_chinese_twin_in_step(page: Path) -> None:
    chinese = twin(page)
    assert chinese.is_file(), f"{chinese.relative_to(ROOT)} is missing"
    en, zh = page.read_text("utf-8"), chinese.read_text("utf-8")
    if page not in GENERATED:
        assert headings(zh) == headings(en), "the same headings, level by level"
        en_blocks = [m.group(0) for m in FENCE.finditer(en)]
        zh_blocks = [m.group(0) for m in FENCE.finditer(zh)]
        assert zh_blocks == en_blocks, "the same fenced code blocks, in the same order"
    back = Path("..") / page.name if page.parent != ROOT else Path(page.name)
    assert any(Path(link.partition("#")[0]) == back for link in relative_links(chinese)), (
        f"{chinese.relative_to(ROOT)} links back to {back}"
    )
    there = chinese.relative_to(page.parent)
    assert any(Path(link.partition("#")[0]) == there for link in relative_links(page)), (
        f"{page.relative_to(ROOT)} links to {there}"
    )


@pytest.mark.parametrize(
    "page",
    [p for p in (*ENGLISH, *map(twin, ENGLISH)) if p.is_file()],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_relative_link_resolves(page: Path) -> None:
    for link in relative_links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{link}: no such file"
        if fragment and target.suffix == ".md":
            assert fragment in anchors(target.read_text("utf-8")), f"{link}: no such heading"
