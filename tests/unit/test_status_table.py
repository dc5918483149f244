"""``duomo status``'s text (``render_status``): the model table stays aligned whatever its
cells' widths."""

from __future__ import annotations

from typing import Any

from duomo.ipc.status_records import SupervisorStatus
from duomo.supervisor.operators.status_table import render_status
from tests.status_fixtures import device_entry, model_entry, status_entry

MIB = 2**20
LONG_NAME = "face-detection-retinaface-r50-1080p-fp16"  # 40 characters


def model(state: str = "READY", **fields: Any) -> dict[str, Any]:
    """One model's entry in ``status``, with the values ``render_status`` shows set here."""
    shown: dict[str, Any] = dict(
        state=state,
        devices=[0],
        instances=1,
        queue_depth=0,
        in_flight=0,
        requests=7,
        outcomes={"ok": 7},
        refused={},
        latency={"total": {"p50_ms": 19.5, "p90_ms": 25.0, "p99_ms": 29.6}},
        batch_sizes={"1": 7},
        memory={"charged_bytes": 34 * MIB},
        compute={"share": 0.03, "weight": 1.0},
        restarts_in_window=0,
        last_error=None,
    )
    return model_entry(**{**shown, **fields})


def status(**models: dict[str, Any]) -> SupervisorStatus:
    return SupervisorStatus.from_dict(
        status_entry(
            models,
            pid=9816,
            socket="/tmp/duomo.sock",
            uptime_s=7.0,
            rss_bytes=512 * MIB,
            thread_budget=2,
            devices=[device_entry(id=0, kind="cpu", used_bytes=332 * MIB, budget_bytes=None)],
            gateways=[],
            clients=[],
        )
    )


def table(text: str) -> tuple[str, dict[str, str]]:
    """The model table's title line, and each model's row by name."""
    lines = text.splitlines()
    title = next(line for line in lines if line.startswith("model "))
    start = lines.index(title) + 1
    rows = {line.split()[0]: line for line in lines[start:] if not line.startswith("  ")}
    return title, {name: row for name, row in rows.items() if not name.startswith("client")}


def test_the_model_table_is_as_it_was_for_short_names() -> None:
    title, rows = table(render_status(status(ocr=model())))
    assert title == (
        "model        state          dev   inst queue busy      ok errors superseded   p50 ms   "
        "p99 ms    MiB rst       share  batches"
    )
    assert rows["ocr"] == (
        "ocr          READY          0        1     0    0       7      0          0     19.5   "
        "  29.6     34   0    3% (w 1)  1:7"
    )


def test_a_long_name_and_wide_cells_keep_every_column_aligned() -> None:
    assert len(LONG_NAME) == 40
    text = render_status(
        status(
            ocr=model(),
            **{LONG_NAME: model(
                "REINITIALIZING", devices=[0, 1, 2, 3], requests=123456789,
                outcomes={"ok": 123456780}, compute={"share": 1.0, "weight": 1000.0},
                last_error="onnxruntime aborted",
            )},
        )
    )  # fmt: skip
    title, rows = table(text)
    assert set(rows) == {"ocr", LONG_NAME}
    assert f"  {LONG_NAME}: onnxruntime aborted" in text.splitlines()
    for title_word, cells in (("state", ("READY", "REINITIALIZING")), ("dev", ("0 ", "0,1,2,3"))):
        assert [rows[n].index(c) for n, c in zip(("ocr", LONG_NAME), cells)] == [
            title.index(title_word)
        ] * 2
    # right-aligned columns end where their titles end
    for title_word, cells in (("ok", ("7", "123456780")), ("share", ("(w 1)", "(w 1000)"))):
        end = title.index(f" {title_word} ") + len(title_word) + 1
        ends = [rows[n][:end].endswith(c) for n, c in zip(("ocr", LONG_NAME), cells)]
        assert ends == [True, True], (title, rows)
    assert len({row.index("  1:7") for row in rows.values()}) == 1  # the last column too
