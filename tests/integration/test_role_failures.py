"""Failures that show: a role step that raises is recorded for its window, shown in
``p2ptrain status`` and the event stream, and the role goes on; a role that keeps failing
ends its node with a message (and ``Trainer.run()`` raises).

One network for the module: a seed, a validator whose first tick raises (q = 1, so every
certified head carries its attestation), a healthy trainer, a trainer whose 2nd window
raises, and a trainer whose every window raises; the Trainer API test adds a trainer whose
loss function always raises. Faults are injected by role and step in otherwise real node
processes (``tests/support/faulty_node.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from p2ptrain import RoleFailed, Trainer
from p2ptrain.errors import LocalError
from p2ptrain.torch.char_gpt import char_gpt_workload
from tests.support.faulty_node import FAULT_ENV
from tests.support.local_net import TINY_CONFIG, Net, new_net

pytestmark = pytest.mark.integration

#: Window 2 of the trainer that fails once has one update only, so it closes at its deadline.
DEADLINE_S = 6.0
FAULTY = [sys.executable, "-m", "tests.support.faulty_node"]


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("role-failures"))
    try:
        path = net.write_experiment(
            validators=["validator-0"],
            quorum=1,
            max_updates=2,  # the two trainers that publish
            deadline_s=DEADLINE_S,
        )
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        # every window runs to its deadline (not closed once the live trainers reported), so
        # a trainer that fails and backs off is seen failing within a few windows
        net.start(
            "validator-0",
            "validator",
            program=FAULTY,
            env={FAULT_ENV: "tick:once"},
            args=["--no-early-close"],
        )
        net.start("trainer-0", "trainer")
        net.start("trainer-1", "trainer", program=FAULTY, env={FAULT_ENV: "train:2"})
        net.start("trainer-2", "trainer", program=FAULTY, env={FAULT_ENV: "train:always"})
        net.killed.add("trainer-2")  # it is meant to end by itself; its exit is checked
        net.wait_ready(["validator-0", "trainer-0", "trainer-1", "trainer-2"])
        yield net
    finally:
        net.close()


def _first(net: Net, what: str, timeout_s: float, match: Any) -> dict[str, Any]:
    """The first event, seen already or still to come, for which ``match(name, event)``."""
    for _, name, event in net.history:
        if match(name, event):
            return event
    return net.wait_event(what, timeout_s, match)[1]


def _status(net: Net, name: str) -> dict[str, Any]:
    answer = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "status", str(net.data_dir(name)), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    status: dict[str, Any] = json.loads(answer.stdout)
    return status


def test_a_trainer_whose_second_window_raises_shows_it_and_goes_on(net: Net) -> None:
    failure = _first(
        net,
        "trainer-1's role error",
        120,
        lambda n, e: n == "trainer-1" and e["event"] == "role_error",
    )
    window = failure["window"]
    assert failure["role"] == "trainer" and failure["error"] == "RuntimeError"
    assert failure["failures"] == 1 and failure["limit"] == 3
    # the others go on, and so does trainer-1, with the window after
    _first(
        net,
        f"trainer-1 to publish a window after {window}",
        120,
        lambda n, e: n == "trainer-1" and e["event"] == "published" and e["window"] > window,
    )
    status = _status(net, "trainer-1")
    errors = [e for e in status["errors"] if e["role"] == "trainer"]
    assert [e["window"] for e in errors] == [window], errors
    assert errors[0]["error"] == "RuntimeError" and "injected fault" in errors[0]["message"]
    assert status["role_states"][0]["failures_in_a_row"] == 0  # a trained window cleared it
    text = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "status", str(net.data_dir("trainer-1"))],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert f"error      trainer, window {window}, training: RuntimeError" in text
    net.check("trainer-1" not in net.exited, "trainer-1 should keep running")


def test_a_trainer_that_always_raises_stops_its_node_within_three_windows(net: Net) -> None:
    net.wait_exits(["trainer-2"], 180)
    failures = net.events("role_error", "trainer-2")
    windows = [e["window"] for e in failures]
    assert [e["failures"] for e in failures] == [1, 2, 3], failures
    assert windows == sorted(windows) and windows[-1] - windows[0] <= 2, windows
    exited = net.events("exited", "trainer-2")[-1]
    assert exited["returncode"] == 3  # RoleFailed
    stopped = net.events("stopped", "trainer-2")[-1]
    assert "the trainer role failed 3 times in a row" in stopped["failed"]
    log = (net.workdir / "logs" / "trainer-2.log").read_text()
    assert "p2ptrain: error: the trainer role failed 3 times in a row" in log
    assert "RuntimeError: injected fault in training call 3" in log
    assert "fix the cause" in log and "--max-role-failures" in log
    assert _status(net, "trainer-2")["failed"] is not None


def test_the_trainer_api_raises_when_training_keeps_failing(net: Net) -> None:
    seed = net.network.seed
    assert seed is not None and seed.address is not None and net.network.experiment_id
    parts = char_gpt_workload(TINY_CONFIG)

    def broken_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise ValueError("the loss function is broken")

    def api_trainer(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Trainer:
        return Trainer(
            data_dir=Path(net.workdir) / "api-trainer",
            experiment=str(net.network.experiment_id),
            bootstrap=[str(seed.address)],
            model=parts.model,
            optimizer=parts.optimizer,
            train_loader=DataLoader(parts.train_dataset, batch_size=parts.batch_size),
            loss_fn=loss_fn,
        )

    # a loss that is always broken fails at once, in the dry run, before anything joins
    with pytest.raises(LocalError, match=r"failed on the first training batch.*is broken"):
        api_trainer(broken_loss)
    calls = [0]

    def breaks_after_the_dry_run(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] > 1:
            raise ValueError("the loss function is broken")
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    trainer = api_trainer(breaks_after_the_dry_run)
    with pytest.raises(RoleFailed, match="the trainer role failed 3 times in a row") as caught:
        for _outcome in trainer.run():  # until it raises (the module's timeout otherwise)
            pass
    assert isinstance(caught.value.__cause__, ValueError)
    assert "the loss function is broken" in str(caught.value)


def test_a_validator_whose_tick_raises_once_attests_the_next_window(net: Net) -> None:
    failure = _first(
        net,
        "validator-0's role error",
        120,
        lambda n, e: n == "validator-0" and e["event"] == "role_error",
    )
    assert failure["role"] == "validator" and failure["step"] == "tick"
    window = failure["window"]
    _first(
        net,
        f"validator-0 to attest window {window + 1}",
        120,
        lambda n, e: n == "validator-0" and e["event"] == "attested" and e["height"] > window,
    )
    status = _status(net, "validator-0")
    assert [e["step"] for e in status["errors"]] == ["tick"]
    assert status["role_states"][0]["failures_in_a_row"] == 0
    net.check("validator-0" not in net.exited, "validator-0 should keep running")
