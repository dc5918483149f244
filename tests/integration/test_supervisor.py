"""The supervisor process with producers in other processes, through real shared memory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from duomo.ipc.client import READ_SLICE_S, Client, Slot
from duomo.ipc.errors import (
    DuomoError,
    InvalidArgumentError,
    ModelChangedError,
    NotFoundError,
    UnavailableError,
)
from duomo.ipc.framing import FrameReader, answer, json_frame, notice_frame, recv_frame
from duomo.ipc.status_records import ClientStatus, SupervisorStatus
from duomo.ipc.wire import FRAME, FrameKind, SlotHeader, SlotState, TensorDesc, dtype_code, frame
from tests.conftest import IMAGES, ROOT
from tests.integration.harness import (
    SupervisorProcess,
    affine_model,
    our_segments,
    poll,
    running_supervisor,
    write_config,
)

IMAGE_FOR = {"classify": "coffee.png", "face": "astronaut.png", "ocr": "page.png"}


@pytest.fixture(scope="module")
def supervisor(
    tmp_path_factory: pytest.TempPathFactory, demo_config: object
) -> Iterator[SupervisorProcess]:
    config = write_config(tmp_path_factory.mktemp("sup"), ["ocr", "face", "classify"])
    with running_supervisor(config) as running:
        yield running


def producer(
    sup: SupervisorProcess, model: str, count: int, seconds: float, slots: int = 2
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "tests.integration.producer", str(sup.socket), model,
            str(IMAGES / IMAGE_FOR[model]), "--count", str(count), "--seconds", str(seconds),
            "--slots", str(slots),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def summary(process: subprocess.Popen[str]) -> dict[str, object]:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    return dict(json.loads(out.strip().splitlines()[-1]))


def fds_when_alone(sup: SupervisorProcess) -> int:
    """The supervisor's open fds, read while the asking connection is its only client."""
    found: list[int] = []

    def alone() -> bool:
        shown = status(sup)
        if len(shown.clients) == 0 and shown.mapped_rings == 0:
            found.append(shown.open_fds)
            return True
        return False

    poll(alone)
    return found[-1]


def status(sup: SupervisorProcess) -> SupervisorStatus:
    with Client(sup.socket) as client:
        return client.status()


def test_eight_producers_on_three_models(supervisor: SupervisorProcess) -> None:
    plan = [("classify", 30), ("classify", 30), ("classify", 30), ("face", 8), ("face", 8),
            ("face", 8), ("ocr", 2), ("ocr", 2)]  # fmt: skip
    processes = [(model, count, producer(supervisor, model, count, 90)) for model, count in plan]
    for model, count, process in processes:
        result = summary(process)
        assert result["errors"] == {}, (model, result)
        assert result.get("wrong", 0) == 0, (model, result)
        assert result["ok"] == result["sent"] >= 1, (model, result)
        assert result["sent"] == count, (model, result)  # count-bounded, well inside the time bound


def test_sigkill_a_producer_mid_request(supervisor: SupervisorProcess) -> None:
    no_rings = lambda: all(not c.rings for c in status(supervisor).clients)  # noqa: E731
    with Client(supervisor.socket) as warm:  # the first ring opens fds that stay (tracker pipe)
        warm.model("classify").close()
    poll(no_rings)
    fds_before, segments_before = fds_when_alone(supervisor), our_segments()
    victim = producer(supervisor, "ocr", count=1000, seconds=120, slots=2)
    bystander = producer(supervisor, "classify", count=60, seconds=120)
    assert victim.stdout is not None
    assert json.loads(victim.stdout.readline()) == {"attached": "ocr"}

    def victim_in_flight() -> bool:
        clients = status(supervisor).clients
        return any(r.model == "ocr" and r.in_flight > 0 for c in clients for r in c.rings)

    poll(victim_in_flight)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    result = summary(bystander)
    assert result["ok"] == result["sent"] == 60 and result["errors"] == {}
    poll(no_rings)
    assert fds_when_alone(supervisor) == fds_before
    assert our_segments() == segments_before == set()
    with Client(supervisor.socket) as client:  # and it still serves
        ocr = client.model("ocr")
        from duomo.supervisor.operators.image_files import read_image

        lines = ocr.infer(read_image(IMAGES / "page.png"))["lines"]
        assert lines[0]["text"] == "Region-based segmentation"


def test_sigkill_the_supervisor_while_clients_wait(tmp_path: Path, demo_config: object) -> None:
    from duomo.supervisor.operators.image_files import read_image

    config = write_config(tmp_path, ["ocr"])
    with running_supervisor(config) as sup:
        client = Client(sup.socket)
        ocr = client.model("ocr", slots=4)
        page = read_image(IMAGES / "page.png")
        futures = [ocr.infer_async(page, timeout_s=60) for _ in range(4)]
        poll(lambda: status(sup).models["ocr"].in_flight >= 1)
        sup.process.send_signal(signal.SIGKILL)
        raised = 0
        for future in futures:
            try:  # within 5 s, where their own timeout is 60 s: the dropped connection ends them
                future.result(timeout=5)
            except UnavailableError:
                raised += 1
        sup.process.wait(10)
    waited = [f for f in futures if not f.done()]
    assert not waited
    assert raised >= 1  # every call that was still waiting raised UnavailableError
    # the dead supervisor's rings went with it; the client's mapping goes when it closes
    assert {held.split(":")[0] for held in our_segments()} <= {str(os.getpid())}
    client.close()
    assert our_segments() == set()


def test_start_with_a_missing_model_file_fails_with_the_path(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("models:\n  - {name: c, task: classification, file: gone/model.onnx}\n")
    socket_path = tmp_path / "s.sock"
    run = subprocess.run(
        [
            sys.executable, "-m", "duomo.supervisor", "start", "-c", str(config),
            "--socket", str(socket_path),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert str(tmp_path / "gone" / "model.onnx") in run.stderr
    assert not socket_path.exists()


@pytest.mark.demo_ports  # (configs/default.yaml's 8000–8002, as make demo: in turn)
def test_start_and_stop_leave_nothing_behind(demo_config: object) -> None:
    from tests.integration.harness import short_socket_dir

    folder = short_socket_dir()
    socket_path = folder / "duomo.sock"
    env = {**os.environ, "DUOMO_SOCKET": str(socket_path)}

    def duomo(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "duomo.supervisor", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    start = duomo("start", "-c", str(ROOT / "configs" / "default.yaml"))
    assert start.returncode == 0, start.stderr
    assert socket_path.exists() and (folder / "duomo.sock.pid").exists()
    assert oct(socket_path.stat().st_mode & 0o777) == "0o600"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    infer = duomo("infer", "classify", str(IMAGES / "coffee.png"), "--json")
    assert infer.returncode == 0, infer.stderr
    assert json.loads(infer.stdout)["result"]["top"][0]["label"] == "espresso"
    shown = duomo("status", "--json")
    assert json.loads(shown.stdout)["models"]["classify"]["outcomes"]["ok"] == 1
    stop = duomo("stop")
    assert stop.returncode == 0, stop.stderr
    left = sorted(p.name for p in folder.iterdir())
    assert left == ["duomo.sock.log"], left  # no socket, key or pid file
    assert our_segments() == set()
    shutil.rmtree(folder)


# -- hostile input: each gets a clear error and the supervisor keeps serving everyone ----------


@pytest.fixture(scope="module")
def hostile_target(
    tmp_path_factory: pytest.TempPathFactory, demo_config: object
) -> Iterator[SupervisorProcess]:
    folder = tmp_path_factory.mktemp("hostile")
    affine_model(folder / "affine.onnx")
    raw = {"name": "affine", "task": "raw", "file": str(folder / "affine.onnx"), "max_batch": 4}
    # a client that does not read is cut off at 256 KiB of unread answers (default 8 MiB)
    config = write_config(folder, ["classify"], extra=[raw], limits={"max_unread_bytes": 256 << 10})
    with running_supervisor(config) as running:
        yield running


def still_serving(sup: SupervisorProcess) -> None:
    from duomo.supervisor.operators.image_files import read_image

    with Client(sup.socket) as client:
        top = client.model("classify").infer(read_image(IMAGES / "coffee.png"))["top"]
        assert top[0]["label"] == "espresso"
        out = client.model("affine").infer(np.ones((2, 4), dtype=np.float32))
        np.testing.assert_array_equal(out["y"], np.full((2, 4), 3.0, dtype=np.float32))


def submit_raw(slot: Slot, header: SlotHeader, notice_seq: int | None = None) -> None:
    """Write ``header`` as-is and send a notice, as a hostile client would."""
    header.pack_into(slot.handle.ring.header(slot.index))
    seq = header.seq if notice_seq is None else notice_seq
    slot._seq = seq
    slot._in_flight = True
    slot._answered = False
    slot.handle.client._link.send_frame(notice_frame(slot.handle.ring_id, slot.index, seq))


def valid_header(seq: int, shape: tuple[int, ...], dtype: str = "float32") -> SlotHeader:
    return SlotHeader(
        seq=seq, state=SlotState.SUBMITTED,
        inputs=[TensorDesc(dtype_code(np.dtype(dtype)), shape)],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("batch_above_max", "above max_batch 4"),
        ("shape_larger_than_slot", "exceeds the slot"),
        ("wrong_dtype", "must be float32"),
        ("bad_magic", "magic"),
        ("bad_version", "protocol version 99; this supervisor speaks version 3"),
        ("sequence_mismatch", "sequence number"),
        ("rank_mismatch", "expected rank 2"),
        # (issue 43: a 0×0 frame of rank 3 was told "expected rank 3")
        ("empty_dimension", r"has shape \[0, 4\]: every dimension must be at least 1"),
    ],
)
def test_bad_slot_headers_are_answered_with_errors(
    hostile_target: SupervisorProcess, case: str, expected: str
) -> None:
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=2)
        slot = affine.slot()
        slot.input("x", (1, 4))[...] = 1.0
        header = valid_header(7, (1, 4))
        if case == "batch_above_max":
            header = valid_header(7, (9, 4))
        elif case == "shape_larger_than_slot":  # an image slot takes any H×W, up to its bytes
            slot = client.model("classify", slots=1).slot()
            header = valid_header(7, (20000, 20000, 3), dtype="uint8")
        elif case == "wrong_dtype":
            header = valid_header(7, (1, 4), dtype="float64")
        elif case == "bad_magic":
            header.magic = b"EVIL"
        elif case == "bad_version":
            header.version = 99
        elif case == "rank_mismatch":
            header = valid_header(7, (1, 4, 1))
        elif case == "empty_dimension":
            header = valid_header(7, (0, 4))
        # for "sequence_mismatch" the notice names another request than the header holds
        submit_raw(slot, header, notice_seq=8 if case == "sequence_mismatch" else None)
        with pytest.raises(InvalidArgumentError, match=expected):
            slot.wait(timeout_s=10)
    still_serving(hostile_target)


def test_slot_index_out_of_range(hostile_target: SupervisorProcess) -> None:
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=2)
        client._link.send_frame(notice_frame(affine.ring_id, 99, 1))
        error = client.next_event(timeout_s=10)
        assert isinstance(error, InvalidArgumentError) and "out of range" in error.message
        client._link.send_frame(notice_frame(4242, 0, 1))
        assert isinstance(client.next_event(timeout_s=10), NotFoundError)
    still_serving(hostile_target)


def test_header_rewritten_after_submit(hostile_target: SupervisorProcess) -> None:
    from duomo.supervisor.operators.image_files import read_image

    with Client(hostile_target.socket) as client:
        classify = client.model("classify", slots=1)
        for _ in range(20):
            slot = classify.slot()
            slot.write(read_image(IMAGES / "coffee.png"))
            slot.submit(timeout_s=30)
            # the client lies after the fact: a huge shape and a broken magic
            SlotHeader(seq=slot._seq, state=SlotState.SUBMITTED, magic=b"EVIL",
                       inputs=[TensorDesc(0, (10**5, 10**5, 3))]).pack_into(
                classify.ring.header(slot.index))  # fmt: skip
            try:
                result = slot.wait(timeout_s=30)
            except InvalidArgumentError:
                pass  # the supervisor read the header after the rewrite: a clear error
            except UnavailableError as error:
                # the client was descheduled past the answer: its rewrite overwrote the
                # supervisor's DONE header, and the client library refuses what it finds
                assert "stale or corrupt header" in error.message
            else:
                assert result["top"][0]["label"] == "espresso"  # it read the header before
            slot.release()
    still_serving(hostile_target)


def test_garbage_and_oversized_control_frames(hostile_target: SupervisorProcess) -> None:
    for bad in (
        frame(FrameKind.JSON, b"\xff\xfe this is not json"),
        frame(FrameKind.JSON, b"[1, 2, 3]"),
        FRAME.pack(50 << 20, FrameKind.JSON),  # announces 50 MB
        FRAME.pack(4, 77) + b"abcd",  # unknown frame kind
        frame(FrameKind.NOTICE, b"\x01"),  # a notice of the wrong size
    ):
        client = Client(hostile_target.socket)
        client._link.send_frame(bad)
        event = client.next_event(timeout_s=10)
        assert event is not None and "protocol error" in event.message
        # the supervisor closed that connection
        client._link.wait_for(lambda c=client: not c.connected, time.monotonic() + 10)  # type: ignore[misc]
        assert not client.connected
        client.close()
    with Client(hostile_target.socket) as client:  # well-formed but unknown or malformed
        with pytest.raises(InvalidArgumentError, match="unknown control operation"):
            client.request("format_disk")
        with pytest.raises(InvalidArgumentError, match="slots"):
            client.request("attach", model="classify", slots=10**6)
    still_serving(hostile_target)


def test_unknown_model(hostile_target: SupervisorProcess) -> None:
    with Client(hostile_target.socket) as client, pytest.raises(NotFoundError, match="nope"):
        client.model("nope")


def test_a_connection_without_the_key_is_refused(hostile_target: SupervisorProcess) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(hostile_target.socket))
    reader = FrameReader()
    kind, challenge = recv_frame(sock, reader)
    assert kind is FrameKind.CHALLENGE
    sock.sendall(frame(FrameKind.RESPONSE, answer(b"wrong key", challenge)))
    kind, payload = recv_frame(sock, reader)
    assert kind is FrameKind.JSON and "authentication failed" in payload.decode()
    assert sock.recv(1) == b""  # and the connection is closed
    sock.close()
    # a client that skips authentication and sends a control message is refused the same way
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(hostile_target.socket))
    sock.sendall(json_frame({"id": 1, "op": "stop"}))
    reader = FrameReader()
    recv_frame(sock, reader)  # the challenge
    kind, payload = recv_frame(sock, reader)
    assert "authentication failed" in payload.decode()
    sock.close()
    still_serving(hostile_target)


def test_the_example_producer(supervisor: SupervisorProcess) -> None:
    run = subprocess.run(
        [sys.executable, "tools/example_producer.py", "--socket", str(supervisor.socket),
         "--frames", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "espresso" in run.stdout and "1 face(s)" in run.stdout
    assert "first: 'Region-based segmentation'" in run.stdout


# -- client behaviour around callbacks, cancellation and slots ---------------------------------


def test_a_cancelled_future_does_not_break_the_client(hostile_target: SupervisorProcess) -> None:
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=2)
        x = np.ones((1, 4), dtype=np.float32)
        doomed = affine.infer_async(x)
        doomed.cancel()
        assert affine.infer(x)["y"][0, 0] == 3.0  # still connected, answers still arrive
        assert client.connected


def test_a_callback_may_call_the_client_again(hostile_target: SupervisorProcess) -> None:
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=1)  # one slot: the callback needs it back
        chained: list[float] = []
        first = affine.infer_async(np.ones((1, 4), dtype=np.float32))
        first.add_done_callback(lambda f: chained.append(affine.infer(f.result()["y"])["y"][0, 0]))
        assert first.result(30)["y"][0, 0] == 3.0
        client._link.wait_for(lambda: bool(chained), time.monotonic() + 30)
        assert chained == [7.0]  # 2 * 3 + 1, computed inside the callback


def test_slots_given_up_early_come_back(hostile_target: SupervisorProcess) -> None:
    from duomo.ipc.errors import DeadlineExceededError

    with Client(hostile_target.socket) as client:
        classify = client.model("classify", slots=2)
        from duomo.supervisor.operators.image_files import read_image

        frame = read_image(IMAGES / "coffee.png")
        given_up = 0
        for _ in range(100):  # a frame-dropping producer: wait briefly, give up, move on
            slot = classify.slot(timeout_s=30)  # a slot given up comes back with its answer
            slot.write(frame)
            slot.submit(timeout_s=30)
            try:  # (answered within 0.1 ms only when this thread lost the core meanwhile)
                slot.wait(timeout_s=0.0001)
            except DeadlineExceededError:
                given_up += 1
            slot.release()
            if given_up == 4:  # twice each of its two slots
                break
        assert given_up == 4
        # the answers arrive later and free the slots for whoever asks next
        assert classify.infer(frame, timeout_s=30)["top"][0]["label"] == "espresso"


def test_a_client_that_does_not_read_is_dropped_without_stalling_others(
    hostile_target: SupervisorProcess,
) -> None:
    greedy = Client(hostile_target.socket)
    request = json_frame({"id": 1, "op": "models"})
    for _ in range(3000):  # pipelined, never reading the replies
        try:
            greedy._link.send_frame(request)
        except UnavailableError:
            break
    started = time.monotonic()
    with Client(hostile_target.socket) as polite:
        for _ in range(20):
            polite.request("ping")
    assert time.monotonic() - started < 5.0
    greedy._link.wait_for(lambda: not greedy.connected, time.monotonic() + 30)
    assert not greedy.connected
    greedy.close()
    still_serving(hostile_target)


def test_a_connection_lent_to_its_models_idle_worker(hostile_target: SupervisorProcess) -> None:
    """A connection whose rings all attach one model is read by that model's idle worker;
    whatever else arrives on it still reaches the reactor, in order."""
    from duomo.supervisor.operators.image_files import read_image

    def rings_of(client_rings: int) -> list[ClientStatus]:
        shown = status(hostile_target).clients
        return [c for c in shown if len(c.rings) == client_rings]

    def lent(client_rings: int = 1) -> bool:
        return any(c.lent for c in rings_of(client_rings))

    image = read_image(IMAGES / "coffee.png")
    x = np.ones((1, 4), dtype=np.float32)
    with Client(hostile_target.socket) as client:
        classify = client.model("classify", slots=2)
        for _ in range(20):  # one request after another: a wait between two of them spins
            for _ in range(5):  # (a notice that comes before the worker waits for it is the
                assert classify.infer(image)["top"][0]["label"] == "espresso"  # reactor's)
            spin = status(hostile_target).models["classify"].idle_spin
            if spin["spun"]:
                break
        assert spin["waits"] >= spin["spun"] >= max(1, spin["caught"]), spin
        poll(lent)  # idle: the classify worker waits on this connection itself
        # ... asleep: its spin ended within a millisecond of the last answer
        supervisor = psutil.Process(hostile_target.pid)
        before = sum(supervisor.cpu_times()[:2])
        time.sleep(0.5)  # the window measured: not a wait for anything
        assert sum(supervisor.cpu_times()[:2]) - before < 0.1  # a spinning thread: about 0.5
        assert client.request("ping")["ok"]  # a control message on it reaches the reactor
        poll(lent)
        both = [classify.infer_async(image) for _ in range(2)]  # notices maybe in one read
        assert [f.result(60)["top"][0]["label"] for f in both] == ["espresso"] * 2
        affine = client.model("affine", slots=1)  # a second model: not lent any more
        assert affine.infer(x)["y"][0, 0] == 3.0
        assert classify.infer(image)["top"][0]["label"] == "espresso"
        assert not lent(client_rings=2)
        affine.close()  # one model again: lent again
        poll(lent)
        assert classify.infer(image)["top"][0]["label"] == "espresso"
        poll(lent)
    poll(lambda: not rings_of(1))  # closed while lent: its ring is released
    poll(lambda: our_segments() == set())

    hostile = Client(hostile_target.socket)  # garbage on a lent connection
    hostile.model("affine", slots=1).infer(x)
    poll(lent)
    hostile._link.send_frame(frame(FrameKind.JSON, b"\xff\xfe this is not json"))
    event = hostile.next_event(timeout_s=10)
    assert event is not None and "protocol error" in event.message
    hostile._link.wait_for(lambda: not hostile.connected, time.monotonic() + 10)
    assert not hostile.connected
    hostile.close()
    poll(lambda: not rings_of(1))
    still_serving(hostile_target)


def test_a_second_start_on_a_live_socket_leaves_the_first_alone(
    hostile_target: SupervisorProcess,
) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "duomo.supervisor", "start",
         "-c", str(ROOT / "configs" / "default.yaml"), "--socket", str(hostile_target.socket)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0 and "already serving" in run.stderr
    # and what to do about it: another socket for a second one, or stop this one
    assert "duomo start --socket PATH" in run.stderr
    assert f"duomo stop --socket {hostile_target.socket}" in run.stderr
    assert hostile_target.socket.exists()
    assert hostile_target.socket.with_name("duomo.sock.key").exists()
    still_serving(hostile_target)


def test_reload_that_changes_a_layout_makes_clients_attach_again(
    tmp_path: Path, demo_config: object
) -> None:
    affine_model(tmp_path / "affine.onnx")
    raw = {"name": "affine", "task": "raw", "file": str(tmp_path / "affine.onnx"), "max_batch": 4}
    config = write_config(tmp_path, ["classify"], extra=[raw])
    with running_supervisor(config) as sup, Client(sup.socket) as client:
        before = client.model("affine")
        x = np.ones((1, 4), dtype=np.float32)
        assert before.infer(x)["y"][0, 0] == 3.0
        write_config(tmp_path, ["classify"], extra=[{**raw, "max_batch": 2}])
        sup.process.send_signal(signal.SIGHUP)
        poll(lambda: status(sup).models["affine"].max_batch == 2)
        old_ring = before.ring_id
        with before.slot() as slot:  # zero-copy: the answer says what happened
            slot.write(x)
            slot.submit()
            with pytest.raises(ModelChangedError, match="attach it again"):
                slot.wait()
        # the next request re-attaches by itself, with the new layout (2 rows fit, not 4)
        assert before.infer(x)["y"][0, 0] == 3.0
        assert before.ring_id != old_ring
        with pytest.raises(InvalidArgumentError, match=r"exceeds the slot.s 32"):
            before.infer(np.ones((3, 4), dtype=np.float32))
        # infer() alone: the retry after MODEL_CHANGED is invisible to the caller
        write_config(tmp_path, ["classify"], extra=[{**raw, "max_batch": 3}])
        sup.process.send_signal(signal.SIGHUP)
        poll(lambda: status(sup).models["affine"].max_batch == 3)
        assert before.infer(x)["y"][0, 0] == 3.0  # answered MODEL_CHANGED, sent again
        assert before.infer(np.ones((3, 4), dtype=np.float32))["y"].shape == (3, 4)


def test_threads_sharing_one_slot_all_finish(hostile_target: SupervisorProcess) -> None:
    """A thread waiting for a free slot may be the one reading the socket; a slot released by
    another thread without any frame arriving must still reach it."""
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=1)
        x = np.ones((1, 4), dtype=np.float32)
        done: list[int] = []

        def work(n: int) -> None:
            for _ in range(n):
                assert affine.infer(x, timeout_s=30)["y"][0, 0] == 3.0
            done.append(n)

        threads = [threading.Thread(target=work, args=(n,)) for n in (50, 200, 200)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(done) == [50, 200, 200]


def test_infer_timed_gives_the_answers_stage_times(hostile_target: SupervisorProcess) -> None:
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=1)
        start = time.perf_counter()
        out, timings = affine.infer_timed(np.ones((1, 4), dtype=np.float32), timeout_s=30)
        elapsed_us = (time.perf_counter() - start) * 1e6
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 3.0, dtype=np.float32))
        assert set(timings) == {"queue", "preprocess", "infer", "postprocess"}
        assert timings["infer"] > 0 and sum(timings.values()) <= elapsed_us


def test_a_wait_for_an_answer_sees_its_handle_closed_by_another_thread(
    hostile_target: SupervisorProcess,
) -> None:
    """The reader of an answer blocks in ``recv`` alone: what another thread does without a
    frame arriving (closing the handle) reaches it within the read slice."""
    with Client(hostile_target.socket) as client:
        affine = client.model("affine", slots=1)
        slot = affine.slot()
        slot._in_flight, slot._answered = True, False  # in flight, but never sent: no answer
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                slot.wait(timeout_s=30)
            except DuomoError as err:
                errors.append(err)

        waiter = threading.Thread(target=wait)
        waiter.start()
        # the waiter reads the socket from now on
        poll(lambda: client._link.reading_thread == waiter.ident)
        closed_at = time.monotonic()
        affine.close()
        waiter.join(10)
        assert not waiter.is_alive() and isinstance(errors[0], UnavailableError)
        assert time.monotonic() - closed_at < READ_SLICE_S + 1.0
    still_serving(hostile_target)
