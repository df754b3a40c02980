"""The run-to-target watcher of ``bench convergence``: it evaluates each new model once, says
when one reached the target, reads head weights from a running node's blob store by their
hash, and the workers' stop file is read whole."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from p2ptrain.bench.chaos_network import TINY_WORKLOAD
from p2ptrain.bench.convergence_task import Task, ask_to_stop, build_workload, stop_epoch
from p2ptrain.bench.convergence_watch import Model, TargetWatch, head_blob, read_blob
from p2ptrain.cli.bench_commands import _link_rates
from p2ptrain.core.tensors import encode_state_dict
from p2ptrain.errors import LocalError

TASK = Task(workers=2, windows=2, inner_steps=2, config=dict(TINY_WORKLOAD))

Weights = Mapping[str, torch.Tensor]


def _models() -> tuple[dict[str, torch.Tensor], float]:
    workload = build_workload(TASK)
    weights = workload.initial_weights()
    return weights, workload.evaluate(weights)


def _blob(directory: Path, weights: Weights) -> Path:
    """``weights`` as a node keeps them: a blob under its SHA-256."""
    data = bytes(encode_state_dict(dict(weights)))
    path = head_blob(directory, hashlib.sha256(data).hexdigest())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_watcher_evaluates_each_new_model_once_and_says_when_one_reached_the_target(
    tmp_path: Path,
) -> None:
    weights, loss = _models()
    blob = _blob(tmp_path, weights)
    offered: list[Model | None] = [None]
    reached = threading.Event()

    def newest() -> Model | None:
        return offered[-1]

    # above the target: seen, not reached; the same key is not evaluated twice
    with TargetWatch(TASK, loss - 0.5, newest, reached.set, poll_s=0.02) as watch:
        offered.append(("a", "blob", blob))
        while not watch.seen:
            threading.Event().wait(0.02)
        offered.append(("b", "safetensors", tmp_path / "b.safetensors"))
        save_file(dict(weights), str(tmp_path / "b.safetensors"))
        while len(watch.seen) < 2:
            threading.Event().wait(0.02)
    assert not reached.is_set() and watch.seen == [("a", loss), ("b", loss)]
    with TargetWatch(TASK, loss + 1e-6, newest, reached.set, poll_s=0.02) as watch:
        assert reached.wait(60.0)  # the model offered last is at the target
    assert watch.done.is_set() and watch.error is None and watch.seen == [("b", loss)]


def test_a_model_that_cannot_be_loaded_ends_the_watch_with_the_reason(tmp_path: Path) -> None:
    def newest() -> Model | None:
        return "gone", "blob", head_blob(tmp_path, "ab" * 32)

    with TargetWatch(TASK, 10.0, newest, lambda: None, poll_s=0.02) as watch:
        while watch.error is None:
            threading.Event().wait(0.02)
    assert "cannot read head weights" in watch.error and not watch.done.is_set()


def test_the_watcher_runs_in_a_lowered_process_of_its_own(tmp_path: Path) -> None:
    """Its own session (so its own autogroup, where Linux has them) at niceness 19: a niced
    thread of the bench's process would take a trainer's share whenever it evaluates."""
    with TargetWatch(TASK, 10.0, lambda: None, lambda: None, poll_s=0.02) as watch:
        child = watch._child
        assert child is not None
        deadline = time.monotonic() + 60
        while os.getpriority(os.PRIO_PROCESS, child.pid) != 19:
            assert time.monotonic() < deadline, "the watcher never lowered its priority"
            threading.Event().wait(0.02)
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
        group = Path(f"/proc/{child.pid}/autogroup")
        if group.exists():
            assert group.read_text().split()[-1] == "19", group.read_text()


def test_head_weights_are_read_by_their_hash_and_refused_when_they_do_not_hash(
    tmp_path: Path,
) -> None:
    weights, _ = _models()
    path = _blob(tmp_path, weights)
    assert path.parent.parent == tmp_path / "blobs"
    data = path.read_bytes()
    read = read_blob(path)
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[k], weights[k]) for k in weights)
    path.write_bytes(data[:-1] + b"\0")
    with pytest.raises(LocalError, match="does not hash to its name"):
        read_blob(path)


def test_the_stop_epoch_is_written_whole_and_read_back(tmp_path: Path) -> None:
    assert stop_epoch(tmp_path) is None
    ask_to_stop(tmp_path, 7)
    assert stop_epoch(tmp_path) == 7 and not list(tmp_path.glob("*.partial"))


def test_link_rates_take_one_or_several_and_refuse_what_is_not_a_rate() -> None:
    assert _link_rates("50") == [50.0] and _link_rates("10, 50") == [10.0, 50.0]
    for bad in ("0", "-5", "nan", "inf", "fast", "10,,50"):
        with pytest.raises(LocalError, match="not a rate above 0"):
            _link_rates(bad)


def test_nothing_is_evaluated_while_a_run_is_within_the_reference_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchers of our network and of hivemind offer no model to evaluate before the
    run trained on the reference samples (the evaluation would take CPU from the run it
    times); past them, the newest model."""
    from p2ptrain.bench import convergence, convergence_watch
    from p2ptrain.bench.convergence_network import CertifiedHead
    from p2ptrain.bench.convergence_task import SnapshotWriter, rank_directory

    offered: list[Model | None] = []

    class Recorder:
        error = None

        def __init__(self, task: Task, target: float, newest: object, reached: object) -> None:
            self.newest = newest

        def __enter__(self) -> Recorder:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def offer(self) -> None:
            offered.append(self.newest())  # type: ignore[operator]

    watches: list[Recorder] = []
    monkeypatch.setattr(
        convergence_watch,
        "TargetWatch",
        lambda *args: watches.append(Recorder(*args)) or watches[-1],  # type: ignore[func-returns-value]
    )
    batch = int(TASK.config["batch_size"])
    per_head = TASK.workers * TASK.inner_steps * batch  # samples of a head accepting all
    heads: list[CertifiedHead] = []
    system = convergence._System("p2ptrain")
    with convergence._watch_heads(
        TASK, 1.0, tmp_path, heads, lambda: None, reference=2 * per_head, system=system
    ):
        watches[-1].offer()  # no head yet
        for height in (1, 2):
            heads.append(CertifiedHead(0.0, height, f"{height:064x}", TASK.workers, "ab" * 32))
            watches[-1].offer()
    assert offered == [None, None, (f"{2:064x}", "blob", head_blob(tmp_path, "ab" * 32))]
    assert "watcher_error" not in system.extra

    offered.clear()
    writer = SnapshotWriter(rank_directory(tmp_path, 0))
    weights, _ = _models()
    with convergence._watch_snapshots(TASK, 1.0, tmp_path, reference=2 * per_head, system=system):
        watches[-1].offer()  # no snapshot yet
        for epoch in (1, 2):
            writer.save(epoch * TASK.inner_steps, epoch * per_head, weights)
            watches[-1].offer()
    newest = rank_directory(tmp_path, 0) / f"step-{2 * TASK.inner_steps:07d}.safetensors"
    assert offered == [None, None, (newest.name, "safetensors", newest)]


def test_a_watcher_that_cannot_tell_the_newest_model_says_why_and_stops() -> None:
    def newest() -> Model | None:
        raise LookupError("no such head")

    with TargetWatch(TASK, 10.0, newest, lambda: None, poll_s=0.02) as watch:
        watch._thread.join(timeout=30)
        assert not watch._thread.is_alive()
    assert watch.error == "cannot tell the system's newest model: LookupError('no such head')"
    assert not watch.done.is_set()
