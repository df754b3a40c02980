"""``p2ptrain bench ...``: benchmarks that report ratios against a same-run baseline."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from p2ptrain.cli.bench_roles import add_roles_memory
from p2ptrain.cli.commands import add_command
from p2ptrain.cli.usage import show_usage


def add_parsers(commands: Any, data_dir: str) -> None:
    bench = add_command(commands, "bench")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    store = sub.add_parser(
        "store",
        help="blob store and safetensors codec throughput against plain file I/O",
        description="Put/get a blob and encode/decode a state dict, each as a throughput "
        "ratio to plain file write (+fsync) / read of the same bytes in the same run.",
    )
    store.add_argument("--size-mb", type=int, default=100, help="payload size (default 100)")
    store.add_argument("--repeats", type=int, default=5, help="best of N (default 5)")
    store.add_argument("--workdir", help="directory for temporary files (default: system temp)")
    store.add_argument("--json", action="store_true", help="print one JSON object")
    store.set_defaults(handler=run_store)

    byzantine = sub.add_parser(
        "byzantine",
        help="accuracy of every aggregation rule under Byzantine attacks (digits MLP, DiLoCo)",
        description="Train a digits MLP with 10 DiLoCo workers, some of them Byzantine, under "
        "every aggregation rule and attack; write JSON and a heatmap PNG to --out-dir.",
    )
    byzantine.add_argument("--rounds", type=int, default=30, help="outer rounds (default 30)")
    byzantine.add_argument(
        "--inner-steps", type=int, default=20, help="H, local steps per round (default 20)"
    )
    byzantine.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    byzantine.add_argument(
        "--out-dir", default="bench/results", help="where to write byzantine.json/.png"
    )
    byzantine.add_argument("--json", action="store_true", help="print one JSON object")
    byzantine.set_defaults(handler=run_byzantine)

    aggregate = sub.add_parser(
        "aggregate",
        help="aggregation rule time against memcpy, and codec throughput/compression",
        description="Each rule on 8 updates of --values float32 values, timed as a ratio to a "
        "memcpy of the same bytes in the same run; each codec's encode/decode throughput and "
        "compression ratio.",
    )
    aggregate.add_argument("--updates", type=int, default=8, help="updates (default 8)")
    aggregate.add_argument(
        "--values", type=int, default=25_000_000, help="float32 values per update (default 25M)"
    )
    aggregate.add_argument("--repeats", type=int, default=3, help="best of N (default 3)")
    aggregate.add_argument("--json", action="store_true", help="print one JSON object")
    aggregate.set_defaults(handler=run_aggregate)

    _add_data(sub)
    _add_systems(sub)

    transfer = sub.add_parser(
        "transfer",
        help="blob download speed against plain aiohttp, and gossip latency",
        description="Download one blob over loopback with a plain aiohttp client from a plain "
        "aiohttp server (the baseline), and with the blob fetcher from one and from three "
        "p2ptrain providers; report MB/s and ratios to the baseline (best of --repeats). Then "
        "measure gossip delivery delays across --gossip-nodes nodes. Writes transfer.json to "
        "--out-dir.",
    )
    transfer.add_argument("--mib", type=int, default=256, help="blob size in MiB (default 256)")
    transfer.add_argument("--repeats", type=int, default=5, help="best of N (default 5)")
    transfer.add_argument("--gossip-nodes", type=int, default=16, help="nodes (default 16)")
    transfer.add_argument(
        "--gossip-messages", type=int, default=200, help="messages published (default 200)"
    )
    transfer.add_argument(
        "--gossip-processes", type=int, default=4, help="processes hosting the nodes (default 4)"
    )
    transfer.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    transfer.add_argument("--workdir", help="directory for temporary files (default: system temp)")
    transfer.add_argument("--out-dir", default="bench/results", help="where to write transfer.json")
    transfer.add_argument("--json", action="store_true", help="print one JSON object")
    transfer.set_defaults(handler=run_transfer)

    chaos = sub.add_parser(
        "chaos",
        help="seeded kills, pauses, partitions, long outages and late joiners of a real local "
        "network: corrupt stores, lost heads, divergence, stalls, recovery seconds",
        description="Run --runs seeded runs of a local network (a seed, a reducer, 3 "
        "validators with quorum 2, 2 trainers; each node in its own network namespace when "
        "run as root) under random SIGKILLs and restarts, SIGSTOP pauses and partitions; "
        "runs whose seed is a multiple of --long-every also keep a node down for more than "
        "--outage-heights heights and start a fresh viewer once the chain is that long, and "
        "both must reach the network's tip within 30 s. Compare every node's stored chain "
        "and weights at the end and time each recovery. "
        "Run r plays the faults of seed --seed + r: --runs 1 --seed X replays it.",
    )
    chaos.add_argument("--runs", type=int, default=10, help="runs, one after the other (10)")
    chaos.add_argument("--seed", type=int, default=0, help="seed of the first run (default 0)")
    chaos.add_argument(
        "--duration-s",
        type=float,
        default=50.0,
        help="planned fault time per run, quiet gaps and holds (default 50; a run takes "
        "about a minute more: start, recoveries, stop)",
    )
    chaos.add_argument(
        "--deadline-s", type=float, default=10.0, help="window deadline (default 10)"
    )
    chaos.add_argument("--proposal-s", type=float, default=3.0, help="proposal wait (default 3)")
    chaos.add_argument(
        "--long-every",
        type=int,
        default=5,
        help="runs whose seed is a multiple of this play a long outage and a late joiner "
        "(default 5: two runs in ten; 1: every run; 0: none)",
    )
    chaos.add_argument(
        "--outage-heights",
        type=int,
        default=300,
        help="a long outage lasts, and the joiner waits for, more than this many certified "
        "heights (default 300: over one 256-link catch-up page; 0: neither). A validator is "
        "the outage's victim, or with --deadline-s 1 or less a trainer too",
    )
    chaos.add_argument(
        "--no-netns",
        dest="netns",
        action="store_false",
        help="run on loopback without partitions even as root",
    )
    chaos.add_argument(
        "--workdir", help="where runs keep data directories and logs (default: a temp dir)"
    )
    chaos.add_argument(
        "--keep-passing", action="store_true", help="keep passing runs' directories too"
    )
    chaos.add_argument(
        "--node-debug", action="store_true", help="run the nodes with -v (debug logs)"
    )
    chaos.add_argument("--json", action="store_true", help="print one JSON object")
    chaos.set_defaults(handler=run_chaos)

    _add_memory(sub)
    bench.set_defaults(handler=lambda _args: show_usage(bench))


def _add_memory(sub: Any) -> None:
    _add_trainer_memory(sub)
    add_roles_memory(sub)


def _add_trainer_memory(sub: Any) -> None:
    reduce = sub.add_parser(
        "reduce",
        help="one window's reduction as a validator runs it, against a plain read of its bytes",
        description="Put --updates synthetic updates of a --params-parameter model, encoded "
        "with --codec, into a real blob store; then, in a fresh process, reduce them as a "
        "validator does (read, admit, decode, screen, aggregate with --rule, step, encode and "
        "hash the new state). Report the seconds, ms per million parameters per update, the "
        "peak RSS growth over the RSS after imports, the model's fp32 size, and the time of a "
        "plain read of the cohort's encoded bytes in the same run (the memory-bandwidth "
        "floor) with the ratio to it.",
    )
    reduce.add_argument("--params", type=int, required=True, help="model parameters")
    reduce.add_argument("--updates", type=int, required=True, help="updates in the cohort")
    reduce.add_argument("--rule", default="trimmed_mean", help="aggregation rule (trimmed_mean)")
    reduce.add_argument("--codec", default="int8", help="update codec (int8)")
    reduce.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads for the reduction (default: this machine's cores, as a validator uses)",
    )
    reduce.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    reduce.add_argument("--json", action="store_true", help="print one JSON object")
    reduce.set_defaults(handler=run_reduce)

    memory = sub.add_parser(
        "trainer-memory",
        help="a trainer's peak RSS training a GPT-2 against a plain training loop",
        description="Train a GPT-2 built from a config (about 57M parameters by default) for "
        "--steps steps twice, each in a fresh process: in a plain loop (AdamW, forward, "
        "backward, clip, step: the baseline) and as a trainer's window (the workload's inner "
        "steps, the update encoded with --codec, the optimizer state saved). Report both peak "
        "RSS figures and their ratio; the trainer passes at a ratio of 2 or less.",
    )
    memory.add_argument("--layers", type=int, default=8, help="GPT-2 n_layer (default 8)")
    memory.add_argument("--width", type=int, default=768, help="GPT-2 n_embd (default 768)")
    memory.add_argument("--heads", type=int, default=12, help="GPT-2 n_head (default 12)")
    memory.add_argument(
        "--block-size", type=int, default=128, help="tokens per row, n_positions (default 128)"
    )
    memory.add_argument("--batch-size", type=int, default=8, help="rows per step (default 8)")
    memory.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    memory.add_argument("--codec", default="int8", help="the trainer's update codec (int8)")
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    memory.set_defaults(handler=run_trainer_memory)


def _add_systems(sub: Any) -> None:
    """The benchmarks of whole systems: the network against DDP and hivemind, and pods."""
    _add_convergence(sub)
    _add_pods(sub)


def _add_pods(sub: Any) -> None:
    pods = sub.add_parser(
        "pods",
        help="pods and home clusters on torch.distributed: scaling, gradient sync, re-forming",
        description="Samples/s of one trainer as a pod of 1 and 2 CPU ranks and the scaling "
        "efficiency; the cluster's gradient-sync throughput (fp32 bytes per second through "
        "its compression hook) against a raw gloo all-reduce of the same tensors, on loopback "
        "and (root) on links shaped to --link-mbit in network namespaces; the seconds from "
        "a cluster member's or the leader's SIGKILL to the next completed step.",
    )
    pods.add_argument("--windows", type=int, default=3, help="timed pod windows (default 3)")
    pods.add_argument("--steps", type=int, default=20, help="inner steps a window (default 20)")
    pods.add_argument(
        "--sync-params",
        type=int,
        default=10_000_000,
        help="fp32 gradient values synchronised (default 10,000,000)",
    )
    pods.add_argument("--repeats", type=int, default=5, help="timed syncs (default 5)")
    pods.add_argument(
        "--link-mbit", type=float, default=100.0, help="shaped link rate (default 100)"
    )
    pods.add_argument(
        "--no-reform", dest="reform", action="store_false", help="skip the re-forming figures"
    )
    pods.add_argument("--workdir", help="directory for temporary files (default: system temp)")
    pods.add_argument("--json", action="store_true", help="print one JSON object")
    pods.set_defaults(handler=run_pods)


def run_pods(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2ptrain.bench.pods import run_pods_bench

    result = run_pods_bench(
        windows=args.windows,
        steps=args.steps,
        sync_params=args.sync_params,
        repeats=args.repeats,
        link_mbit=args.link_mbit,
        reform=args.reform,
        workdir=None if args.workdir is None else Path(args.workdir),
    )
    _emit(result, args.json)
    return 0


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(json.dumps(result, sort_keys=True, indent=2))


def _add_data(sub: Any) -> None:
    data = sub.add_parser(
        "data",
        help="a trainer's time to its first inner step on a prepared dataset held by the seed",
        description="Prepare --size-mb of token rows into shards, let a seed serve them, and "
        "time a trainer that holds no data from its start to its first inner step (cold), "
        "then the same trainer again with the shards on its disk (warm, the baseline); "
        "report both and cold / warm.",
    )
    data.add_argument("--size-mb", type=int, default=1024, help="dataset size (default 1024)")
    data.add_argument("--shard-mb", type=int, default=16, help="shard size (default 16)")
    data.add_argument("--seed", type=int, default=0, help="seed of the token rows (default 0)")
    data.add_argument("--workdir", help="directory for temporary files (default: system temp)")
    data.add_argument("--json", action="store_true", help="print one JSON object")
    data.set_defaults(handler=run_data)


#: ``bench convergence --until-target``'s task when the options leave it out: a run long
#: enough for sparse updates (2,400 steps per worker, DDP's reference), in windows of 50
#: steps, and our network on the sparse recipe at 8% (docs/benchmarks.md: a tenth fewer bytes
#: to the target than windows of 25 steps at 3%, in as few seconds).
TO_TARGET: dict[str, Any] = {"windows": 48, "inner_steps": 50, "sparse": 0.08}


def _add_convergence(sub: Any) -> None:
    from p2ptrain.torch.demo_settings import DEMO_DEFAULTS  # the task's defaults (no torch)

    trainers, windows = int(DEMO_DEFAULTS["trainers"]), int(DEMO_DEFAULTS["windows"])
    inner_steps, staleness = int(DEMO_DEFAULTS["inner_steps"]), int(DEMO_DEFAULTS["staleness"])
    convergence = sub.add_parser(
        "convergence",
        help="real DDP, hivemind and our network on one task, on shaped links: loss against "
        "time and bytes",
        description="Train the demo's task with torch.distributed DDP (gloo), our network and "
        "hivemind (when `make bench-anchors` installed it), the same samples each, as real "
        "processes. As root every process gets its own network namespace with its link "
        "shaped to --link-mbit both ways, and bytes are read from the interfaces; otherwise "
        "everything runs on loopback and says so. Writes JSON and a PNG under --out-dir.",
    )
    convergence.add_argument(
        "--link-mbit",
        default="50",
        help="each link's rate in Mbit/s; several, comma-separated (e.g. 10,50), run the "
        "systems at each rate in turn (default 50)",
    )
    convergence.add_argument(
        "--until-target",
        action="store_true",
        help="DDP runs the reference samples (--windows x --inner-steps), and its final loss "
        "x 1.02 is the target; our network and hivemind then train until they reach it or "
        "the cap (--cap-factor), and, on shaped links, DDP runs again on unshaped loopback "
        "(the compute bound). The task defaults to a longer run than the demo's and our "
        "network to the sparse recipe: "
        f"{TO_TARGET['windows']} windows of {TO_TARGET['inner_steps']} steps, --sparse "
        f"{TO_TARGET['sparse']}",
    )
    convergence.add_argument(
        "--cap-factor",
        type=float,
        default=2.0,
        help="with --until-target: the most samples a system may take, as a multiple of "
        "the reference samples (default 2)",
    )
    convergence.add_argument(
        "--trainers",
        type=int,
        default=trainers,
        help=f"workers of each system (default {trainers})",
    )
    long_windows, long_steps = TO_TARGET["windows"], TO_TARGET["inner_steps"]
    convergence.add_argument(
        "--windows",
        type=int,
        help=f"windows (default {windows}; with --until-target {long_windows})",
    )
    convergence.add_argument(
        "--inner-steps",
        type=int,
        help=f"steps per window; DDP runs windows x this many (default {inner_steps}; with "
        f"--until-target {long_steps})",
    )
    convergence.add_argument(
        "--staleness",
        type=int,
        default=staleness,
        help="our network's window.staleness: 1 trains the next window while one is "
        f"certified (default {staleness})",
    )
    convergence.add_argument(
        "--sparse",
        type=float,
        metavar="FRACTION",
        help="our network sends sparse updates of this fraction of each tensor, SparseLoCo's "
        "recipe (sparseloco after a dense warm-up of about 100 steps, contributor_mean, outer "
        "SGD at lr 1, int4 aggregates); 0 sends the demo's dense int4 (default 0; with "
        f"--until-target {TO_TARGET['sparse']})",
    )
    convergence.add_argument(
        "--systems",
        default="ddp,p2ptrain,hivemind",
        help="which to run, comma-separated (default ddp,p2ptrain,hivemind)",
    )
    convergence.add_argument("--no-netns", action="store_true", help="run on loopback even as root")
    convergence.add_argument(
        "--hivemind-python",
        help="the interpreter with hivemind (default: $P2PTRAIN_HIVEMIND_PYTHON, else "
        ".venv-anchors/bin/python)",
    )
    convergence.add_argument(
        "--workdir",
        default="p2ptrain-bench-convergence",
        help="where the processes keep their files (each system's folder is wiped)",
    )
    convergence.add_argument(
        "--out-dir", default="bench/results", help="where to write the JSON and the PNG"
    )
    convergence.add_argument("--json", action="store_true", help="print one JSON object")
    convergence.set_defaults(handler=run_convergence_bench)


def run_convergence_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2ptrain.bench.convergence import ConvergenceSettings, run_convergence_links
    from p2ptrain.bench.convergence_task import Task
    from p2ptrain.core.manifests import MAX_STALENESS
    from p2ptrain.errors import LocalError

    links = _link_rates(args.link_mbit)
    _task_defaults(args)
    if args.trainers < 2 or args.windows < 1 or args.inner_steps < 1:
        raise LocalError("--trainers >= 2, --windows >= 1 and --inner-steps >= 1, please")
    if not 1.0 <= args.cap_factor <= 20.0:
        raise LocalError(f"--cap-factor must be 1 to 20, got {args.cap_factor}")
    if not 0 <= args.staleness <= MAX_STALENESS:
        raise LocalError(f"--staleness must be 0 to {MAX_STALENESS}, got {args.staleness}")
    if not 0.0 <= args.sparse <= 0.5:
        raise LocalError(f"--sparse must be a fraction from 0 (dense) to 0.5, got {args.sparse}")
    settings = ConvergenceSettings(
        task=Task(
            workers=args.trainers,
            windows=args.windows,
            inner_steps=args.inner_steps,
            staleness=args.staleness,
            sparse=args.sparse,
        ),
        link_mbit=links[0],
        netns=not args.no_netns,
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        hivemind_python=args.hivemind_python,
        workdir=Path(args.workdir).resolve(),
        out_dir=Path(args.out_dir),
        until_target=args.until_target,
        cap_factor=args.cap_factor,
    )
    report = run_convergence_links(settings, links, say=lambda line: print(line, file=sys.stderr))
    for run in report.get("runs", [report]):
        where = f"{run['link_mbit']} Mbit/s" if run["netns"] else "loopback"
        for name, figures in run["systems"].items():
            print(
                f"{where}, {name}: final val loss {figures['final_val_loss']}; to target "
                f"{figures['seconds_to_target']} s, {figures['samples_to_target']} samples, "
                f"{figures['bytes_per_trainer_to_target']} bytes per trainer "
                f"({figures['bytes_source']})",
                file=sys.stderr,
            )
        print(f"results: {run['json']} and {run['png']}", file=sys.stderr)
    _emit(report, args.json)
    return 0


def _task_defaults(args: argparse.Namespace) -> None:
    """Fill in ``bench convergence``'s task options left out: the demo's task, or with
    ``--until-target`` :data:`TO_TARGET`."""
    from p2ptrain.torch.demo_settings import DEMO_DEFAULTS

    if args.until_target:
        defaults = dict(TO_TARGET)
    else:
        defaults = {
            "windows": int(DEMO_DEFAULTS["windows"]),
            "inner_steps": int(DEMO_DEFAULTS["inner_steps"]),
            "sparse": 0.0,
        }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _link_rates(text: str) -> list[float]:
    """``--link-mbit``: one rate or several, comma-separated, each above 0."""
    from p2ptrain.errors import LocalError

    rates: list[float] = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = 0.0
        if not 0 < rate < math.inf:
            raise LocalError(
                f"--link-mbit {text!r}: {part.strip()!r} is not a rate above 0 Mbit/s; give "
                "one or several, comma-separated, e.g. 10,50"
            )
        rates.append(rate)
    return rates


def run_byzantine(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2ptrain.bench.byzantine import ByzantineConfig, run_byzantine_benchmark, write_heatmap

    config = ByzantineConfig(rounds=args.rounds, inner_steps=args.inner_steps, seed=args.seed)

    def progress(done: int, total: int, row: dict[str, Any]) -> None:
        print(
            f"[{done}/{total}] {row['rule']:>16} {row['attack']:>10} f={row['byzantine']} "
            f"accuracy {row['accuracy']:.3f}",
            file=sys.stderr,
        )

    report = run_byzantine_benchmark(config, progress=progress)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    heatmap = out_dir / "byzantine.png"
    write_heatmap(report, heatmap, config.byzantine)
    report["heatmap"] = str(heatmap)
    (out_dir / "byzantine.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    _emit(report, args.json)
    return 0


def run_aggregate(args: argparse.Namespace) -> int:
    from p2ptrain.bench.aggregate_rules import measure_rules
    from p2ptrain.bench.codecs import measure_codecs

    result: dict[str, Any] = dict(
        measure_rules(n_updates=args.updates, values=args.values, repeats=args.repeats)
    )
    result["codecs"] = measure_codecs(values=args.values, repeats=args.repeats)
    result["updates"] = args.updates
    result["values_per_update"] = args.values
    _emit(result, args.json)
    return 0


def run_store(args: argparse.Namespace) -> int:
    from p2ptrain.bench.store import run_store_bench

    result = run_store_bench(
        size_bytes=args.size_mb * 1024 * 1024, repeats=args.repeats, workdir=args.workdir
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key in sorted(result):
            print(f"{key:40s} {result[key]}")
    return 0


def run_transfer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from p2ptrain.bench.transfer import run_transfer_bench

    result = run_transfer_bench(
        mib=args.mib,
        repeats=args.repeats,
        gossip_nodes=args.gossip_nodes,
        gossip_messages=args.gossip_messages,
        gossip_processes=args.gossip_processes,
        seed=args.seed,
        workdir=args.workdir,
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "transfer.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    _emit(result, args.json)
    return 0


def run_chaos(args: argparse.Namespace) -> int:
    from p2ptrain.bench.chaos import ChaosConfig, run_chaos_bench
    from p2ptrain.bench.chaos_report import summary_lines

    config = ChaosConfig(
        runs=args.runs,
        seed=args.seed,
        duration_s=args.duration_s,
        deadline_s=args.deadline_s,
        proposal_s=args.proposal_s,
        netns=args.netns,
        workdir=args.workdir,
        keep_passing=args.keep_passing,
        debug_logs=args.node_debug,
        long_every=args.long_every,
        outage_heights=args.outage_heights,
    )
    result = run_chaos_bench(config, progress=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print("\n".join(summary_lines(result)))
    return 0


def run_reduce(args: argparse.Namespace) -> int:
    from p2ptrain.bench.reduce import ReduceBenchConfig, run_reduce_bench

    config = ReduceBenchConfig(
        params=args.params,
        updates=args.updates,
        rule=args.rule,
        codec=args.codec,
        threads=args.threads,
        seed=args.seed,
    )
    result = run_reduce_bench(config)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"model                {config.params:,} parameters, {result['model_fp32_mib']} MiB fp32")
    print(f"cohort               {config.updates} x {config.codec}, "
          f"{result['cohort_encoded_mib']} MiB encoded")  # fmt: skip
    print(f"reduction            {result['reduction_seconds']} s, "
          f"{result['ms_per_mparam_per_update']} ms per M parameters per update")  # fmt: skip
    print(f"plain read (floor)   {result['floor_seconds']} s: reduction / floor = "
          f"{result['ratio_to_floor']} (target <= {result['max_ratio_to_floor']})")  # fmt: skip
    growth, budget = result["peak_rss_growth_mib"], result["growth_budget_mib"]
    print(f"peak RSS growth      {growth} MiB = {result['growth_over_model']} x the model "
          f"(budget {budget} MiB)")  # fmt: skip
    return 0


def run_trainer_memory(args: argparse.Namespace) -> int:
    from p2ptrain.bench.trainer_memory import MemoryBenchConfig, run_trainer_memory_bench

    config = MemoryBenchConfig(
        n_layer=args.layers,
        n_embd=args.width,
        n_head=args.heads,
        block_size=args.block_size,
        batch_size=args.batch_size,
        steps=args.steps,
        codec=args.codec,
    )
    result = run_trainer_memory_bench(config)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    verdict = "pass" if result["passed"] else "FAIL"
    print(f"GPT-2 parameters        {result['parameters']:,}")
    print(f"baseline peak RSS       {result['baseline_peak_rss_mib']:.1f} MiB (plain loop)")
    print(f"trainer peak RSS        {result['trainer_peak_rss_mib']:.1f} MiB (one window)")
    print(f"ratio trainer/baseline  {result['ratio']:.3f} ({verdict}: <= {result['max_ratio']})")
    print(
        f"steps/s                 baseline {result['baseline_steps_per_s']:.3f}, "
        f"trainer {result['trainer_steps_per_s']:.3f} (whole window)"
    )
    return 0


def run_data(args: argparse.Namespace) -> int:
    from p2ptrain.bench.data_start import run_data_bench

    result = run_data_bench(
        size_mb=args.size_mb, shard_mb=args.shard_mb, seed=args.seed, workdir=args.workdir
    )
    if args.json:
        print(json.dumps(result))
        return 0
    cold, warm = result["cold"], result["warm"]
    print(
        f"dataset: {result['dataset_bytes'] / (1 << 30):.2f} GiB in {result['shards']} shards "
        f"(prepared in {result['prepare_seconds']} s; the seed was ready in "
        f"{result['seed_ready_seconds']} s)"
    )
    print(
        f"cold start (no data): {cold['seconds']} s to the first inner step, "
        f"{cold['shards_fetched']} shard(s), {cold['bytes_fetched'] / (1 << 20):.1f} MiB fetched"
    )
    print(f"warm start (shards on disk): {warm['seconds']} s")
    print(f"cold / warm: {result['ratio']}")
    return 0
