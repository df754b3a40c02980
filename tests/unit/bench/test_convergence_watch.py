"""The run-to-target watcher of ``bench convergence``: it evaluates each new model once, says
when one reached the target, reads head weights from a running node's blob store by their
hash, and the workers' stop file is read whole."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from p2ptrain.bench.chaos_network import TINY_WORKLOAD
from p2ptrain.bench.convergence_task import Task, ask_to_stop, build_workload, stop_epoch
from p2ptrain.bench.convergence_watch import TargetWatch, head_weights
from p2ptrain.cli.bench_commands import _link_rates
from p2ptrain.core.tensors import encode_state_dict
from p2ptrain.errors import LocalError

TASK = Task(workers=2, windows=2, inner_steps=2, config=dict(TINY_WORKLOAD))

Weights = Mapping[str, torch.Tensor]


def _models() -> tuple[dict[str, torch.Tensor], float]:
    workload = build_workload(TASK)
    weights = workload.initial_weights()
    return weights, workload.evaluate(weights)


def test_the_watcher_evaluates_each_new_model_once_and_says_when_one_reached_the_target() -> None:
    weights, loss = _models()
    offered: list[tuple[str, Callable[[], Weights]] | None] = [None]
    loads: list[str] = []
    reached = threading.Event()

    def load(key: str) -> Callable[[], Weights]:
        return lambda: loads.append(key) or weights

    def newest() -> tuple[str, Callable[[], Weights]] | None:
        return offered[-1]

    # above the target: seen, not reached; the same key is not evaluated twice
    with TargetWatch(TASK, loss - 0.5, newest, reached.set, poll_s=0.02) as watch:
        offered.append(("a", load("a")))
        while not watch.seen:
            offered.append(("a", load("a")))
            threading.Event().wait(0.02)
    assert not reached.is_set() and loads == ["a"] and watch.seen == [("a", loss)]
    with TargetWatch(TASK, loss + 1e-6, newest, reached.set, poll_s=0.02) as watch:
        assert reached.wait(30.0)  # the model offered last is at the target
    assert watch.done.is_set() and watch.error is None


def test_a_model_that_cannot_be_loaded_ends_the_watch_with_the_reason(tmp_path: Path) -> None:
    def newest() -> tuple[str, Callable[[], Weights]] | None:
        return "gone", lambda: head_weights(tmp_path, "ab" * 32)

    with TargetWatch(TASK, 10.0, newest, lambda: None, poll_s=0.02) as watch:
        while watch.error is None:
            threading.Event().wait(0.02)
    assert "cannot read head weights" in watch.error and not watch.done.is_set()


def test_head_weights_are_read_by_their_hash_and_refused_when_they_do_not_hash(
    tmp_path: Path,
) -> None:
    weights, _ = _models()
    data = bytes(encode_state_dict(weights))
    blob = hashlib.sha256(data).hexdigest()
    (tmp_path / "blobs" / blob[:2]).mkdir(parents=True)
    (tmp_path / "blobs" / blob[:2] / blob).write_bytes(data)
    read = head_weights(tmp_path, blob)
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[k], weights[k]) for k in weights)
    (tmp_path / "blobs" / blob[:2] / blob).write_bytes(data[:-1] + b"\0")
    with pytest.raises(LocalError, match="does not hash to its name"):
        head_weights(tmp_path, blob)


def test_the_stop_epoch_is_written_whole_and_read_back(tmp_path: Path) -> None:
    assert stop_epoch(tmp_path) is None
    ask_to_stop(tmp_path, 7)
    assert stop_epoch(tmp_path) == 7 and not list(tmp_path.glob("*.partial"))


def test_link_rates_take_one_or_several_and_refuse_what_is_not_a_rate() -> None:
    assert _link_rates("50") == [50.0] and _link_rates("10, 50") == [10.0, 50.0]
    for bad in ("0", "-5", "nan", "inf", "fast", "10,,50"):
        with pytest.raises(LocalError, match="not a rate above 0"):
            _link_rates(bad)
