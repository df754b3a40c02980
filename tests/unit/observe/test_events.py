"""A trainer's compute utilisation: seconds inside inner steps over the wall seconds from its
first step to its last."""

from __future__ import annotations

from p2ptrain.observe.events import Trained, compute_utilisation, mean_utilisation


def _trained(window: int, inner_seconds: float, ended_at: float) -> Trained:
    return Trained(
        peer_id="p",
        window=window,
        loss_before=2.0,
        loss_after=1.5,
        seconds=inner_seconds + 0.5,
        blob_bytes=100,
        inner_seconds=inner_seconds,
        inner_ended_at=ended_at,
    )


def test_waiting_between_windows_lowers_utilisation() -> None:
    # steps 100-110, 115-125, 130-140: 30 s of steps over 40 s
    windows = [_trained(w, 10.0, 100.0 + 15 * w + 10) for w in range(3)]
    assert compute_utilisation(windows) == 30 / 40


def test_back_to_back_windows_are_fully_used() -> None:
    windows = [_trained(w, 5.0, 5.0 * (w + 1)) for w in range(4)]
    assert compute_utilisation(windows) == 1.0


def test_no_timed_window_gives_none() -> None:
    assert compute_utilisation([]) is None
    untimed = Trained(peer_id="p", window=1, loss_before=1, loss_after=1, seconds=1, blob_bytes=1)
    assert compute_utilisation([untimed]) is None


def test_the_mean_leaves_out_trainers_that_did_not_train() -> None:
    busy = [_trained(w, 5.0, 5.0 * (w + 1)) for w in range(4)]  # 1.0
    waiting = [_trained(w, 10.0, 100.0 + 15 * w + 10) for w in range(3)]  # 0.75
    assert mean_utilisation([busy, waiting, []]) == 0.875
    assert mean_utilisation([[], []]) is None
