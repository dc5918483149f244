"""docs/adding-a-model.md, run as written against a real supervisor, so the guide cannot rot.

The guide marks the code blocks this test runs with words after the language in the block's
info string (GitHub shows only the language; a reader sees the file name in the text around):

    ```yaml file=PATH      the block is the whole of PATH (any language: written as it is)
    ```yaml append=PATH    the block is pasted at the end of PATH
    ```bash run            the block runs as one bash script (-e: every command must succeed)
    ```text output         what the run block before it prints, line by line; a number may
                           differ by 2 % + 0.02 from the one shown (another CPU), text not at all

Blocks without a mark are not run. The marked ones run in the guide's order in a temporary
folder laid out like the checkout the guide works in (``models/``, ``tests/fixtures/images/``
and ``examples/`` linked in), with this interpreter's ``bin/`` first on PATH (``duomo``,
``python``) and ``DUOMO_SOCKET`` set to a private socket: the guide's own ``duomo start`` starts
the supervisor there, and one it leaves running is stopped at the end.

Also checked: the files the guide writes into ``text_orientation/`` and its entry are those of
``examples/text_orientation/`` (the finished folder it points at); the executor class is at most
30 lines, as the guide says; an image sent as BGR is answered differently from the same image
as RGB, as the guide says.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT
from tests.integration.harness import short_socket_dir

GUIDE = ROOT / "docs" / "adding-a-model.md"
EXAMPLE = ROOT / "examples" / "text_orientation"
LINKED = ("models", "tests/fixtures/images", "examples")  # what the guide's commands read
FENCE = re.compile(r"^```(\S*)(.*)$")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    line: int  # where it starts in the guide (1-based), for messages
    language: str
    mark: str  # "file", "append", "run", "output" or "" (not run)
    target: str  # the PATH of file= and append=
    text: str


def guide_blocks(text: str) -> list[Block]:
    """Every fenced code block of the guide, with its mark."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        start = index
        index += 1
        body: list[str] = []
        while index < len(lines) and lines[index] != "```":
            body.append(lines[index])
            index += 1
        assert index < len(lines), f"{GUIDE.name}:{start + 1}: code block not closed"
        index += 1
        language, words = opening.group(1), opening.group(2).split()
        mark, _, target = (words[0] if words else "").partition("=")
        assert mark in ("", "file", "append", "run", "output"), (start + 1, mark)
        blocks.append(Block(start + 1, language, mark, target, "\n".join(body) + "\n"))
    return blocks


def differences(shown: str, printed: str) -> list[str]:
    """How ``printed`` differs from the output the guide shows (empty: it does not)."""
    expected, actual = shown.rstrip("\n").splitlines(), printed.rstrip("\n").splitlines()
    if len(expected) != len(actual):
        return [f"{len(actual)} lines printed, {len(expected)} shown"]
    found = []
    for want, got in zip(expected, actual):
        if NUMBER.split(want) != NUMBER.split(got) or not all(
            abs(float(a) - float(b)) <= 0.02 + 0.02 * abs(float(b))
            for a, b in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True)
        ):
            found.append(f"shown:   {want!r}\nprinted: {got!r}")
    return found


def checkout_like(folder: Path) -> None:
    for name in LINKED:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(ROOT / name, target_is_directory=True)


def stop_what_was_left(socket_path: Path, env: dict[str, str]) -> None:
    """``duomo stop``, and SIGKILL for a supervisor that is still there after it."""
    pid_file = socket_path.with_name(socket_path.name + ".pid")
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text().strip())
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(["duomo", "stop"], env=env, capture_output=True, timeout=90)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_the_guide_runs_as_written(tmp_path: Path) -> None:
    blocks = guide_blocks(GUIDE.read_text("utf-8"))
    assert [b for b in blocks if b.mark == "run"], "no block of the guide is marked to run"
    checkout_like(tmp_path)
    socket_dir = short_socket_dir()
    socket_path = socket_dir / "duomo.sock"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "DUOMO_SOCKET": str(socket_path),
    }
    printed: dict[int, str] = {}  # a run block's line -> its stdout
    last_run: Block | None = None
    try:
        for block in blocks:
            where = f"{GUIDE.name}:{block.line}"
            if block.mark in ("file", "append"):
                path = tmp_path / block.target
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("w" if block.mark == "file" else "a", encoding="utf-8") as out:
                    out.write(block.text)
            elif block.mark == "run":
                run = subprocess.run(
                    ["bash", "-e", "-c", block.text],
                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                )  # fmt: skip
                assert run.returncode == 0, f"{where}: exit {run.returncode}\n{run.stderr}"
                printed[block.line] = run.stdout
                last_run = block
            elif block.mark == "output":
                assert last_run is not None, f"{where}: output before any run block"
                found = differences(block.text, printed[last_run.line])
                assert not found, f"{where}: the output differs\n" + "\n".join(found)
    finally:
        stop_what_was_left(socket_path, env)
        shutil.rmtree(socket_dir, ignore_errors=True)

    # an image sent as BGR is answered, and differently from the same image sent as RGB
    lines = {ln.split()[0]: ln for out in printed.values() for ln in out.splitlines() if ln}
    assert "RGB" in lines and "BGR" in lines, "the guide no longer sends RGB and BGR"
    assert lines["RGB"].split()[1:] != lines["BGR"].split()[1:], lines

    # the guide's files are the example folder's, and its class as short as it says
    written = {b.target: b.text for b in blocks if b.mark == "file"}
    for name in ("executor.py", "test_text_orientation.py"):
        assert written[f"text_orientation/{name}"] == (EXAMPLE / name).read_text("utf-8"), name
    entries = [b.text for b in blocks if b.mark == "append" and "text_orientation" in b.text]
    assert entries == [(EXAMPLE / "entry.yaml").read_text("utf-8")]
    tree = ast.parse((EXAMPLE / "executor.py").read_text("utf-8"))
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 <= 30
