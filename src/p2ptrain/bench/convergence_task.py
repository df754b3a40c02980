"""The task every system of ``p2ptrain bench convergence`` trains, and how its workers report.

One :class:`Task` (the demo's char GPT on Shakespeare, ``workers`` workers, ``windows`` x
``inner_steps`` optimizer steps per worker at the workload's batch size) is handed to every
worker process as JSON. Each system consumes the same samples in all: ``workers x steps x
batch_size``. A DDP rank or a hivemind peer draws its minibatches with :func:`worker_batches`
(uniform over the training set, its own seeded stream); our trainers train on their leases.

Workers do not evaluate while they train (that would steal the CPU from training and from
the other systems' clocks): a worker writes a :class:`SnapshotWriter` snapshot of its weights
every ``inner_steps`` steps (DDP's rank 0 every :attr:`Task.snapshot_steps`), with the
wall-clock time it was taken, and the bench evaluates all of them on the same fixed
validation set once the system has stopped.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from p2ptrain.errors import LocalError
from p2ptrain.torch.char_gpt import DEFAULT_CONFIG
from p2ptrain.torch.demo_settings import DEMO_DEFAULTS
from p2ptrain.torch.workload import TorchWorkload

__all__ = [
    "LOOPBACK",
    "Placement",
    "Snapshot",
    "SnapshotWriter",
    "Task",
    "WorkerRun",
    "ask_to_stop",
    "build_workload",
    "load_snapshot",
    "rank_directory",
    "read_done",
    "read_snapshots",
    "snapshot_samples",
    "stop_epoch",
    "worker_batches",
    "worker_weights",
]

SNAPSHOT_GLOB = "step-*.safetensors"
DONE_FILE = "done.json"
#: Under a run's directory: the epoch at which its workers stop early (a run to target).
STOP_FILE = "stop-epoch"
#: The most steps between two of DDP's snapshots, whatever the window's length: DDP's time to
#: a loss is that of its first snapshot at or below it, so a long window (50 steps) must not
#: round DDP's time up by up to a window while our network's is read at every head.
DDP_SNAPSHOT_STEPS = 25


@dataclass(frozen=True)
class Task:
    """What every system trains: the workload, how many workers, how many steps each (by
    default the demo's)."""

    workers: int = int(DEMO_DEFAULTS["trainers"])
    windows: int = int(DEMO_DEFAULTS["windows"])
    inner_steps: int = int(DEMO_DEFAULTS["inner_steps"])
    config: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CONFIG))
    seed: int = 0
    #: Our network's window.staleness (DDP and hivemind have no such setting).
    staleness: int = int(DEMO_DEFAULTS["staleness"])
    #: The windows our network's inner learning rate decays over (0: ``windows``): a run
    #: to target past the reference budget keeps the reference run's schedule, then its
    #: floor.
    schedule_windows: int = 0
    #: Our network's updates: 0 for the demo's dense int4; a fraction (e.g. 0.02) for the
    #: sparse recipe (:data:`SPARSE_RECIPE`: ``sparseloco`` of that fraction with a dense
    #: warm-up, ``contributor_mean``, outer SGD at lr 1, int4 aggregates).
    sparse: float = 0.0

    @property
    def steps(self) -> int:
        """Optimizer steps per worker (a DDP step is one global step of every rank)."""
        return self.windows * self.inner_steps

    @property
    def snapshot_steps(self) -> int:
        """Steps between two of DDP's snapshots: a window's, at most :data:`DDP_SNAPSHOT_STEPS`."""
        return min(self.inner_steps, DDP_SNAPSHOT_STEPS)

    @property
    def samples(self) -> int:
        """Samples every worker together trains on in the run: ``steps`` batches each."""
        return self.workers * self.steps * int(self.config.get("batch_size", 0) or 0)

    @property
    def lr(self) -> float:
        return float(self.config.get("lr", 1e-3))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Task:
        try:
            values = json.loads(text)
            return cls(**values)
        except (ValueError, TypeError) as exc:
            raise LocalError(f"the bench task {text[:200]!r} does not read: {exc}") from exc


class Placement(Protocol):
    """Where a system's processes run: each named host in its own network namespace (a
    :class:`~p2ptrain.bench.netns_lab.NamespaceLab`) or all of them on loopback."""

    def command_prefix(self, host: str) -> list[str]:
        """What to put in front of a host's command line (``ip netns exec ...`` or nothing)."""
        ...

    def host_address(self, host: str) -> str:
        """The IP address the host's processes listen on and peers dial."""
        ...


class _Loopback:
    """Every host is this machine, at 127.0.0.1."""

    def command_prefix(self, host: str) -> list[str]:
        return []

    def host_address(self, host: str) -> str:
        return "127.0.0.1"


LOOPBACK: Placement = _Loopback()


def build_workload(task: Task, *, threads: int = 1) -> TorchWorkload:
    """The task's workload at its genesis weights (the same in every process), torch on
    ``threads`` threads."""
    from p2ptrain.torch.registry import make_workload

    torch.set_num_threads(threads)
    workload = make_workload("char-gpt", task.config)
    if not isinstance(workload, TorchWorkload):
        raise LocalError("the bench task's workload is not a TorchWorkload")
    return workload


def worker_batches(workload: TorchWorkload, task: Task, rank: int) -> Iterator[list[int]]:
    """``task.steps`` minibatches of sample indices for worker ``rank``: drawn uniformly
    (with replacement) from the training set by a stream seeded with the task's seed and
    the rank, so that every run of the bench draws the same ones."""
    samples = len(workload.train_dataset)
    draw = random.Random(task.seed * 1_000_003 + rank)
    for _ in range(task.steps):
        yield [draw.randrange(samples) for _ in range(workload.batch_size)]


def worker_weights(workload: TorchWorkload) -> dict[str, torch.Tensor]:
    """The weights of the workload's model now, under the names :meth:`evaluate` takes."""
    names = workload.initial_weights().keys()
    params = dict(workload.model.named_parameters())
    return {name: params[name].detach().to("cpu", copy=True) for name in names}


@dataclass(frozen=True)
class WorkerRun:
    """What a run of DDP ranks or hivemind peers left: wall-clock bounds (``time.time()``),
    the first worker's snapshot directory, every worker's directory and log, and each
    worker's seconds inside its optimizer steps."""

    launched: float
    ended: float
    snapshots: Path
    rank_dirs: list[Path]
    logs: list[Path]
    inner_seconds: list[float]


class Snapshot(NamedTuple):
    """Weights a worker saved at ``time`` (``time.time()``) after ``step`` of its steps."""

    time: float
    step: int
    samples: int
    path: Path


class SnapshotWriter:
    """Saves a worker's weights under ``directory`` (``step-<step>.safetensors``, metadata
    ``time``/``step``/``samples``) and, when it finishes, ``done.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.started = time.time()

    def save(self, step: int, samples: int, weights: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        taken = time.time()
        path = self.directory / f"step-{step:07d}.safetensors"
        partial = path.with_name(f"{path.name}.partial")  # a watcher never reads half of it
        metadata = {"time": repr(taken), "step": str(step), "samples": str(samples)}
        save_file({k: v.contiguous() for k, v in weights.items()}, str(partial), metadata)
        partial.replace(path)

    def finish(self, **figures: float | int) -> None:
        """``done.json``: when the worker started and ended, and what else it measured."""
        record = {"started": self.started, "ended": time.time(), **figures}
        (self.directory / DONE_FILE).write_text(json.dumps(record, indent=1))


def rank_directory(out: Path, rank: int) -> Path:
    """Where worker ``rank`` writes its snapshots and ``done.json`` under ``out``."""
    return out / f"rank{rank}"


def _snapshot_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


def snapshot_samples(path: Path) -> int:
    """The samples every worker together had trained on when it saved the snapshot at
    ``path`` (0 when its metadata does not say)."""
    try:
        return int(_snapshot_metadata(path).get("samples", 0))
    except ValueError:
        return 0


def read_snapshots(directory: Path) -> list[Snapshot]:
    """The snapshots a :class:`SnapshotWriter` left in ``directory``, oldest first."""
    found = []
    for path in sorted(directory.glob(SNAPSHOT_GLOB)):
        meta = _snapshot_metadata(path)
        try:
            found.append(
                Snapshot(float(meta["time"]), int(meta["step"]), int(meta["samples"]), path)
            )
        except (KeyError, ValueError) as exc:
            raise LocalError(f"the snapshot {path} has no time/step/samples ({exc})") from exc
    return sorted(found)


def stop_epoch(out: Path) -> int | None:
    """The epoch at which the workers under ``out`` are asked to stop (a run to target that
    reached it), or None."""
    try:
        return int((out / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None


def ask_to_stop(out: Path, epoch: int) -> None:
    """Ask the workers under ``out`` to stop once they reach ``epoch`` (written whole, by a
    rename, so that no worker reads half of it)."""
    partial = out / f"{STOP_FILE}.partial"
    partial.write_text(str(epoch))
    partial.replace(out / STOP_FILE)


def read_done(directory: Path) -> dict[str, Any] | None:
    """What a worker wrote when it finished, or None if it did not."""
    path = directory / DONE_FILE
    if not path.is_file():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def load_snapshot(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = load_file(str(snapshot.path))
    return weights
