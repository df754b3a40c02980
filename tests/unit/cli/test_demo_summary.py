"""What ``p2ptrain demo`` reports of each node from its last status file: its roles, its
process's peak memory and, for a reducer or validator, its last reduction (``nodes`` in the
JSON, two rows of the printed table); the aggregation backends the nodes used; and a
trainer's mean bytes by kind (what its downloads and uploads were)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from p2ptrain.cli.demo_command import _backends, _node_figures, _print_summary
from p2ptrain.observe.status import NodeStatus, mean_bytes_by_kind


def _status(roles: tuple[str, ...], **changes: Any) -> NodeStatus:
    return NodeStatus(
        peer_id="ab" * 32,
        roles=roles,
        address=None,
        experiment_id="e1" * 32,
        height=3,
        head_id="cd" * 32,
        adopted_head_id="cd" * 32,
        **changes,
    )


STATUSES = {
    "seed": _status(("seed",), peak_rss_mib=300.5),
    "reducer": _status(
        ("reducer",),
        peak_rss_mib=512.25,
        aggregation_backend="native (packaged)",
        reduction_window=3,
        reduction_seconds=0.125,
        reduction_accepted=2,
        reductions_timed=3,
        reduction_seconds_total=0.5,
    ),
    "validator-0": _status(
        ("validator",), peak_rss_mib=480.0, rss_after_imports_mib=250.5
    ),  # not reduced yet
    "trainer-0": _status(("trainer",), peak_rss_mib=900.75),
}


def test_each_node_is_reported_with_its_roles_memory_and_last_reduction() -> None:
    assert _node_figures(STATUSES) == {
        "seed": {
            "roles": ["seed"],
            "peak_rss_mib": 300.5,
            "rss_after_imports_mib": None,
            "reduction_seconds": None,
            "reduction_window": None,
        },
        "reducer": {
            "roles": ["reducer"],
            "peak_rss_mib": 512.25,
            "rss_after_imports_mib": None,
            "reduction_seconds": 0.125,
            "reduction_window": 3,
        },
        "validator-0": {
            "roles": ["validator"],
            "peak_rss_mib": 480.0,
            "rss_after_imports_mib": 250.5,
            "reduction_seconds": None,
            "reduction_window": None,
        },
        "trainer-0": {
            "roles": ["trainer"],
            "peak_rss_mib": 900.75,
            "rss_after_imports_mib": None,
            "reduction_seconds": None,
            "reduction_window": None,
        },
    }
    assert _backends(STATUSES) == "native (packaged)"
    assert _backends({"seed": STATUSES["seed"]}) is None


def test_the_printed_summary_says_each_nodes_memory_and_reduction_with_units() -> None:
    summary: dict[str, Any] = {
        "windows_certified": 3,
        "val_loss": None,
        "validation_missing": "no validation split",
        "baseline_val_loss": None,
        "bytes_per_trainer_sent": 2_000_000,
        "bytes_per_trainer_received": 3_000_000,
        "ddp_bytes_per_trainer": 50_000_000,
        "bytes_ratio": 10.0,
        "compute_utilisation": None,
        "nodes": _node_figures(STATUSES),
        "checkpoint": "model.safetensors",
        "export_hf": None,
        "seconds": 42.0,
    }
    console = Console(record=True, width=300)
    _print_summary(summary, console)
    text = console.export_text()
    assert "seed 300 MiB, reducer 512 MiB, validator-0 480 MiB, trainer-0 901 MiB" in text
    assert "last reduction per node" in text
    assert "reducer 0.125 s (window 3)" in text
    assert "validator-0 0." not in text and "trainer-0 0." not in text


def test_a_trainers_bytes_by_kind_are_the_trainers_means_and_are_printed() -> None:
    trainers = [
        _status(
            ("trainer",),
            bytes_received_by_kind={"aggregate": 3_000_000, "state": 1_000_000, "gossip": 1},
            bytes_sent_by_kind={"update": 2_000_000, "gossip": 500_000},
        ),
        _status(
            ("trainer",),
            bytes_received_by_kind={"aggregate": 3_000_001, "state": 0, "gossip": 2},
            bytes_sent_by_kind={"update": 2_000_000},
        ),
    ]
    received = mean_bytes_by_kind(trainers, "received")
    assert received == {"aggregate": 3_000_000, "gossip": 1, "state": 500_000}
    assert mean_bytes_by_kind(trainers, "sent") == {"gossip": 250_000, "update": 2_000_000}
    summary: dict[str, Any] = {
        "windows_certified": 3,
        "val_loss": None,
        "validation_missing": "no validation split",
        "baseline_val_loss": None,
        "bytes_per_trainer_sent": 2_250_000,
        "bytes_per_trainer_received": 3_500_001,
        "bytes_per_trainer_received_by_kind": received,
        "bytes_per_trainer_sent_by_kind": mean_bytes_by_kind(trainers, "sent"),
        "gossip_bytes_per_window": 250_000,
        "update_bytes_per_window": 666_666,
        "ddp_bytes_per_trainer": 50_000_000,
        "bytes_ratio": 10.0,
        "compute_utilisation": None,
        "nodes": _node_figures(STATUSES),
        "checkpoint": "model.safetensors",
        "export_hf": None,
        "seconds": 42.0,
    }
    console = Console(record=True, width=300)
    _print_summary(summary, console)
    text = console.export_text()
    assert "3.00 MB aggregate, 0.50 MB state, 0.00 MB gossip" in text
    assert "2.00 MB update, 0.25 MB gossip" in text
    assert "250.0 kB sent and received (its update: 666.7 kB)" in text
