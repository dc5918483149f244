"""The pipelines' IoU tracker (``supervisor.dataflow.object_tracker``): ids kept across frames by
IoU, greedy best match first, new ids for new objects, forgotten after ``max_missed`` frames."""

from __future__ import annotations

import threading

import numpy as np

from duomo.supervisor.dataflow.object_tracker import (
    MAX_TRACKS,
    IouTracker,
    Kept,
    box_area,
    iou_matrix,
)


def ids(tracker: IouTracker, boxes: list[list[float]]) -> list[int]:
    return [t.id for t in tracker.update(boxes)[1]]


def test_iou_matrix() -> None:
    a = np.array([[0, 0, 10, 10], [0, 0, 0, 0]], dtype=np.float64)
    b = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]], dtype=np.float64)
    m = iou_matrix(a, b)
    assert m.shape == (2, 3)
    np.testing.assert_allclose(m[0], [1.0, 50 / 150, 0.0])
    np.testing.assert_array_equal(m[1], [0.0, 0.0, 0.0])  # an empty box overlaps nothing
    assert box_area(np.array([2.0, 3.0, 6.0, 8.0])) == 20.0
    assert box_area(np.array([6.0, 3.0, 2.0, 8.0])) == 0.0  # inverted: no area


def test_ids_stay_with_moving_objects_and_new_ones_get_new_ids() -> None:
    tracker = IouTracker(iou=0.3, max_missed=10)
    frame, tracks = tracker.update([[0, 0, 10, 10], [100, 100, 120, 120]])
    assert frame == 1 and [t.id for t in tracks] == [1, 2]
    # the same two, moved a little and listed in the other order, and a third one
    moved = [[102, 101, 122, 121], [50, 50, 60, 60], [1, 0, 11, 10]]
    frame, tracks = tracker.update(moved)
    assert frame == 2 and [t.id for t in tracks] == [2, 3, 1]
    np.testing.assert_array_equal(tracks[0].box, [102, 101, 122, 121])  # the last box is kept
    assert ids(tracker, [[200, 200, 210, 210]]) == [4]  # no overlap: a new id, never reused


def test_below_the_iou_threshold_is_a_new_object() -> None:
    tracker = IouTracker(iou=0.5, max_missed=10)
    assert ids(tracker, [[0, 0, 10, 10]]) == [1]
    assert ids(tracker, [[5, 0, 15, 10]]) == [2]  # IoU 1/3 < 0.5
    assert ids(tracker, [[6, 0, 16, 10]]) == [2]  # IoU 9/11 with track 2


def test_greedy_matching_gives_the_best_pair_first() -> None:
    tracker = IouTracker(iou=0.1, max_missed=10)
    assert ids(tracker, [[0, 0, 10, 10]]) == [1]
    # both overlap track 1; the better match takes it, the other starts a track
    assert ids(tracker, [[4, 0, 14, 10], [1, 0, 11, 10]]) == [2, 1]


def test_a_track_unseen_for_more_than_max_missed_frames_is_forgotten() -> None:
    tracker = IouTracker(iou=0.3, max_missed=2)
    box = [0.0, 0.0, 10.0, 10.0]
    assert ids(tracker, [box]) == [1]
    assert ids(tracker, []) == [] and ids(tracker, []) == []  # missed twice: still known
    assert ids(tracker, [box]) == [1]
    for _ in range(3):
        tracker.update([])  # missed three times: forgotten
    assert ids(tracker, [box]) == [2]


def test_kept_results_stay_with_their_track() -> None:
    tracker = IouTracker(iou=0.3, max_missed=1)
    _, (track,) = tracker.update([[0, 0, 10, 10]])
    track.kept["embedding"] = Kept({"embedding": [1.0]}, 1, track.area)
    _, (again,) = tracker.update([[0, 0, 10, 11]])
    assert again is track and again.kept["embedding"].result == {"embedding": [1.0]}
    assert again.area == 110.0


def test_tracks_are_bounded() -> None:
    tracker = IouTracker(iou=0.3, max_missed=10_000)
    for frame in range(3):  # disjoint boxes every frame: all new tracks, none forgotten
        offset = frame * 20 * (MAX_TRACKS // 2)
        boxes = [[offset + 20 * i, 0, offset + 20 * i + 10, 10] for i in range(MAX_TRACKS // 2)]
        tracker.update(boxes)
    assert len(tracker._tracks) == MAX_TRACKS
    last = [t.id for t in tracker._tracks]
    assert max(last) == 3 * (MAX_TRACKS // 2)  # the newest are kept, the oldest dropped
    assert min(last) == MAX_TRACKS // 2 + 1


def test_concurrent_updates_number_frames_once_each() -> None:
    workers = 4
    tracker = IouTracker(iou=0.3, max_missed=10)
    frames: list[int] = []
    lock = threading.Lock()

    def run() -> None:
        for _ in range(50):
            frame, _ = tracker.update([[0, 0, 10, 10]])
            with lock:
                frames.append(frame)

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(frames) == list(range(1, 50 * workers + 1))
    assert ids(tracker, [[0, 0, 10, 10]]) == [1]  # one object throughout: one id
