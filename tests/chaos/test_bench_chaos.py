"""``p2ptrain bench chaos`` end to end, kept short: one run with a shortened fault budget and
a short "long" outage and joiner (10 heights, within one catch-up page; about two minutes
on 2 cores). Its JSON has every field the issue names, the faults it played are
counted, and no store is corrupt and no replica diverged. Stalls are not asserted: whether
the network recovers in time is what the bench measures, not what this test checks. As root
the nodes run in network namespaces and the run has a partition.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.bench.netns_lab import namespaces_unavailable

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

SEED = 11
FIELDS = {
    "runs",
    "corrupt_stores",
    "lost_certified_heads",
    "diverged_replicas",
    "stalled_runs",
    "recovery_seconds_p50",
    "recovery_seconds_p99",
    "catch_up_seconds_p50",
    "not_caught_up",
    "faults",
    "failing_seeds",
    "netns",
    "partitions_skipped",
    "details",
}


@pytest.mark.timeout(420)
def test_one_short_chaos_run_reports_sound_stores(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "p2ptrain", "bench", "chaos", "--runs", "1",
               "--seed", str(SEED), "--duration-s", "8", "--long-every", "1",
               "--outage-heights", "10", "--json", "--workdir", str(tmp_path)]  # fmt: skip
    print(f"seed {SEED}: {' '.join(command)}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, check=False)
    print(done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    print(json.dumps({k: v for k, v in summary.items() if k != "details"}, sort_keys=True))
    assert set(summary) >= FIELDS, sorted(FIELDS - set(summary))
    assert summary["runs"] == 1
    assert summary["netns"] is (namespaces_unavailable() is None)
    kinds = {"kill", "pause", "outage", "join"} | ({"partition"} if summary["netns"] else set())
    if not summary["netns"]:
        assert summary["partitions_skipped"]
        assert summary["faults"]["partition"] == 0
    (run,) = summary["details"]
    assert run["seed"] == SEED
    assert run["error"] is None, "\n".join(run["diagnoses"])
    played = {kind for kind, n in summary["faults"].items() if n}
    if summary["unrecovered_faults"] == 0:  # else the faults after it were not played
        assert sum(summary["faults"].values()) >= 2
        assert played == kinds
    assert played <= kinds
    assert summary["corrupt_stores"] == 0, run["corrupt_stores"]
    assert summary["diverged_replicas"] == 0, run["diverged"]
    assert set(summary["failing_seeds"]) <= {SEED}
    assert (SEED in summary["failing_seeds"]) is run["failed"]
    assert min(run["heights"].values()) >= 1, run["heights"]
    for fault in run["faults"]:
        if fault["kind"] in ("outage", "join"):
            assert fault["behind"] is not None, fault
            assert (fault["rejoin_s"] is None) is fault["stalled"], fault
    if summary["faults"]["join"]:
        assert "viewer-joiner" in run["heights"]
