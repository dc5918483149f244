"""Write docs/producer-api.md: the producer API's reference, generated from its docstrings.

    .venv/bin/python tools/api_reference.py           # rewrites docs/producer-api.md
    .venv/bin/python tools/api_reference.py --check   # exit 1 if the page is stale

The page documents what a producer imports from ``ipc``: ``Client``, ``ModelHandle``,
``Slot``, and a camera's ``Stream`` with its ``StreamAnswer`` and ``Filler`` (each class's
docstring and signature, then every public method and property in source order), and the
errors (``ipc.errors``'s module docstring, which draws the hierarchy, and each class with its
code). Nothing is written by hand: a change to a docstring is a change
to the page, and ``tests/unit/test_api_reference.py`` fails until the page is regenerated.

Docstrings are read as the code base writes them: reStructuredText literals (````x````) become
Markdown code, a paragraph ending in ``::`` introduces the indented block after it, and the
Google-style sections (``Example:``, ``Args:``, ``Returns:``, ``Raises:`` …) become a bold
label with the example fenced and the entries listed. Only ``inspect`` is used: importing
``ipc`` needs nothing but numpy.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "producer-api.md"
CLASSES = (
    "Client", "ModelHandle", "Slot", "Stream", "StreamAnswer", "FrameTime", "Filler",
    "GalleryHandle", "GalleryInfo",
)  # fmt: skip
CODE_SECTIONS = ("Example", "Examples")
LIST_SECTIONS = ("Args", "Arguments", "Attributes", "Raises", "Returns", "Yields")
TEXT_SECTIONS = ("Note", "Notes", "Warning", "Blocks")
SECTION = re.compile(rf"^({'|'.join(CODE_SECTIONS + LIST_SECTIONS + TEXT_SECTIONS)}):\s*$")

HEADER = """\
# Producer API reference

English · [中文](zh/producer-api.md) · [README](../README.md)

What a producer process imports from `duomo` (`from duomo import Client`, the same names as
`duomo.ipc`'s): the client, an attached model's handle, a slot, a camera's stream with its
answers, and the errors every call may raise.
How they are used, by example: [producers](../README.md#producers); the threads behind them:
[architecture](architecture.md#concurrency).

This page is generated from the docstrings by `tools/api_reference.py`; edit those, then run
`.venv/bin/python tools/api_reference.py` (`tests/unit/test_api_reference.py` fails while the
page is stale).
"""


def markdown(doc: str) -> str:
    """One docstring (already ``inspect.cleandoc``-ed) as Markdown."""
    out: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        section = SECTION.match(line.strip()) if not line.startswith(" ") else None
        literal = line.rstrip().endswith("::")
        if section or literal:
            block, i = _indented(lines, i + 1)
            if section:
                name = section.group(1)
                out.append(f"**{name}:**")
                if name in CODE_SECTIONS:
                    out += ["", *_fenced(block)]
                elif name in LIST_SECTIONS:
                    out += ["", *_entries(block)]
                else:
                    out += ["", *(_inline(b) for b in block)]
            else:
                text = line.rstrip()[:-2].rstrip()
                if text:
                    out.append(_inline(text + ":"))
                out += ["", *_fenced(block)]
            continue
        out.append(_inline(line))
        i += 1
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out).strip()) + "\n"


def _indented(lines: list[str], start: int) -> tuple[list[str], int]:
    """The indented block from ``start`` (after blank lines), dedented, and where it ends."""
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    block: list[str] = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
        block.append(lines[i])
        i += 1
    while block and not block[-1].strip():
        block.pop()
    indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
    return [b[indent:] for b in block], i


def _fenced(block: list[str]) -> list[str]:
    return ["```text", *block, "```", ""]


def _entries(block: list[str]) -> list[str]:
    """A Google-style section's entries as a list, continuation lines joined to their entry."""
    items: list[str] = []
    for line in block:
        if line and not line.startswith(" "):
            items.append(line.strip())
        elif items and line.strip():
            items[-1] += " " + line.strip()
    return [f"- {_inline(item)}" for item in items] + [""]


def _inline(text: str) -> str:
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _signature(obj: Any, name: str) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    signature = signature.replace(parameters=params)
    if inspect.isclass(obj):  # a constructor's ``-> None`` says nothing
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    return f"{name}{signature}".replace("'", "")


def _members(cls: type) -> Iterator[tuple[str, str, str]]:
    """(heading, signature, docstring) for each public method and property, in source order."""
    for name, obj in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, property):
            returns = inspect.signature(obj.fget).return_annotation if obj.fget else None
            shown = f"{cls.__name__}.{name}" + (f": {returns}" if isinstance(returns, str) else "")
            yield f"{cls.__name__}.{name}", shown + "  (property)", inspect.getdoc(obj) or ""
        elif inspect.isfunction(obj):
            shown = _signature(obj, f"{cls.__name__}.{name}")
            yield f"{cls.__name__}.{name}()", shown, inspect.getdoc(obj) or ""


def _class_section(cls: type) -> list[str]:
    out = [f"## `{cls.__name__}`", "", "```text", _signature(cls, cls.__name__), "```", ""]
    doc = inspect.getdoc(cls)
    out += [markdown(doc) if doc and cls.__doc__ else "(no docstring)\n"]
    for heading, shown, doc in _members(cls):
        out += [f"### `{heading}`", "", "```text", shown, "```", ""]
        out += [markdown(doc) if doc else "(no docstring)\n"]
    return out


def _errors_section(errors: Any) -> list[str]:
    out = ["## Errors", "", f"From `{errors.__name__}`.", ""]
    out += [markdown(inspect.getdoc(errors) or "")]
    out += ["| class | base | code | what it means |", "|---|---|---|---|"]
    classes: list[Any] = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, errors.DuomoError)
    ]
    drawn = dict(re.findall(r"(\w+Error) {2,}(.+)", errors.__doc__ or ""))
    for cls in classes:
        base = cls.__bases__[0].__name__
        own = cls.__dict__.get("__doc__") or ""
        meaning = " ".join(inspect.cleandoc(own).split("\n\n")[0].split()) if own else ""
        meaning = meaning or drawn.get(cls.__name__, "").strip()
        code = f"`{cls.code.name}` ({int(cls.code)})"
        out.append(f"| `{cls.__name__}` | `{base}` | {code} | {_inline(meaning)} |")
    codes = ", ".join(f"`{code.name}` = {int(code)}" for code in errors.ErrorCode)
    out += ["", f"`ErrorCode` (on the wire; never renumbered): {codes}.", ""]
    return out


def render() -> str:
    """The page, as the code's docstrings are now."""
    import duomo.ipc as ipc
    import duomo.ipc.errors

    out = [HEADER]
    if ipc.__doc__:
        out += ["## The package", "", markdown(inspect.getdoc(ipc) or "")]
    for name in CLASSES:
        out += _class_section(getattr(ipc, name))
    out += _errors_section(duomo.ipc.errors)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = render()
    if args.check:
        stale = not PAGE.is_file() or PAGE.read_text("utf-8") != page
        print(f"{PAGE.relative_to(ROOT)} is {'stale' if stale else 'current'}")
        return int(stale)
    PAGE.write_text(page, "utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
