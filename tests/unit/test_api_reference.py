"""docs/producer-api.md is what ``tools/api_reference.py`` generates from the docstrings now,
and the generator reads a Google-style docstring as it is meant."""

from __future__ import annotations

from tests.conftest import ROOT
from tools.api_reference import PAGE, markdown, render


def test_the_committed_page_is_current() -> None:
    assert PAGE.read_text("utf-8") == render(), (
        "docs/producer-api.md is stale: run .venv/bin/python tools/api_reference.py"
    )


def test_every_class_and_error_has_its_section() -> None:
    page = render()
    for heading in ("## `Client`", "## `ModelHandle`", "## `Slot`", "## Errors"):
        assert f"\n{heading}\n" in page
    for name in ("DuomoError", "ResourceExhaustedError", "ModelChangedError"):
        assert f"| `{name}` |" in page
    assert "### `ModelHandle.infer_async()`" in page
    assert PAGE.parent == ROOT / "docs"


def test_a_google_style_docstring_becomes_markdown() -> None:
    doc = (
        "A free slot; ``timeout_s=0`` refuses at once.\n\n"
        "Args:\n"
        "    timeout_s: how long to wait,\n"
        "        in seconds.\n\n"
        "Raises:\n"
        "    ResourceExhaustedError: none is free.\n\n"
        "Example:\n"
        "    with handle.slot() as s:\n"
        "        s.submit()\n\n"
        "The rest::\n\n"
        "    drawn\n"
    )
    assert markdown(doc) == (
        "A free slot; `timeout_s=0` refuses at once.\n\n"
        "**Args:**\n\n"
        "- timeout_s: how long to wait, in seconds.\n\n"
        "**Raises:**\n\n"
        "- ResourceExhaustedError: none is free.\n\n"
        "**Example:**\n\n"
        "```text\nwith handle.slot() as s:\n    s.submit()\n```\n\n"
        "The rest:\n\n"
        "```text\ndrawn\n```\n"
    )
