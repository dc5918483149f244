"""The video source's small parts, without a video or a supervisor: what a SOURCE names and the
stream names derived from it (``video.locations``), the reconnect schedule (``video.backoff``),
the sources file of ``duomo stream --sources`` and its errors (``video.sources_file``), and the
supervisor link's wait when no supervisor is there (``video.supervisor_link``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from duomo.ipc.errors import UnavailableError
from duomo.video.backoff import Backoff
from duomo.video.locations import (
    MAX_STREAM_NAME,
    NETWORK_SCHEMES,
    SourceError,
    SourceKind,
    default_name,
    parse_location,
    stream_names,
)
from duomo.video.sources_file import SourceEntry, SourcesFileError, read_sources
from duomo.video.supervisor_link import SupervisorLink

# -- locations ---------------------------------------------------------------------------------


@pytest.fixture
def clip(tmp_path: Path) -> Path:
    """A file that exists (its contents are only read when it plays)."""
    path = tmp_path / "front door.mp4"
    path.write_bytes(b"")
    return path


def test_a_path_or_file_url_is_a_file_paced_and_not_live(clip: Path) -> None:
    for text in (str(clip), f"file://{clip}"):
        location = parse_location(text)
        assert (location.kind, location.url, location.text) == (SourceKind.FILE, str(clip), text)
        assert not location.live and location.timeout_s is None
        assert location.format is None and location.options == {}


def test_a_missing_file_is_an_error_naming_it(tmp_path: Path) -> None:
    for text in (str(tmp_path / "gone.mp4"), f"file://{tmp_path}/gone.mp4"):
        with pytest.raises(SourceError, match=f"^{text}: no such file$"):
            parse_location(text)
    with pytest.raises(SourceError, match="no such file"):
        parse_location(str(tmp_path))  # a folder is not a file


def test_network_urls_are_live_with_timeouts_and_rtsp_over_tcp() -> None:
    for scheme in NETWORK_SCHEMES:
        location = parse_location(f"{scheme}://10.0.3.17:554/stream1")
        assert location.kind is SourceKind.NETWORK and location.live, scheme
        assert location.url == f"{scheme}://10.0.3.17:554/stream1"
        assert location.timeout_s is not None and min(location.timeout_s) > 0
        want = {"rtsp_transport": "tcp"} if scheme.startswith("rtsp") else {}
        assert location.options == want, scheme
    assert parse_location("RTSP://cam/1").options == {"rtsp_transport": "tcp"}  # any case


def test_a_v4l2_device_is_live_and_forced_to_v4l2() -> None:
    location = parse_location("/dev/video2")
    assert (location.kind, location.format, location.url) == (
        SourceKind.DEVICE, "v4l2", "/dev/video2",
    )  # fmt: skip
    assert location.live and location.timeout_s is None


@pytest.mark.parametrize("text", ["gopher://camera/1", "ftp://host/clip.mp4", "rtp2://x/y"])
def test_an_unknown_scheme_is_an_error_listing_the_known_ones(text: str) -> None:
    scheme = text.split("://")[0]
    with pytest.raises(SourceError) as raised:
        parse_location(text)
    message = str(raised.value)
    assert message.startswith(f"{text}: unknown scheme {scheme}://")
    assert all(f"{known}://" in message for known in NETWORK_SCHEMES)


def test_default_names_come_from_the_file_the_url_or_the_device(clip: Path) -> None:
    named = {
        str(clip): "front_door",  # the stem; a space is no part of a name
        "rtsp://10.0.0.3/main/": "10.0.0.3/main",  # host and path, without the last slash
        "http://cam.local": "cam.local",
        "RTSP://Cam/x": "cam/x",  # (the host as the URL parser reads it)
        "rtsp://viewer:secret@gate:554/ch 1": "gate/ch_1",  # never the password or the port
        "udp://@:1234": "stream",  # nothing to name it after
        "/dev/video0": "video0",
    }
    for text, name in named.items():
        assert default_name(parse_location(text)) == name, text


def test_a_long_default_name_is_cut_to_the_supervisors_bound() -> None:
    location = parse_location("rtsp://host/" + "a" * 200)
    assert default_name(location) == ("host/" + "a" * 200)[:MAX_STREAM_NAME]


def test_stream_names_are_unique_given_or_derived(clip: Path) -> None:
    same = [parse_location(str(clip))] * 3
    assert stream_names(same) == ["front_door", "front_door-2", "front_door-3"]
    # given by position; None or missing: derived; repeated given names made unique too
    assert stream_names(same, ["gate", None]) == ["gate", "front_door", "front_door-2"]
    assert stream_names(same, ["gate", "gate", "gate"]) == ["gate", "gate-2", "gate-3"]
    # a derived name clashing with a given one yields to it
    assert stream_names(same, [None, "front_door"]) == [
        "front_door",
        "front_door-2",
        "front_door-3",
    ]


def test_a_unique_suffix_keeps_a_name_within_the_bound() -> None:
    long = "x" * MAX_STREAM_NAME
    location = parse_location("rtsp://cam/1")
    names = stream_names([location] * 12, [long] * 12)
    assert len(set(names)) == 12 and names[0] == long
    assert all(len(name) <= MAX_STREAM_NAME for name in names)
    assert names[1] == "x" * (MAX_STREAM_NAME - 2) + "-2"
    assert names[11] == "x" * (MAX_STREAM_NAME - 3) + "-12"


# -- backoff -----------------------------------------------------------------------------------


def test_the_backoff_doubles_from_half_a_second_to_ten() -> None:
    backoff = Backoff()
    delays = [backoff.next_delay_s() for _ in range(8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert backoff.attempts == 8


def test_a_reset_starts_the_schedule_again() -> None:
    backoff = Backoff()
    for _ in range(4):
        backoff.next_delay_s()
    backoff.reset()
    assert backoff.attempts == 0
    assert [backoff.next_delay_s(), backoff.next_delay_s()] == [0.5, 1.0]


def test_a_custom_backoff_keeps_its_bound() -> None:
    backoff = Backoff(first_s=0.1, max_s=0.25, factor=3.0)
    assert [round(backoff.next_delay_s(), 9) for _ in range(4)] == [0.1, 0.25, 0.25, 0.25]


# -- the sources file --------------------------------------------------------------------------


def sources(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sources.yaml"
    path.write_text(text)
    return path


def test_entries_take_the_command_lines_defaults_for_what_they_leave_out(tmp_path: Path) -> None:
    path = sources(
        tmp_path,
        "- {name: gate-3, url: 'rtsp://10.0.3.17/1', models: [face, ocr], max_fps: 10}\n"
        "- {name: dock, url: rtsp://10.0.3.21/1, policy: fifo}\n",
    )
    assert read_sources(path, ["classify"], "latest", 5.0) == [
        SourceEntry("rtsp://10.0.3.17/1", "gate-3", ("face", "ocr"), "latest", 10.0),
        SourceEntry("rtsp://10.0.3.21/1", "dock", ("classify",), "fifo", 5.0),
    ]
    assert read_sources(path, ["classify"], "fifo", None)[0].policy == "fifo"
    assert read_sources(path, ["classify"], "latest", None)[1].max_fps is None


GOOD = "name: a, url: x, models: [face]"  # an entry without fault, to add one to


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (f"- {{{GOOD}, colour: red}}\n", "[0].colour: Extra inputs are not permitted"),
        (f"- {{{GOOD}}}\n- {{name: a, url: y}}\n", "[1].name: 'a' is given twice"),
        ("- {name: a, models: [face]}\n", "[0].url: Field required"),
        ("- {url: x, models: [face]}\n", "[0].name: Field required"),
        ("- {name: a, url: x}\n", "[0].models: required (or give --model)"),
        ("- {name: a, url: x, models: []}\n", "[0].models: List should have at least 1 item"),
        (f"- {{{GOOD}, policy: newest}}\n", "[0].policy: String should match pattern"),
        (f"- {{{GOOD}, max_fps: 0}}\n", "[0].max_fps: Input should be greater than 0"),
        ("- {name: '', url: x, models: [face]}\n", "[0].name: String should have at least 1"),
        (f"- {{name: {'n' * 65}, url: x}}\n", "[0].name: String should have at most 64"),
        ("- {name: a, url: '', models: [face]}\n", "[0].url: String should have at least 1"),
        ("- just a string\n", "[0].(entry): Input should be a valid dictionary"),
        ("name: a\nurl: x\n", "must be a list of sources"),
        ("[]\n", "must be a list of sources"),
        ("- {name: a, url: [unclosed\n", "not YAML"),
    ],
)  # fmt: skip
def test_a_bad_file_names_the_entry_and_field(tmp_path: Path, text: str, said: str) -> None:
    path = sources(tmp_path, text)
    with pytest.raises(SourcesFileError) as raised:
        read_sources(path, [], "latest", None)
    message = str(raised.value)
    assert message.startswith(f"{path}: "), message
    assert said in message, message


def test_a_missing_file_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(SourcesFileError, match=r"gone\.yaml: cannot read \(No such file"):
        read_sources(tmp_path / "gone.yaml", ["face"], "latest", None)


# -- the supervisor link, with no supervisor ---------------------------------------------------


def test_the_link_without_a_supervisor_fails_at_once_or_after_its_wait(tmp_path: Path) -> None:
    link = SupervisorLink(tmp_path / "none.sock", backoff=Backoff(first_s=0.05, max_s=0.1))
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="no supervisor"):
        link.connect(0.0)
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="no supervisor"):
        link.connect(0.5)
    assert 0.5 <= time.monotonic() - started < 2.0
    assert link.current() == (None, 0)
    link.close()


def test_the_links_wait_ends_when_stopped(tmp_path: Path) -> None:
    link = SupervisorLink(tmp_path / "none.sock")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert link.connect(600.0, stop) is None
    assert time.monotonic() - started < 2.0
