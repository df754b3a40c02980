"""``p2ptrain demo --json`` reports what its trainers measured: bytes sent and received on
their connections (the kernel's count) and the share of their time spent in inner steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_demo_reports_measured_bytes_and_compute_utilisation(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "demo", "--workdir", str(tmp_path / "demo"),
         "--windows", "2", "--inner-steps", "5", "--trainers", "2", "--json", "--no-baseline"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["windows_certified"] >= 2
    weights_bytes = 4 * summary["parameters"]
    sent, received = summary["bytes_per_trainer_sent"], summary["bytes_per_trainer_received"]
    assert summary["bytes_measured"] == "tcp"
    # each trainer uploaded two int8 updates (a quarter of the fp32 weights, each) ...
    assert sent > 2 * weights_bytes // 4
    # ... and downloaded each new head's fp32 weights
    assert received > 2 * weights_bytes
    assert summary["bytes_per_trainer"] == sent + received
    assert summary["ddp_bytes_formula"].startswith("ring all-reduce")
    assert 0 < summary["compute_utilisation"] <= 1
