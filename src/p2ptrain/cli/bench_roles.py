"""``p2ptrain bench roles-memory``: the parser and the report (the network is
:mod:`p2ptrain.bench.roles_memory`'s)."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_roles_memory"]


def add_roles_memory(sub: Any) -> None:
    memory = sub.add_parser(
        "roles-memory",
        help="the peak RSS of a trainer+validator node against a trainer's, in one network",
        description="Run a network on loopback (every node a fresh process): a seed, three "
        "nodes that each train and validate (quorum 2) and one node that only trains, on "
        "the demo's char GPT or your model (--workload, --experiment-toml, as for the "
        "demo), until every node holds --windows heads. Report each node's peak RSS, chains, "
        "outer steps and certificate checks, and the trainer+validator peak over the "
        "trainer's (it passes at 1.15 or less: the roles of a node share one copy of the "
        "model's weights and outer-optimizer state).",
    )
    memory.add_argument("--windows", type=int, default=3, help="windows to certify (default 3)")
    memory.add_argument(
        "--inner-steps", type=int, default=10, help="H, inner steps per window (default 10)"
    )
    memory.add_argument("--workload", help="your model, as for p2ptrain demo")
    memory.add_argument("--experiment-toml", help="your experiment, as for p2ptrain demo")
    memory.add_argument("--workdir", help="directory for the nodes' data (default: system temp)")
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    memory.set_defaults(handler=run_roles_memory)


def run_roles_memory(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2ptrain.bench.roles_memory import run_roles_memory_bench
    from p2ptrain.cli.demo_command import demo_workload
    from p2ptrain.cli.demo_experiment import demo_experiment, demo_toml
    from p2ptrain.errors import LocalError
    from p2ptrain.node.local_network import seconds_per_step, window_seconds
    from p2ptrain.torch.char_gpt import DEMO_AGGREGATE_PRECISION, DEMO_CODEC
    from p2ptrain.torch.registry import is_reference

    if args.windows < 1 or args.inner_steps < 1:
        raise LocalError("--windows >= 1 and --inner-steps >= 1, please")
    experiment = demo_experiment(args.workload, args.experiment_toml)
    step_s = seconds_per_step(demo_workload(experiment))
    _, deadline_s = window_seconds(step_s, args.inner_steps, trainers=4)
    defaults = {
        "study": "bench",
        "name": "roles-memory",
        "inner_steps": args.inner_steps,
        "inner_optimizer": {"name": "adamw", "lr": float(experiment.config.get("lr", 1e-3))},
        "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9},
        "aggregation": {"precision": DEMO_AGGREGATE_PRECISION},
        "codec": {"name": DEMO_CODEC},
        "window": {"deadline_s": deadline_s, "proposal_s": 10.0, "min_updates": 2},
    }
    defaults["window"]["max_updates"] = 4

    def toml(validators: list[str]) -> str:
        return demo_toml(
            experiment, validators=validators, reducers=[], quorum=2, defaults=defaults
        )

    code = ["--workload", experiment.code] if is_reference(experiment.code) else []
    result = run_roles_memory_bench(
        toml,
        windows=args.windows,
        trainer_args=code,
        workdir=None if args.workdir is None else Path(args.workdir),
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0 if result["passed"] else 1
    for name, node in result["nodes"].items():
        print(
            f"{name:10s} peak RSS {node['peak_rss_mib']:8.1f} MiB  {node['chains']} chain, "
            f"{node['heads_adopted']} heads, {node['outer_steps']} outer steps, "
            f"{node['certificate_checks']} certificate checks"
        )
    verdict = "pass" if result["passed"] else "FAIL"
    print(
        f"trainer+validator / trainer peak RSS: {result['trainer_validator_peak_rss_mib']:.1f} / "
        f"{result['trainer_peak_rss_mib']:.1f} MiB = {result['ratio']:.3f} "
        f"({verdict}: <= {result['max_ratio']}); {result['seconds']:.0f} s"
    )
    return 0 if result["passed"] else 1
