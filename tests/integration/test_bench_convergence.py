"""``p2ptrain bench convergence`` on a tiny task: DDP and our network as real processes, on
loopback with each system's own byte counters, and (as root) each process in its own network
namespace on shaped links, bytes read from the interfaces. hivemind, when it is not
installed, is left out with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.bench.chaos_network import TINY_WORKLOAD
from p2ptrain.bench.convergence import ConvergenceSettings, run_convergence
from p2ptrain.bench.convergence_task import Task, build_workload
from p2ptrain.bench.netns_lab import namespaces_unavailable
from p2ptrain.torch.baseline import ddp_bytes_per_worker

TINY = dict(TINY_WORKLOAD)
TASK = Task(workers=2, windows=2, inner_steps=5, config=TINY)


def _parameters() -> int:
    """The task's parameter count (built when a test runs, not at collection: building the
    workload costs every worker seconds)."""
    return sum(w.numel() for w in build_workload(TASK).initial_weights().values())


def _run(tmp_path: Path, *, netns: bool, until_target: bool = False) -> dict[str, Any]:
    settings = ConvergenceSettings(
        task=TASK,
        link_mbit=100.0,
        netns=netns,
        systems=("ddp", "p2ptrain", "hivemind"),
        hivemind_python=str(tmp_path / "no-such-python"),
        workdir=tmp_path / "work",
        out_dir=tmp_path / "results",
        deadline_s=30.0,
        timeout_s=240.0,
        until_target=until_target,
    )
    said: list[str] = []
    report = run_convergence(settings, say=said.append)
    assert Path(report["json"]).is_file() and Path(report["png"]).stat().st_size > 10_000
    assert json.loads(Path(report["json"]).read_text())["systems"].keys() == {"ddp", "p2ptrain"}
    assert "hivemind is absent" in report["notes"]["hivemind"]
    assert any("hivemind is absent" in line for line in said)
    for name in ("ddp", "p2ptrain"):
        figures = report["systems"][name]
        curve = figures["curve"]
        assert curve[0]["seconds"] <= 1.0  # genesis, at launch
        assert figures["final_val_loss"] < curve[0]["val_loss"]  # it learned
        assert figures["cpu_seconds"] > 0 and figures["wall_seconds"] > 0
    ddp, ours = report["systems"]["ddp"], report["systems"]["p2ptrain"]
    assert ddp["seconds_to_target"] is not None  # DDP reaches 1.02 x its own final loss
    assert report["target_val_loss"] == pytest.approx(1.02 * ddp["final_val_loss"], abs=1e-3)
    assert report["bytes_ratio_vs_ddp"] == pytest.approx(
        ddp["bytes_per_trainer"] / ours["bytes_per_trainer"], rel=1e-2
    )
    assert 0 < ours["compute_utilisation"] <= 1
    # each trainer downloaded the certified heads' aggregates (int4: half a byte a
    # parameter; the last one perhaps not before the run stopped) and no full state: it
    # built the genesis weights from the workload, as its own counters say
    by_kind = ours["bytes_per_trainer_received_by_kind"]
    assert "state" not in by_kind and by_kind["aggregate"] >= _parameters() // 2, by_kind
    assert ours["bytes_per_trainer_received"] >= sum(by_kind.values())
    return report


def test_loopback_uses_each_systems_own_counters(tmp_path: Path) -> None:
    report = _run(tmp_path, netns=False)
    assert report["netns"] is False and report["link_mbit"] is None
    ddp, ours = report["systems"]["ddp"], report["systems"]["p2ptrain"]
    assert ddp["bytes_source"] == "formula" and ours["bytes_source"] == "node counters"
    assert ddp["bytes_per_trainer_sent"] == ddp["bytes_per_trainer_received"]


@pytest.mark.netns
@pytest.mark.skipif((why := namespaces_unavailable(("ip", "tc"))) is not None, reason=f"{why}")
def test_namespaces_read_bytes_from_the_interfaces_and_run_to_target(tmp_path: Path) -> None:
    report = _run(tmp_path, netns=True, until_target=True)
    assert report["netns"] is True and report["link_mbit"] == 100.0
    ddp, ours = report["systems"]["ddp"], report["systems"]["p2ptrain"]
    # DDP ran the reference samples; ours ran to the target or the cap (twice as many)
    assert ddp["samples"] == report["samples"] and report["cap_samples"] == 2 * report["samples"]
    assert 0 < ours["samples"] <= report["cap_samples"]
    assert [p["samples"] for p in ours["curve"]] == sorted(p["samples"] for p in ours["curve"])
    if ours["seconds_to_target"] is not None:  # figures to the target, not to the end
        assert ours["samples_to_target"] <= ours["samples"]
        assert ours["bytes_per_trainer_to_target"] <= ours["bytes_per_trainer"]
        assert ours["bytes_per_trainer_to_target"] == (
            ours["bytes_per_trainer_sent_to_target"] + ours["bytes_per_trainer_received_to_target"]
        )
        assert report["bytes_to_target_ratio_vs_ddp"] is not None
    # the compute bound: the same DDP on unshaped loopback reaches its target too
    bound = report["compute_bound"]
    assert bound["seconds_to_target"] is not None and bound["samples_to_target"] > 0
    assert report["time_ratio_vs_compute_bound"] == (
        None
        if ours["seconds_to_target"] is None
        else pytest.approx(bound["seconds_to_target"] / ours["seconds_to_target"], abs=1e-3)
    )
    assert ddp["bytes_source"] == ours["bytes_source"] == "interfaces"
    # a rank's link carried at least what its all-reduces had to move, each way
    each_way = ddp_bytes_per_worker(_parameters(), TASK.steps, TASK.workers)
    assert ddp["bytes_per_trainer_sent"] > each_way
    assert ddp["bytes_per_trainer_received"] > each_way
    # all of our nodes sent at least what the trainers received from them
    assert ours["bytes_sent_all_nodes"] > TASK.workers * ours["bytes_per_trainer_received"] // 2
