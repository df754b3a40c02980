"""``p2ptrain bench roles-memory``'s figures from the nodes' statuses (the network itself
runs in tests/integration/test_multi_role.py's shape; the bench's command is run by hand
with the demo's and the HF example's models)."""

from __future__ import annotations

import pytest

from p2ptrain.bench.roles_memory import FRIENDS, MAX_RATIO, _figures
from p2ptrain.cli.main import build_parser
from p2ptrain.errors import LocalError
from p2ptrain.observe.status import NodeStatus


def _status(peak: float, heads: int = 3) -> NodeStatus:
    return NodeStatus(
        peer_id="p",
        roles=("trainer",),
        address=None,
        experiment_id="e",
        height=heads,
        head_id="h",
        adopted_head_id="h",
        chains=1,
        heads_adopted=heads,
        outer_steps=heads,
        certificate_checks=heads,
        peak_rss_mib=peak,
    )


def test_the_ratio_is_the_highest_multi_role_peak_over_the_trainers() -> None:
    statuses = {name: _status(500.0 + i) for i, name in enumerate(FRIENDS)}
    statuses["trainer"] = _status(450.0)
    figures = _figures(statuses, 3, 12.0)
    assert figures["trainer_validator_peak_rss_mib"] == 502.0
    assert figures["ratio"] == pytest.approx(502 / 450, abs=1e-3)
    assert figures["passed"] is (MAX_RATIO >= 502 / 450)
    assert figures["nodes"]["friend-0"]["outer_steps"] == 3
    statuses["friend-1"] = _status(600.0)  # a second copy of a large model would show
    assert _figures(statuses, 3, 12.0)["passed"] is False


def test_a_status_without_a_peak_is_an_error_not_a_ratio() -> None:
    statuses = {name: _status(0.0) for name in (*FRIENDS, "trainer")}
    with pytest.raises(LocalError, match="no peak memory"):
        _figures(statuses, 3, 1.0)


def test_the_command_is_reachable() -> None:
    args = build_parser(["bench", "roles-memory", "--windows", "2"]).parse_args(
        ["bench", "roles-memory", "--windows", "2"]
    )
    assert args.windows == 2 and args.inner_steps == 10
