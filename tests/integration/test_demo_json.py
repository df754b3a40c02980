"""``p2ptrain demo --json`` reports what its trainers measured: bytes sent and received on
their connections (the kernel's count) and the share of their time spent in inner steps.
It runs with ``--staleness 1`` (trainers train ahead of the certified chain), and the
trainers follow the chain by applying each head's aggregate themselves. The validation loss
after each window, with its time and bytes, is in the JSON and drawn in loss.png."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path


def test_the_demo_reports_measured_bytes_and_compute_utilisation(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "demo", "--workdir", str(tmp_path / "demo"),
         "--windows", "3", "--inner-steps", "5", "--trainers", "2", "--json", "--no-baseline",
         "--staleness", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["windows_certified"] >= 3
    weights_bytes = 4 * summary["parameters"]
    sent, received = summary["bytes_per_trainer_sent"], summary["bytes_per_trainer_received"]
    assert summary["bytes_measured"] == "tcp"
    # each trainer uploaded two int4 updates (an eighth of the fp32 weights, each) ...
    assert sent > 2 * weights_bytes // 8
    # ... and downloaded each head's aggregate rounded to 4 bits (an eighth of the weights:
    # the demo's aggregation.precision) and the control traffic: never the genesis weights
    # (each trainer built them from the workload, and they hashed to the manifest's), nor a
    # head's weights and momentum (2x the weights a head: 6x in all), nor float32
    # aggregates (1x a head: 3x in all)
    assert 2 * weights_bytes // 8 < received < weights_bytes
    assert summary["bytes_per_trainer"] == sent + received
    # the trainers' own counters say what the downloads were: aggregates and gossip only,
    # with little else on the wire (HTTP and TCP framing)
    by_kind = summary["bytes_per_trainer_received_by_kind"]
    assert set(by_kind) == {"aggregate", "gossip"}, by_kind
    assert received <= 1.2 * (by_kind["aggregate"] + by_kind["gossip"])
    assert summary["bytes_per_trainer_sent_by_kind"]["update"] > 2 * weights_bytes // 8
    windows = summary["windows_certified"]
    assert summary["update_bytes_per_window"] == (
        summary["bytes_per_trainer_sent_by_kind"]["update"] // windows
    )
    assert 0 < summary["gossip_bytes_per_window"] < sent + received
    assert summary["ddp_bytes_formula"].startswith("ring all-reduce")
    assert 0 < summary["compute_utilisation"] <= 1
    # the loss curve: genesis, then every certified window, later and dearer than the last
    curve = summary["val_loss_curve"]
    assert [point["height"] for point in curve][:4] == [0, 1, 2, 3]
    assert curve[0]["val_loss"] == summary["genesis_val_loss"]
    if curve[-1]["height"] == summary["windows_certified"]:  # the seed may certify one more
        assert curve[-1]["val_loss"] == summary["val_loss"]
    for before, after in itertools.pairwise(curve):
        assert after["seconds"] > before["seconds"]
    # (None: a trainer had not written its status yet when the window was certified)
    spent = [p["bytes_per_trainer"] for p in curve if p["bytes_per_trainer"] is not None]
    assert spent == sorted(spent)
    assert len(spent) >= 2  # genesis and a window at least
    assert spent[-1] <= summary["bytes_per_trainer"]
    # ... drawn beside the export
    png = Path(summary["loss_png"])
    assert png.parent == Path(summary["checkpoint"]).parent
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # each node's roles, peak memory and (a reducer or validator's) last reduction
    nodes = summary["nodes"]
    assert set(nodes) == {"seed", "reducer", "validator-0", "validator-1", "validator-2",
                          "trainer-0", "trainer-1"}  # fmt: skip
    for name, node in nodes.items():
        assert node["roles"] and node["peak_rss_mib"] > 0, name
        assert 0 < node["rss_after_imports_mib"] <= node["peak_rss_mib"], name
        if not {"reducer", "validator"} & set(node["roles"]):
            assert node["reduction_seconds"] is node["reduction_window"] is None, name
        elif node["reduction_seconds"] is not None:
            assert node["reduction_seconds"] > 0, name
            assert 1 <= node["reduction_window"] <= summary["windows_certified"] + 1, name
    assert any(node["reduction_seconds"] for node in nodes.values())  # somebody reduced
    for trainer in ("trainer-0", "trainer-1"):
        status = json.loads((tmp_path / "demo" / trainer / "status.json").read_text())
        statistics = status["role_states"][0]["statistics"]
        assert statistics["aggregates_applied"] >= 2
        assert statistics["aggregate_mismatches"] == 0
        assert 0 < status["trainer"]["compute_utilisation"] <= 1
