"""The managed sources' parts that need no process: a source's definition and its URL's secrets,
its health's state machine, the records on the wire, the config section and the control
messages (the fleet itself runs in tests/integration/test_managed_sources.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from pydantic import ValidationError

from duomo.ipc.errors import InvalidArgumentError, NotFoundError
from duomo.ipc.record_reading import StatusRecordError
from duomo.ipc.source_records import NO_REPORT, SourceReport, SourceStatus
from duomo.ipc.source_urls import SecretError, check_url, expand_url, mask_text, mask_url
from duomo.supervisor.config import ConfigError, load_config
from duomo.supervisor.process.control_messages import SourceAdd, SourceReports, parse_control
from duomo.supervisor.sources.definition import SourceDefinition
from duomo.supervisor.sources.fleet import SourceFleet
from duomo.supervisor.sources.store import SourceStore
from duomo.supervisor.sources.workers import SourceWorkersConfig
from duomo.video.health import PERMANENT_AFTER, SourceHealth, permanent_reason
from tests.unit.test_config import classify, write_config


def test_a_url_is_shown_masked_and_filled_in_only_when_opened(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CAM_PASSWORD", "p@ss/w:rd")
    monkeypatch.setenv("CAM_HOST", "10.0.0.3")
    written = "rtsp://admin:${CAM_PASSWORD}@${CAM_HOST}:554/main?token=${CAM_HOST}"
    assert mask_url(written) == "rtsp://admin:***@${CAM_HOST}:554/main?token=${CAM_HOST}"
    # in the user and password a value is percent-encoded; elsewhere it goes as it is
    assert expand_url(written) == "rtsp://admin:p%40ss%2Fw%3Ard@10.0.0.3:554/main?token=10.0.0.3"
    secret = tmp_path / "password"
    secret.write_text("from-a-file\nignored\n")
    assert expand_url("rtsp://viewer@[::1]:8554/cam", secret) == (
        "rtsp://viewer:from-a-file@[::1]:8554/cam"
    )
    with pytest.raises(SecretError, match="CAM_MISSING is not set") as missing:
        expand_url("rtsp://a:${CAM_MISSING}@h/x")
    assert "p@ss" not in str(missing.value)
    with pytest.raises(SecretError, match="password_file"):
        expand_url("rtsp://h/x", tmp_path / "absent")
    # a message with the filled-in URL in it, as FFmpeg writes one
    said = "rtsp://admin:p%40ss%2Fw%3Ard@10.0.0.3:554/main: 401 Unauthorized (p@ss/w:rd)"
    assert (
        mask_text(said, "p@ss/w:rd") == "rtsp://admin:***@10.0.0.3:554/main: 401 Unauthorized (***)"
    )


@pytest.mark.parametrize(
    "url",
    ["rtsp://h/x", "rtsps://h/x", "http://h/x.m3u8", "srt://h:9000", "/data/clip.mp4",
     "file:///data/clip.mp4", "/dev/video0"],
)  # fmt: skip
def test_what_a_source_may_name(url: str) -> None:
    assert check_url(url) == url


@pytest.mark.parametrize("url", ["ftp://h/x", "clip.mp4", "javascript:alert(1)", ""])
def test_what_a_source_may_not_name(url: str) -> None:
    with pytest.raises(ValueError, match="is not a source"):
        check_url(url)


def test_a_definition_feeds_models_or_a_pipeline_and_travels_without_its_defaults() -> None:
    defined = SourceDefinition(name="gate-3", url="rtsp://a:${P}@h/m", models=("face",))
    assert defined.feeds == ("face",) and defined.shown_url == "rtsp://a:***@h/m"
    assert defined.wire() == {"name": "gate-3", "url": "rtsp://a:${P}@h/m", "models": ["face"]}
    assert SourceDefinition.model_validate(defined.wire()) == defined
    # its worker is sent every field, defaults included, the slots chosen for it and where its
    # events go (none: it names no sink)
    sent = defined.assignment(slots=1)
    assert set(sent) == {*SourceDefinition.model_fields, "events"} and sent["events"] is None
    assert sent["slots"] == 1 and sent["policy"] == "latest" and sent["failed_after_s"] == 30.0
    fields = {k: v for k, v in sent.items() if k != "events"}
    assert SourceDefinition.model_validate(fields) == defined.model_copy(update={"slots": 1})
    assert SourceDefinition(name="p", url="/dev/video0", pipeline="faces").feeds == ("faces",)
    bad = [
        {"models": ["face"], "pipeline": "faces"},  # both
        {},  # neither
        {"models": []},
        {"models": ["face", "face"]},
        {"models": ["face"], "weight": 0.0001},
        {"models": ["face"], "colour": "red"},
        {"models": ["face"], "name": "no spaces"},
    ]
    for fields in bad:
        with pytest.raises(ValidationError):
            SourceDefinition.model_validate({"name": "x", "url": "rtsp://h/x", **fields})


def test_the_store_keeps_definitions_and_skips_a_row_that_no_longer_reads(tmp_path: Path) -> None:
    path = tmp_path / "sources.db"
    store = SourceStore(path)
    first = SourceDefinition(name="a", url="rtsp://h/a", models=("face",), max_fps=5)
    second = SourceDefinition(name="b", url="/dev/video0", pipeline="faces")
    store.put(first)
    store.put(second)
    store.put(first.model_copy(update={"max_fps": 2.0}))  # (replaced, in its place)
    store._db.execute(
        'INSERT INTO sources VALUES (\'c\', \'{"name": "c", "speed": 9}\', 1e12)'
    )  # a row written by hand
    store.close()
    again = SourceStore(path)
    assert [(d.name, d.max_fps) for d in again.load()] == [("a", 2.0), ("b", None)]
    assert again.delete("a") and not again.delete("a")
    assert [d.name for d in again.load()] == ["b"]
    again.close()


def test_health_tells_an_outage_from_a_typo() -> None:
    outage = SourceHealth(failed_after_s=30, retry_failed_s=60)
    assert outage.state == "connecting"
    delays = [outage.failed("refused", now=t) for t in (0.0, 1.0, 3.0)]
    assert delays == [0.5, 1.0, 2.0] and outage.state == "reconnecting"
    assert outage.failed("refused", now=31.0) == 60 and outage.state == "failed"
    assert outage.last_error == "refused"
    assert outage.playing() and outage.state == "playing" and outage.backoff.attempts == 0
    assert outage.failed("dropped", now=100.0) == 0.5  # (the failures were forgotten)

    typo = SourceHealth(failed_after_s=30, retry_failed_s=60)
    for attempt in range(PERMANENT_AFTER):
        delay = typo.failed("Server returned 404", permanent="no such path", now=float(attempt))
    assert typo.state == "failed" and delay == 60 and typo.permanent
    assert typo.last_error == "no such path: Server returned 404"


def test_which_errors_are_permanent() -> None:
    import av

    def ffmpeg_error(kind: type[Exception], code: int) -> Exception:
        return kind(code, "said by FFmpeg")

    assert "401" in (permanent_reason(ffmpeg_error(av.HTTPUnauthorizedError, 1), "rtsp://h") or "")
    assert "403" in (permanent_reason(ffmpeg_error(av.HTTPForbiddenError, 1), "rtsp://h") or "")
    assert "404" in (permanent_reason(ffmpeg_error(av.HTTPNotFoundError, 1), "rtsp://h") or "")
    io_error = OSError(errno.EIO, "Input/output error")
    assert "does not resolve" in (permanent_reason(io_error, "rtsp://nothing.invalid/x") or "")
    assert permanent_reason(io_error, "rtsp://127.0.0.1/x") is None  # (resolves: an outage)
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert permanent_reason(refused, "rtsp://nothing.invalid/x") is None


def test_the_records_travel_as_their_fields() -> None:
    report = SourceReport(**{**NO_REPORT.to_dict(), "name": "gate", "decoded": 7})
    assert SourceReport.from_dict(report.to_dict()) == report
    with pytest.raises(StatusRecordError, match="SourceReport: key 'decoded' must be an integer"):
        SourceReport.from_dict({**report.to_dict(), "decoded": "7"})
    with pytest.raises(StatusRecordError, match="missing key 'age_p99_ms'"):
        SourceReport.from_dict({k: v for k, v in report.to_dict().items() if k != "age_p99_ms"})
    fields = set(SourceStatus.__dataclass_fields__)
    # the documented ``duomo source list --json`` fields
    assert fields >= {
        "name", "url", "state", "last_error", "decoded", "decode_errors", "reconnects",
        "answered", "age_p50_ms", "age_p99_ms", "worker",
    }  # fmt: skip


def test_the_control_messages_of_the_fleet() -> None:
    report = {**NO_REPORT.to_dict(), "name": "gate"}
    parsed = parse_control({"op": "source_report", "worker": 1, "pid": 42, "sources": [report]})
    assert isinstance(parsed, SourceReports) and parsed.sources[0].name == "gate"
    with pytest.raises(InvalidArgumentError, match="'source_report' message: status record"):
        parse_control({"op": "source_report", "worker": 1, "pid": 42, "sources": [{"name": 1}]})
    added = parse_control(
        {"op": "source_add", "source": {"name": "g", "url": "rtsp://h/x", "models": ["face"]}}
    )
    assert isinstance(added, SourceAdd) and added.definition.feeds == ("face",)
    with pytest.raises(InvalidArgumentError, match=r"not a source: url: 'ftp://h' is not a source"):
        parse_control(
            {"op": "source_add", "source": {"name": "g", "url": "ftp://h", "models": ["f"]}}
        )
    with pytest.raises(InvalidArgumentError, match="'source' is missing"):
        parse_control({"op": "source_add"})


def test_the_config_names_a_bad_source_by_its_field_path(tmp_path: Path) -> None:
    good = {"name": "gate", "url": "rtsp://h/x", "models": ["classify"]}
    config = write_config(tmp_path, [classify()], sources=[good], source_workers={"count": 2})
    loaded = load_config(config)
    assert [s.name for s in loaded.config.sources] == ["gate"]
    assert loaded.config.source_workers.count == 2
    cases = [
        ([{**good, "models": ["nope"]}], "sources[gate].models: no model or pipeline named 'nope'"),
        ([good, good], "sources[1].name: duplicate source name 'gate'"),
        ([{**good, "url": "ftp://h"}], "sources[gate].url: 'ftp://h' is not a source"),
        ([{**good, "fps": 3}], "sources[gate].fps: unknown key"),
    ]
    for sources, said in cases:
        with pytest.raises(ConfigError) as err:
            load_config(write_config(tmp_path, [classify()], sources=sources))
        assert said in err.value.render(), err.value.render()


def test_slots_auto_holds_frames_at_the_source_only_where_the_models_batch(
    tmp_path: Path,
) -> None:
    """``slots: auto``: 1 (a frame converted and sent only once the one before is answered)
    when every model fed batches frames of several cameras together, else 3 (the model's next
    frame is always the newest; measured: 4 cameras into face, age p50 73 ms with 3, 207 with
    1, where 1 halved the source worker's CPU per answer)."""
    batches = {"face": 1, "face_npu": 8, "faces": 1, "ocr_npu": 4}

    def max_batch(name: str) -> int:
        if name not in batches:
            raise NotFoundError(f"no model named {name!r}")
        return batches[name]

    fleet = SourceFleet(
        SourceWorkersConfig(), [], tmp_path / "s.sock", lambda d: None, lambda: 2, max_batch
    )
    source = SourceDefinition(name="gate", url="rtsp://h/x", models=("face",))
    assert fleet.slots(source) == 3
    assert fleet.slots(source.model_copy(update={"models": ("face_npu", "ocr_npu")})) == 1
    assert fleet.slots(source.model_copy(update={"models": ("face_npu", "face")})) == 3
    assert fleet.slots(source.model_copy(update={"models": ("gone",)})) == 3
    assert fleet.slots(source.model_copy(update={"slots": 2})) == 2
