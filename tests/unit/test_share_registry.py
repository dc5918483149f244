"""The share registry both backends use (``worker.backends.shares``): a thing is made once per
key however many acquire it at once, users are counted and the last release hands the thing
back, a failed making is not kept, and ``fresh`` supplants an outgrown thing; and the one file
identity their keys are made of."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from duomo.worker.backends.shares import ShareRegistry, file_identity


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "condition not met in time"
        time.sleep(0.001)


def test_acquirers_of_a_key_being_made_wait_for_it_and_it_is_made_once() -> None:
    registry: ShareRegistry[str, object] = ShareRegistry()
    gate, made = threading.Event(), []

    def make() -> object:
        gate.wait(5)
        made.append(object())
        return made[-1]

    leases = []
    threads = [threading.Thread(target=lambda: leases.append(registry.acquire("k", make)))]
    threads[0].start()
    wait_until(lambda: registry.users() == {"k": 1})  # the maker is in ``make``
    assert registry.get("k") is None  # not made yet
    threads.append(threading.Thread(target=lambda: leases.append(registry.acquire("k", make))))
    threads[1].start()
    wait_until(lambda: registry.users() == {"k": 2})  # the second waits instead of making
    gate.set()
    for thread in threads:
        thread.join(5)
    assert len(made) == 1 and [lease.thing for lease in leases] == [made[0], made[0]]
    assert registry.get("k") is made[0] and registry.things() == [made[0]]
    assert registry.release(leases[0]) is None  # another still uses it
    assert registry.release(leases[1]) is made[0]  # the last: handed back, and gone
    assert registry.users() == {} and registry.get("k") is None


def test_a_failed_making_is_raised_to_the_waiters_and_not_kept() -> None:
    registry: ShareRegistry[str, str] = ShareRegistry()
    gate = threading.Event()

    def failing() -> str:
        gate.wait(5)
        raise OSError("no memory")

    errors: list[BaseException] = []

    def acquire() -> None:
        try:
            registry.acquire("k", failing)
        except OSError as err:
            errors.append(err)

    threads = [threading.Thread(target=acquire) for _ in range(2)]
    threads[0].start()
    wait_until(lambda: registry.users() == {"k": 1})
    threads[1].start()
    wait_until(lambda: registry.users() == {"k": 2})
    gate.set()
    for thread in threads:
        thread.join(5)
    assert len(errors) == 2 and errors[0] is errors[1]  # the maker's error, raised to both
    assert registry.users() == {}  # no entry, no use left counted
    lease = registry.acquire("k", lambda: "made")  # the next acquirer makes it again
    assert lease.thing == "made" and registry.users() == {"k": 1}


def test_fresh_supplants_the_thing_and_the_old_one_stays_with_its_users() -> None:
    registry: ShareRegistry[str, list[int]] = ShareRegistry()
    small = registry.acquire("work", lambda: [1])
    large = registry.acquire("work", lambda: [4], fresh=True)
    later = registry.acquire("work", lambda: [9])
    assert later.thing is large.thing and registry.users() == {"work": 2}
    assert registry.release(small) == [1]  # its last user: handed back, the new one untouched
    assert registry.users() == {"work": 2} and registry.get("work") == [4]
    assert registry.release(later) is None and registry.release(large) == [4]
    assert registry.things() == []


def test_a_failed_fresh_making_leaves_the_outgrown_thing_shared_under_its_key() -> None:
    registry: ShareRegistry[str, list[int]] = ShareRegistry()
    small = registry.acquire("work", lambda: [1])

    def no_room() -> list[int]:
        raise MemoryError("no room for the larger one")

    with pytest.raises(MemoryError):
        registry.acquire("work", no_room, fresh=True)
    assert registry.get("work") == [1] and registry.users() == {"work": 1}
    again = registry.acquire("work", lambda: [9])  # found, not made again
    assert again.thing is small.thing and registry.users() == {"work": 2}
    assert registry.release(again) is None and registry.release(small) == [1]
    with pytest.raises(MemoryError):  # nothing to fall back on: the key is left empty
        registry.acquire("work", no_room, fresh=True)
    assert registry.users() == {} and registry.get("work") is None


def test_a_thing_alone_is_not_shared_and_its_release_hands_it_back() -> None:
    registry: ShareRegistry[str, str] = ShareRegistry()
    lease = registry.alone("own")
    assert lease.key is None and registry.users() == {} and registry.things() == []
    assert registry.release(lease) == "own"


def test_the_file_identity_follows_links_and_tells_a_replaced_file_apart(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    link = tmp_path / "replica.onnx"
    link.symlink_to(model)
    assert file_identity(link) == file_identity(model)
    before = file_identity(model)
    copy = tmp_path / "copy.onnx"
    shutil.copy2(model, copy)  # same bytes, size and mtime: another inode
    os.replace(copy, model)
    after = file_identity(model)
    assert (after.path, after.size, after.mtime_ns) == (before.path, before.size, before.mtime_ns)
    assert after != before and after.key != before.key


def test_an_identity_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        file_identity(tmp_path / "gone.onnx")
