"""Run a scenario and report it (what ``p2ptrain sim --json`` prints)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from p2ptrain.sim.scenario import Scenario
from p2ptrain.sim.world import World
from p2ptrain.store.kernel_build import ensure_kernel

__all__ = ["simulate"]


def simulate(scenario: Scenario) -> dict[str, Any]:
    """Run ``scenario`` to its windows (or its time limit) and return the report."""
    ensure_kernel()
    started = time.perf_counter()
    world = World(scenario)
    world.run()
    observer = world.observer
    observer.final_check(world)
    windows = []
    for height in range(1, scenario.windows + 1):
        heads = observer.certified.get(height, {})
        if heads:
            truthful = [(i, h) for i, h in heads.items() if i not in observer.lies]
            head_id, head = (truthful or list(heads.items()))[0]
            proposal = observer.proposals.get(head_id)
            windows.append({
                "window": height,
                "certified": True,
                "head": head_id,
                "accepted": len(head.accepted),
                "rejected": len(proposal.rejected) if proposal else None,
                "quarantined": sum(1 for q in head.quarantine if q.until_window >= height + 1),
                "certified_at_s": round(observer.certified_at[height], 3),
                "reason": f"certified by a quorum of {scenario.quorum}",
            })  # fmt: skip
        else:
            reasons = Counter(
                node.machine.statistics().last_reason
                for node in world.nodes.values()
                if node.role == "validator" and node.behaviour == "honest"
            )
            reason = reasons.most_common(1)[0][0] if reasons else "no validator running"
            windows.append({"window": height, "certified": False, "reason": reason})
    honest = world.honest_nodes()
    final_loss = world.workload.loss(honest[0].machine.base.weights) if honest else None
    statistics = world.net.statistics()
    certified = sum(1 for w in windows if w["certified"])
    peers = len(world.nodes)
    report: dict[str, Any] = {
        "windows_certified": certified,
        "safety_violations": len(observer.violations),
        "violations": observer.violations[:20],
        "role_failures": world.role_failures[:20],
        "final_loss": final_loss,
        "messages_per_peer_per_window": statistics.messages_sent / peers / max(1, certified),
        "wall_seconds": time.perf_counter() - started,
        "virtual_seconds": world.sim.now,
        "windows": windows,
        "peers": peers,
        "messages": statistics.messages_sent,
        "bytes": statistics.bytes_sent,
        "rejected_messages": sum(observer.rejected_messages.values()),
        "reports": dict(observer.reports.most_common(10)),
        "equivocations_seen": max(
            (
                len(n.machine.book.equivocations)
                for n in world.nodes.values()
                if hasattr(n.machine, "book")
            ),
            default=0,
        ),
        "scenario": asdict(scenario),
    }
    accuracy = getattr(world.workload, "accuracy", None)
    if accuracy is not None and honest:
        report["final_accuracy"] = accuracy(honest[0].machine.base.weights)
    return report
