"""The demo's ``loss.png``: validation loss of the certified model against the baseline.

Two panels: the loss by wall clock (seconds since training started) and by bytes (MB each
trainer sent and received, on a log scale: the baseline's all-reduce moves hundreds of times
more). :func:`plot_loss` takes plain points and writes the PNG; it imports matplotlib (the
``bench`` extra) lazily with the Agg backend, and :func:`can_plot` says whether it can.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "BASELINE_LABEL",
    "BYTES_LABEL",
    "CERTIFIED_LABEL",
    "NO_MATPLOTLIB",
    "SECONDS_LABEL",
    "LossPoint",
    "PlotPanel",
    "can_plot",
    "plot_loss",
]

NO_MATPLOTLIB = (
    "no loss.png: matplotlib is not installed (pip install 'p2ptrain[bench]', or `make`)"
)
CERTIFIED_LABEL = "certified model (p2ptrain)"
BASELINE_LABEL = "DDP-equivalent baseline (replay time; bytes by formula)"
SECONDS_LABEL = "seconds since training started"
BYTES_LABEL = "MB sent + received per trainer (log scale)"
LOSS_LABEL = "validation loss"


class LossPoint(NamedTuple):
    """A model's validation loss, when it was reached and what it cost on the network."""

    seconds: float
    #: Per trainer (DDP: per worker), sent + received; None where it was not measured.
    bytes: int | None
    loss: float


@dataclass(frozen=True)
class PlotPanel:
    """What one panel of the figure shows: its labels and each line's label and points."""

    title: str
    xlabel: str
    ylabel: str
    lines: tuple[tuple[str, int], ...]


def can_plot() -> bool:
    """Whether matplotlib can be imported (else :data:`NO_MATPLOTLIB` says what to do)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def plot_loss(
    path: Path,
    certified: Sequence[tuple[float, int | None, float]],
    baseline: Sequence[tuple[float, int | None, float]] = (),
    *,
    title: str = "p2ptrain demo",
) -> tuple[PlotPanel, PlotPanel]:
    """Write the two panels to ``path`` (PNG); return what each shows.

    ``certified`` and ``baseline`` are (seconds, bytes, loss) points (:class:`LossPoint`),
    in order. Points at 0 bytes (the genesis weights) have no place on the log scale of
    the bytes panel, and points without bytes (None) no place at all: both are left out
    there. The baseline's last loss is also drawn as a
    dashed line across both panels: where the certified model should come to.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [LossPoint(*p) for p in certified]
    theirs = [LossPoint(*p) for p in baseline]
    figure, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        for points, label, style, size in (
            (ours, CERTIFIED_LABEL, "-o", 3),
            (theirs, BASELINE_LABEL, "--s", 6),
        ):
            if not points:
                continue
            by_time.plot([p.seconds for p in points], [p.loss for p in points], style,
                         markersize=size, label=label)  # fmt: skip
            spent = [(p.bytes, p.loss) for p in points if p.bytes]
            if spent:
                by_bytes.plot([b / 1e6 for b, _ in spent], [loss for _, loss in spent], style,
                              markersize=size, label=label)  # fmt: skip
        for axes in (by_time, by_bytes):
            if theirs:
                axes.axhline(theirs[-1].loss, linestyle=":", color="grey", linewidth=0.8,
                             label="baseline's final loss")  # fmt: skip
            axes.set_ylabel(LOSS_LABEL)
            axes.grid(alpha=0.3)
        by_time.set_xlabel(SECONDS_LABEL)
        by_time.set_title(f"{title}: loss by wall clock")
        by_bytes.set_xlabel(BYTES_LABEL)
        if by_bytes.lines:
            by_bytes.set_xscale("log")
        by_bytes.set_title("loss by bytes on the network")
        # one legend for both panels, below them: the panels show the same lines
        handles, labels = by_time.get_legend_handles_labels()
        figure.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
        figure.tight_layout(rect=(0, 0.07, 1, 1))
        figure.savefig(path, dpi=110)
        panels = tuple(
            PlotPanel(
                title=axes.get_title(),
                xlabel=axes.get_xlabel(),
                ylabel=axes.get_ylabel(),
                lines=tuple((str(line.get_label()), len(line.get_xdata())) for line in axes.lines),
            )
            for axes in (by_time, by_bytes)
        )
    finally:
        plt.close(figure)
    return panels[0], panels[1]
