"""Evaluators: a validator started with ``--evaluate`` evaluates every certified head it
adopts and gossips a signed metrics report; another node (a viewer) stores the reports,
shows their median in ``p2ptrain status``, and ``p2ptrain evaluate`` on its data directory
reproduces the evaluator's loss.

One network for the module: a seed, one validator with ``--evaluate`` (q = 1), one trainer
that stops after :data:`WINDOWS` windows and a viewer, with the tiny char-GPT.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from p2ptrain.cli.node_commands import describe_status
from p2ptrain.core.records import MetricsReport
from p2ptrain.errors import LocalError
from p2ptrain.node.export import evaluate_stored_head
from p2ptrain.observe.status import read_status
from tests.support.local_net import Net, new_net, stored_chain, stored_records

pytestmark = pytest.mark.integration

WINDOWS = 3
#: One update per window closes it at once; the deadline matters only for a slow start.
DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("evaluators"))
    try:
        path = net.write_experiment(
            validators=["validator-0"], quorum=1, max_updates=1, deadline_s=DEADLINE_S
        )
        net.start("seed", "seed", args=["--experiment-toml", str(path)])
        net.wait_ready(["seed"])
        net.start("validator-0", "validator", args=["--evaluate"])
        net.start("viewer-0", "viewer")
        net.start("trainer-0", "trainer", windows=WINDOWS)
        net.wait_ready(["validator-0", "viewer-0", "trainer-0"])
        # the validator evaluates the last head (the newest is never skipped) ...
        net.wait_event(
            f"validator-0 to evaluate head {WINDOWS}",
            90,
            lambda n, e: (
                n == "validator-0" and e["event"] == "evaluated" and e["height"] == WINDOWS
            ),
        )
        # ... and its report reaches the viewer, which shows it in its status
        net.wait_until(
            f"viewer-0's status to show the report of head {WINDOWS}",
            30,
            lambda: (net.status("viewer-0").get("validation") or {}).get("height") == WINDOWS,
        )
        # ... and the viewer holds head WINDOWS itself (its status can show a report of a head
        # whose certificate it has while its weights are still on their way)
        net.wait_height("viewer-0", WINDOWS, 30)
        net.stop(["trainer-0", "viewer-0", "validator-0", "seed"])
        yield net
    finally:
        net.close()


def _p2ptrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def _evaluated(net: Net) -> dict[int, dict[str, Any]]:
    """The validator's own evaluations, by height."""
    return {e["height"]: e for e in net.events("evaluated", "validator-0")}


def test_the_evaluator_reports_certified_heads_and_another_node_stores_them(net: Net) -> None:
    evaluated = _evaluated(net)
    chain = {head.height: head.id for head, _ in stored_chain(net.data_dir("viewer-0"))}
    reports = stored_records(net.data_dir("viewer-0"), "metrics", MetricsReport)
    by_height = {r.height: r for r in reports.values()}
    # reports for at least two certified heads, each the certified head of its height
    assert len(by_height) >= 2 and WINDOWS in by_height, sorted(by_height)
    validator_key = bytes.fromhex(net.network.identity("validator-0"))
    for height, report in by_height.items():
        assert report.head_id == chain[height]
        assert report.evaluator == validator_key
        event = evaluated[height]
        assert (report.loss, report.samples, report.perplexity) == (
            event["loss"],
            event["samples"],
            event["perplexity"],
        )
        assert report.samples > 0 and report.perplexity is not None
    # at most one report per evaluator and head
    assert len(reports) == len(by_height)
    # the seed (no --evaluate) keeps them too, and evaluated nothing itself
    assert stored_records(net.data_dir("seed"), "metrics", MetricsReport)
    assert not net.events("evaluated", "seed") and not net.events("role_error")


def test_status_shows_the_median_validation_loss(net: Net) -> None:
    status = json.loads(_p2ptrain("status", str(net.data_dir("viewer-0")), "--json").stdout)
    validation = status["validation"]
    last = _evaluated(net)[WINDOWS]
    assert validation["height"] == WINDOWS and validation["head_id"] == last["head_id"]
    assert validation["reports"] == 1 and validation["median_loss"] == last["loss"]
    text = "\n".join(describe_status(read_status(net.data_dir("viewer-0"))))
    assert f"at height {WINDOWS}" in text and "median of 1 report" in text
    roles = {state["role"]: state for state in net.status("validator-0")["role_states"]}
    assert roles["evaluator"]["statistics"]["evaluated"] >= 2


def test_evaluate_reproduces_the_evaluators_loss(net: Net) -> None:
    evaluated = _evaluated(net)
    viewer = str(net.data_dir("viewer-0"))
    answer = json.loads(_p2ptrain("evaluate", "--dir", viewer, "--json").stdout)
    assert answer["height"] == WINDOWS and answer["head_id"] == evaluated[WINDOWS]["head_id"]
    assert abs(answer["loss"] - evaluated[WINDOWS]["loss"]) <= 1e-6
    [report] = answer["reports"]
    assert abs(report["difference"]) <= 1e-6
    # an older head, by id, in words
    height = min(evaluated)
    text = _p2ptrain("evaluate", "--dir", viewer, "--head", evaluated[height]["head_id"]).stdout
    assert f"head {height} (" in text and "difference" in text
    with pytest.raises(LocalError, match="holds no certified head"):
        evaluate_stored_head(net.data_dir("viewer-0"), "0" * 64)
