"""The demo's loss.png: two panels, the certified model against the baseline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from p2ptrain.cli.loss_plot import (
    BASELINE_LABEL,
    BYTES_LABEL,
    CERTIFIED_LABEL,
    SECONDS_LABEL,
    LossPoint,
    can_plot,
    plot_loss,
)

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: genesis at 0 s and 0 bytes, then four certified windows, one before a trainer's bytes
#: were known
CERTIFIED = [(0.0, 0, 4.4), (6.0, None, 3.6), (12.0, 300_000, 3.1), (24.5, 610_000, 2.7),
             (37.0, 905_000, 2.5)]  # fmt: skip
BASELINE = [LossPoint(0.0, 0, 4.4), LossPoint(30.0, 171_000_000, 2.45)]


def test_it_writes_a_png_with_a_panel_by_time_and_one_by_bytes(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    by_time, by_bytes = plot_loss(path, CERTIFIED, BASELINE)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # a drawn figure, not an empty canvas
    assert by_time.xlabel == SECONDS_LABEL
    assert by_bytes.xlabel == BYTES_LABEL
    assert "per trainer" in by_bytes.xlabel
    assert by_time.ylabel == by_bytes.ylabel == "validation loss"
    lines = dict(by_time.lines)
    assert lines[CERTIFIED_LABEL] == 5
    assert lines[BASELINE_LABEL] == 2
    assert "baseline's final loss" in lines
    # the genesis points (0 bytes) have no place on the log scale, nor one without bytes
    lines = dict(by_bytes.lines)
    assert lines[CERTIFIED_LABEL] == 3
    assert lines[BASELINE_LABEL] == 1


def test_without_a_baseline_only_the_certified_model_is_drawn(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    by_time, by_bytes = plot_loss(path, CERTIFIED)
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    assert [label for label, _ in by_time.lines] == [CERTIFIED_LABEL]
    assert [label for label, _ in by_bytes.lines] == [CERTIFIED_LABEL]


def test_without_matplotlib_it_says_it_cannot_plot(monkeypatch: pytest.MonkeyPatch) -> None:
    assert can_plot()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert not can_plot()
