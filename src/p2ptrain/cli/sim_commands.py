"""``p2ptrain sim``: run the deterministic network simulator on the real protocol."""

from __future__ import annotations

import argparse
import json
from typing import Any

from p2ptrain.cli.commands import add_command
from p2ptrain.errors import LocalError


def _codec_config(text: str) -> tuple[tuple[str, int | float], ...]:
    try:
        settings = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--codec-config {text!r}: not JSON ({error})") from None
    if not isinstance(settings, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in settings.values()
    ):
        raise argparse.ArgumentTypeError(
            f"--codec-config {text!r}: expected an object of numbers, e.g. "
            '\'{"fraction": 0.02, "dense_windows": 2}\''
        )
    return tuple(sorted(settings.items()))


def _crash(text: str) -> Any:
    from p2ptrain.sim.scenario import Crash

    try:
        node, _, times = text.partition("@")
        down, _, up = times.partition(":")
        return Crash(node, float(down), float(up) if up else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--crash {text!r}: expected NODE@DOWN_S or NODE@DOWN_S:RESTART_S, e.g. v0@30:90"
        ) from None


def _partition(text: str) -> Any:
    from p2ptrain.sim.scenario import Partitioned

    try:
        start, end, nodes = text.split(":", 2)
        return Partitioned(float(start), float(end), tuple(n for n in nodes.split(",") if n))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--partition {text!r}: expected START_S:END_S:NODE,NODE,... e.g. 10:70:v0,v1,t0"
        ) from None


def _slow(text: str) -> Any:
    from p2ptrain.sim.scenario import SlowLink

    try:
        node, _, rate = text.partition(":")
        return SlowLink(node, float(rate))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--slow {text!r}: expected NODE:BYTES_PER_S, e.g. t3:100000"
        ) from None


def add_parsers(commands: Any, data_dir: str) -> None:
    from p2ptrain.sim.scenario import ADVERSARIES

    sim = add_command(
        commands,
        "sim",
        description="Run trainers, reducers and validators on a virtual network with the real "
        "protocol, aggregation and signatures; check the safety invariants; report per window. "
        "Nodes are named t0.. (trainers), v0.. (validators), r0.. (reducers), x-* (adversaries).",
    )
    sim.add_argument("--trainers", type=int, required=True)
    sim.add_argument("--validators", type=int, required=True)
    sim.add_argument("--quorum", type=int, required=True)
    sim.add_argument("--reducers", type=int, default=1, help="honest reducers (default 1)")
    sim.add_argument("--windows", type=int, required=True)
    sim.add_argument("--workload", choices=["synthetic", "digits"], default="synthetic")
    sim.add_argument("--byzantine", type=int, default=0, help="Byzantine trainers (t0..)")
    sim.add_argument(
        "--attack",
        default="sign_flip",
        metavar="NAME",
        help="what the Byzantine trainers send (default sign_flip; an unknown name lists the "
        "attacks of p2ptrain.sim.attacks)",
    )
    sim.add_argument("--rule", default="trimmed_mean", help="aggregation rule")
    sim.add_argument("--codec", default="fp16", help="update codec")
    sim.add_argument(
        "--codec-config", type=_codec_config, default=(), metavar="JSON",
        help='the codec\'s settings, e.g. \'{"fraction": 0.02, "dense_windows": 2}\'',
    )  # fmt: skip
    sim.add_argument(
        "--aggregate-precision", default="fp32", metavar="P",
        help="aggregation.precision: fp32, bf16, int8, int4 or int2",
    )  # fmt: skip
    sim.add_argument(
        "--outer", choices=("nesterov", "sgd"), default="nesterov",
        help="the outer step: nesterov 0.7/0.9 (default) or sgd at lr 1 (for sparseloco)",
    )  # fmt: skip
    sim.add_argument(
        "--adversary", action="append", default=[], choices=ADVERSARIES,
        help="add an adversary (repeatable)",
    )  # fmt: skip
    sim.add_argument("--silent-validators", type=int, default=0)
    sim.add_argument("--crash", action="append", type=_crash, default=[], metavar="NODE@S[:S]")
    sim.add_argument(
        "--partition", action="append", type=_partition, default=[], metavar="S:S:NODES"
    )
    sim.add_argument("--slow", action="append", type=_slow, default=[], metavar="NODE:BYTES_S")
    sim.add_argument("--loss", type=float, default=0.0, help="message loss probability")
    sim.add_argument("--allow-minority-quorum", action="store_true")
    sim.add_argument("--seed", type=int, required=True)
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.set_defaults(handler=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    from p2ptrain.sim.run import simulate
    from p2ptrain.sim.scenario import Scenario

    scenario = Scenario(
        trainers=args.trainers, validators=args.validators, quorum=args.quorum,
        windows=args.windows, seed=args.seed, reducers=args.reducers, workload=args.workload,
        byzantine=args.byzantine, attack=args.attack, rule=args.rule, codec=args.codec,
        codec_config=args.codec_config, precision=args.aggregate_precision, outer=args.outer,
        adversaries=tuple(args.adversary), silent_validators=args.silent_validators,
        crashes=tuple(args.crash), partitions=tuple(args.partition), slow=tuple(args.slow),
        loss=args.loss, allow_minority_quorum=args.allow_minority_quorum,
    )  # fmt: skip
    report = simulate(scenario)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for window in report["windows"]:
            state = "certified" if window["certified"] else "FAILED"
            print(f"window {window['window']:4d}  {state:9s}  {window['reason']}")
        print(
            f"{report['windows_certified']} of {scenario.windows} windows certified, "
            f"{report['safety_violations']} safety violations, final loss "
            f"{report['final_loss']}, {report['messages_per_peer_per_window']:.1f} messages "
            f"per peer per window, {report['wall_seconds']:.1f} s"
        )
        for violation in report["violations"]:
            print(f"VIOLATION: {violation}")
    if report["safety_violations"]:
        return 3
    if report["windows_certified"] < scenario.windows:
        raise LocalError(
            f"only {report['windows_certified']} of {scenario.windows} windows certified; "
            "see each window's reason above (--json for details)"
        )
    return 0
