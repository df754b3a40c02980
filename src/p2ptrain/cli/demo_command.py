"""``p2ptrain demo``: a whole local network training a character-level GPT on Shakespeare.

Separate OS processes on loopback: 1 seed, 1 reducer, 3 validators (any 2 certify) and 4
trainers running DiLoCo with int8 updates and the default robust rule. When the seed has
adopted the last window, every node is stopped cleanly, the canonical model is exported,
and a baseline is trained in this process on the same samples the way synchronous data
parallel training (DDP) would: one optimizer, batch = trainers x per-trainer batch, the same
number of steps. The summary compares validation losses, and the bytes each trainer sent and
received (its TCP connections, as the kernel counted them) with what DDP's ring all-reduce
would send and receive by formula; says how much of its time each trainer spent in inner
steps (compute utilisation) rather than waiting for the network; and, from each node's last
status, its roles, its process's peak resident memory and, for the reducer and validators,
the wall seconds of its last reduction (``nodes``).

``loss.png`` beside the export draws the certified model's validation loss after each window
against the seconds since every node was ready (training started; the nodes' start-up is not
counted) and the bytes each trainer had sent and received by then (its ``status.json`` when
the seed adopted the window), with the baseline's loss after each window (at the seconds
its replay had trained for in this process, and DDP's bytes by formula). The seed keeps
every certified head (``--keep-heads``) so that each is evaluated once the nodes stopped,
not while they train.

The demo owns its nodes: it refuses a work directory where a node still runs (it would wipe
that node's data), and SIGINT, SIGTERM or SIGHUP stop every node (SIGINT, then SIGKILL for a
node that does not stop in time; a second signal SIGKILLs them at once) before it exits with
128 + the signal's number. Killed outright, the demo takes its nodes with it on Linux
(:mod:`p2ptrain.node.parent_death`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from p2ptrain.cli.commands import add_command
from p2ptrain.core.manifests import MAX_STALENESS
from p2ptrain.errors import DataDirInUse, LocalError
from p2ptrain.observe.events import (
    Exited,
    HeadAdopted,
    PeerReported,
    RoleFailure,
    Trained,
    mean_utilisation,
)

if TYPE_CHECKING:
    from p2ptrain.cli.demo_experiment import DemoExperiment
    from p2ptrain.node.local_network import LocalNetwork
    from p2ptrain.observe.status import NodeStatus

__all__ = ["add_parsers", "run_demo"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOSS_PNG = "loss.png"
#: How long the nodes get to stop cleanly once a signal stopped the demo.
SIGNAL_STOP_S = 5.0


def add_parsers(commands: Any, data_dir: str) -> None:
    from p2ptrain.torch.demo_settings import DEMO_DEFAULTS

    demo = add_command(
        commands,
        "demo",
        description="Start a seed, a reducer, 3 validators (quorum 2) and 4 trainers as "
        "separate processes on loopback, train a character-level GPT on Shakespeare with "
        "DiLoCo, then compare the certified model with a DDP-equivalent baseline.",
    )
    demo.add_argument(
        "--windows",
        type=int,
        default=int(DEMO_DEFAULTS["windows"]),
        help=f"windows to certify (default {int(DEMO_DEFAULTS['windows'])})",
    )
    demo.add_argument(
        "--inner-steps",
        type=int,
        default=int(DEMO_DEFAULTS["inner_steps"]),
        help=f"H, inner steps per window (default {int(DEMO_DEFAULTS['inner_steps'])})",
    )
    demo.add_argument(
        "--staleness",
        type=int,
        default=int(DEMO_DEFAULTS["staleness"]),
        help="window.staleness: 1 trains the next window while one is certified "
        f"(default {int(DEMO_DEFAULTS['staleness'])})",
    )
    demo.add_argument("--trainers", type=int, default=4, help="trainer processes (default 4)")
    demo.add_argument(
        "--workdir", default="p2ptrain-demo", help="where the nodes keep their data (wiped)"
    )
    demo.add_argument(
        "--workload",
        help="train your own model: path/to/file.py:factory, package.module:factory or a "
        "built-in/installed workload name (default: the char GPT)",
    )
    demo.add_argument(
        "--experiment-toml",
        help="your experiment definition (its validators, reducers and quorum are replaced "
        "by the demo's own; window settings it leaves out are sized for this machine)",
    )
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--no-baseline", action="store_true", help="skip the DDP-equivalent baseline")
    demo.set_defaults(handler=run_demo)


def demo_workload(experiment: DemoExperiment) -> Any:
    """The workload the demo trains, on the prepared shards its definition names (read from
    their directory) when it names some: a built-in workload then takes its vocabulary and
    validation split from that dataset, as every node of the demo does."""
    from p2ptrain.data.prepare import read_prepared
    from p2ptrain.node.launch import attach_shards
    from p2ptrain.torch.registry import make_workload

    if experiment.prepared is None:
        return make_workload(experiment.code, experiment.config)
    prepared = read_prepared(experiment.prepared)
    workload = make_workload(experiment.code, experiment.config, dataset=prepared.manifest)
    attach_shards(
        workload,
        prepared.manifest,
        lambda shard: prepared.shard_path(shard.name),
        str(prepared.path),
    )
    return workload


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from p2ptrain.cli.demo_experiment import demo_experiment
    from p2ptrain.node.forked import fork_launcher
    from p2ptrain.node.local_network import LocalNetwork, seconds_per_step, window_seconds
    from p2ptrain.torch.capabilities import DryRunnable

    if args.windows < 1 or args.trainers < 2 or args.inner_steps < 1:
        raise LocalError("--windows >= 1, --trainers >= 2 and --inner-steps >= 1, please")
    if not 0 <= args.staleness <= MAX_STALENESS:
        raise LocalError(f"--staleness must be 0 to {MAX_STALENESS}, got {args.staleness}")
    console = Console(stderr=True)
    workdir = Path(args.workdir).resolve()
    _wipe(workdir)
    experiment = demo_experiment(args.workload, args.experiment_toml)
    workload = demo_workload(experiment)
    if isinstance(workload, DryRunnable):
        workload.dry_run()  # a mistake in the model or data is told in words, before any run
    step_s = seconds_per_step(workload)
    # an experiment definition's own inner_steps wins over --inner-steps (demo_toml)
    given = experiment.tables.get("inner_steps")
    inner_steps = given if isinstance(given, int) and given > 0 else args.inner_steps
    train_s, deadline_s = window_seconds(step_s, inner_steps, args.trainers)
    source = " (the experiment's inner_steps)" if inner_steps != args.inner_steps else ""
    console.print(
        f"[bold]p2ptrain demo[/]: {args.trainers} trainers, 3 validators (quorum 2), 1 reducer, "
        f"1 seed; {args.windows} windows of {inner_steps} inner steps{source} "
        f"(~{train_s:.0f} s each); work dir {workdir}"
    )
    started = time.monotonic()
    network = LocalNetwork(workdir, launch=fork_launcher())
    try:
        with _stop_on_signals(network):
            return _run(
                network,
                args,
                experiment=experiment,
                console=console,
                deadline_s=deadline_s,
                started=started,
            )
    except _StopSignal as stop:
        console.print(f"stopped by {stop}")
        return 128 + stop.signum


def _run(
    network: LocalNetwork,
    args: argparse.Namespace,
    *,
    experiment: DemoExperiment,
    console: Any,
    deadline_s: float,
    started: float,
) -> int:
    from p2ptrain.cli.demo_experiment import demo_toml
    from p2ptrain.torch.char_gpt import (
        DEMO_AGGREGATE_PRECISION,
        DEMO_CODEC,
        DEMO_DEFAULTS,
        demo_inner_schedule,
    )
    from p2ptrain.torch.registry import is_reference, reference_name

    validators = [network.identity(f"validator-{i}") for i in range(3)]
    reducers = [network.identity("reducer")]
    defaults = {
        "study": "demo",
        "name": "shakespeare" if experiment.built_in_char_gpt else reference_name(experiment.code),
        "inner_steps": args.inner_steps,
        "inner_optimizer": {
            "name": "adamw",
            "lr": float(experiment.config.get("lr", 1e-3)),
            **demo_inner_schedule(args.windows),
        },
        "outer_optimizer": {
            "name": "nesterov",
            "lr": float(DEMO_DEFAULTS["outer_lr"]),
            "momentum": float(DEMO_DEFAULTS["outer_momentum"]),
        },
        "aggregation": {"precision": DEMO_AGGREGATE_PRECISION},
        "codec": {"name": DEMO_CODEC},
        "window": {
            "deadline_s": deadline_s,
            "proposal_s": 10.0,
            "min_updates": max(1, args.trainers // 2),
            "max_updates": args.trainers,
            "staleness": args.staleness,
        },
    }
    toml = demo_toml(
        experiment, validators=validators, reducers=reducers, quorum=2, defaults=defaults
    )
    path = network.write_experiment(toml)
    effective = tomllib.loads(toml)  # the user's settings may differ from the demo's
    deadline_s = float(effective["window"]["deadline_s"])
    code = ["--workload", experiment.code] if is_reference(experiment.code) else []
    trainers = [f"trainer-{i}" for i in range(args.trainers)]
    certified: list[_Certified] = []
    try:
        # the seed keeps every head the demo certifies (and one more), evaluated afterwards
        keep = ["--keep-heads", str(args.windows + 2)]
        network.start("seed", "seed", args=["--experiment-toml", str(path), *keep, *code])
        network.wait_ready(["seed"])
        # everyone at once: a reducer that opened window 1 long before the trainers could
        # train it would close it at its deadline with whoever was done by then
        network.start("reducer", "reducer")
        for i in range(3):
            network.start(f"validator-{i}", "validator")
        for name in trainers:
            network.start(name, "trainer", args=code)
        network.wait_ready([name for name in network.nodes if name != "seed"])
        console.print(f"every node is ready: {len(network.nodes)} processes")
        ready = time.monotonic()  # the loss curve's clock: training starts

        def certify(event: HeadAdopted) -> None:
            spent = _bytes_per_trainer(network.workdir, trainers)
            certified.append(
                _Certified(event.height, event.head_id, time.monotonic() - ready, spent)
            )

        trained = _follow(
            network, args.windows, console, per_window_s=deadline_s + 60, on_certified=certify
        )
    except _StopSignal as stop:
        console.print(f"{stop}: stopping every node")
        network.stop(timeout_s=SIGNAL_STOP_S)
        raise
    finally:
        network.stop()
    network_s = time.monotonic() - started
    summary = _summarise(network, trainers, args, experiment, certified, console=console)
    summary["compute_utilisation"] = mean_utilisation(trained.values())
    summary["network_seconds"] = round(network_s, 1)
    summary["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print_summary(summary, console)
    return 0 if summary["windows_certified"] >= args.windows else 1


def _wipe(workdir: Path) -> None:
    """Empty ``workdir`` for a new demo, unless a node still runs on a data directory in it."""
    from p2ptrain.store.datadir import check_not_in_use

    if workdir.is_dir():
        for path in (workdir, *workdir.iterdir()):
            try:
                check_not_in_use(path)
            except DataDirInUse as exc:
                raise LocalError(
                    f"the work dir {workdir} holds the data directory {exc.path}, in use by "
                    f"{exc.holder} (a running node); stop it or use another --workdir"
                ) from None
    try:
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
    except OSError as exc:
        raise LocalError(
            f"cannot make a fresh work dir at {workdir}: {exc.strerror}; use another --workdir"
        ) from exc


class _StopSignal(BaseException):
    """SIGINT, SIGTERM or SIGHUP asked the demo to stop (a BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals(network: LocalNetwork) -> Iterator[None]:
    """Within: the first stop signal raises :class:`_StopSignal` in the main thread (the
    demo then stops its nodes); a second one SIGKILLs the nodes at once."""

    def again(signum: int, frame: FrameType | None) -> None:
        for node in network.nodes.values():
            node.signal(signal.SIGKILL)

    def first(signum: int, frame: FrameType | None) -> None:
        for stop in STOP_SIGNALS:
            signal.signal(stop, again)
        raise _StopSignal(signum)

    previous = {stop: signal.signal(stop, first) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)


@dataclass(frozen=True)
class _Certified:
    """A window the seed certified: when (seconds since every node was ready), and the
    mean bytes a trainer had sent and received by then (None: a status was unreadable)."""

    height: int
    head_id: str
    seconds: float
    bytes_per_trainer: int | None


def _bytes_per_trainer(workdir: Path, trainers: list[str]) -> int | None:
    """The mean bytes (sent + received) of the trainers' last status files."""
    from p2ptrain.observe.status import read_status

    try:
        statuses = [read_status(workdir / name) for name in trainers]
    except LocalError:
        return None  # a trainer has not written its status yet
    return sum(_mean_bytes(statuses))


def _backends(statuses: dict[str, NodeStatus]) -> str | None:
    """The aggregation backends the nodes that aggregated used ("native (packaged)", ...)."""
    used = {s.aggregation_backend for s in statuses.values()}
    return ", ".join(sorted(b for b in used if b is not None)) or None


def _node_figures(statuses: dict[str, NodeStatus]) -> dict[str, dict[str, Any]]:
    """What each node measured of itself, by name: its roles, its process's peak resident
    memory and its resident memory after imports (MiB; the peak's growth is what its state
    cost), and, for a reducer or validator, its last reduction (the window and its wall
    seconds; null for the other roles, and before a first reduction)."""
    return {
        name: {
            "roles": list(s.roles),
            "peak_rss_mib": s.peak_rss_mib,
            "rss_after_imports_mib": s.rss_after_imports_mib,
            "reduction_seconds": s.reduction_seconds,
            "reduction_window": s.reduction_window,
        }
        for name, s in statuses.items()
    }


def _mean_bytes(statuses: list[NodeStatus]) -> tuple[int, int]:
    """The trainers' mean bytes sent and received (each rounded down: the summary's and
    the loss curve's figures are one sum of them)."""
    sent = sum(s.bytes_sent for s in statuses) // len(statuses)
    return sent, sum(s.bytes_received for s in statuses) // len(statuses)


def _by_kind_text(by_kind: dict[str, int]) -> str:
    """``{"aggregate": 3_060_000, ...}`` as "3.06 MB aggregate, ..." (largest first)."""
    ordered = sorted(by_kind.items(), key=lambda item: -item[1])
    return ", ".join(f"{n / 1e6:.2f} MB {kind}" for kind, n in ordered) or "none counted"


def _follow(
    network: Any,
    windows: int,
    console: Any,
    per_window_s: float,
    on_certified: Callable[[HeadAdopted], None],
) -> dict[str, list[Trained]]:
    """Show progress until the seed adopts ``windows`` heads (``on_certified`` is told of
    each); return each trainer's ``trained`` events."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    reached = [0]
    losses: dict[int, list[tuple[float, float]]] = {}
    trained: dict[str, list[Trained]] = {}
    with Progress(
        TextColumn("[bold]windows certified"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("waiting for the first window", total=windows)
        last = time.monotonic()
        events = network.next_events(per_window_s * windows, until=lambda: reached[0] >= windows)
        for name, event in events:
            if isinstance(event, Trained):
                trained.setdefault(name, []).append(event)
                losses.setdefault(event.window, []).append((event.loss_before, event.loss_after))
                progress.update(task, description=f"{name} trained window {event.window}")
            elif isinstance(event, HeadAdopted) and name == "seed":
                on_certified(event)
                height = reached[0] = event.height
                pairs = losses.get(height, [])
                loss = ""
                if pairs:
                    before = sum(p[0] for p in pairs) / len(pairs)
                    after = sum(p[1] for p in pairs) / len(pairs)
                    loss = f", train loss {before:.3f} -> {after:.3f}"
                now = time.monotonic()
                progress.console.print(
                    f"window {height} certified: {event.accepted} updates{loss}, {now - last:.1f} s"
                )
                last = now
                progress.update(task, completed=height, description="")
            elif isinstance(event, PeerReported):
                progress.console.print(f"[yellow]{name}: peer {event.peer[:12]}: {event.reason}")
            elif isinstance(event, RoleFailure):
                progress.console.print(
                    f"[red]{name}: the {event.role} failed in window {event.window}: "
                    f"{event.error}: {event.message}"
                )
            elif isinstance(event, Exited) and name == "seed":
                raise LocalError(f"the seed exited; see {network.nodes['seed'].log}")
    return trained


def _summarise(
    network: Any,
    trainers: list[str],
    args: argparse.Namespace,
    experiment: DemoExperiment,
    certified: list[_Certified],
    *,
    console: Any,
) -> dict[str, Any]:
    import torch

    from p2ptrain.data.shards import lease_indices
    from p2ptrain.node.export import canonical_weights, export_checkpoint, export_hf
    from p2ptrain.node.trainer_runner import window_seed
    from p2ptrain.observe.status import mean_bytes_by_kind, read_status
    from p2ptrain.protocol.leases import lease_for
    from p2ptrain.torch.baseline import ddp_bytes_per_worker, ddp_equivalent
    from p2ptrain.torch.capabilities import ReportsEvaluation, TorchModule

    def build() -> Any:
        return demo_workload(experiment)

    seed_dir = network.workdir / "seed"
    checkpoint = network.workdir / "model.safetensors"
    exported = export_checkpoint(seed_dir, checkpoint, workload=experiment.code)
    manifest, experiment_id, height, _head, weights = canonical_weights(seed_dir)
    torch.set_num_threads(2)
    workload = build()
    missing, genesis_val_loss, val_loss = _validation(workload, weights, console)
    peer_ids = [network.nodes[t].peer_id for t in trainers]
    every = {name: read_status(network.workdir / name) for name in network.nodes}
    statuses = [every[name] for name in trainers]
    sent, received = _mean_bytes(statuses)
    received_by_kind = mean_bytes_by_kind(statuses, "received")
    sent_by_kind = mean_bytes_by_kind(statuses, "sent")
    parameters = sum(t.numel() for t in weights.values())
    steps = height * manifest.inner_steps
    ddp_each_way = ddp_bytes_per_worker(parameters, steps, len(trainers))
    summary: dict[str, Any] = {
        "windows_certified": height,
        "val_loss": _rounded(val_loss),
        "genesis_val_loss": _rounded(genesis_val_loss),
        "validation_samples": (
            workload.validation_samples if isinstance(workload, ReportsEvaluation) else 0
        ),
        "validation_missing": missing,
        "baseline_val_loss": None,
        "bytes_per_trainer_sent": sent,
        "bytes_per_trainer_received": received,
        "bytes_per_trainer": sent + received,
        # what the trainers' own counters attribute them to: downloads by kind (aggregates,
        # full states, shards, gossip) and uploads by kind
        "bytes_per_trainer_received_by_kind": received_by_kind,
        "bytes_per_trainer_sent_by_kind": sent_by_kind,
        # the control traffic's cost against the update's own size, a window and a trainer
        "gossip_bytes_per_window": (
            received_by_kind.get("gossip", 0) + sent_by_kind.get("gossip", 0)
        )
        // max(1, height),
        "update_bytes_per_window": sent_by_kind.get("update", 0) // max(1, height),
        "bytes_measured": "tcp" if all(s.wire_measured for s in statuses) else "node counters",
        "aggregation_backend": _backends(every),
        "nodes": _node_figures(every),
        "ddp_bytes_per_trainer": 2 * ddp_each_way,
        "ddp_bytes_formula": "ring all-reduce of fp32 gradients: 2(N-1)/N x 4 bytes x "
        "parameters per step, sent and as much received",
        "checkpoint": exported["checkpoint"],
        "export_hf": None,
        "val_loss_curve": []
        if genesis_val_loss is None
        else _loss_curve(seed_dir, certified, workload, genesis_val_loss, console),
        "baseline_seconds": None,
        "baseline_curve": [],
        "loss_png": None,
        "workload": experiment.code,
        "parameters": parameters,
        "trainers": len(trainers),
        "inner_steps": manifest.inner_steps,
        "experiment_id": experiment_id,
    }
    if not args.no_baseline and height > 0 and val_loss is not None:
        console.print(f"training the DDP-equivalent baseline ({steps} steps)...")
        windows = [
            [lease_indices(manifest.dataset, lease_for(manifest, w, p)) for p in peer_ids]
            for w in range(1, height + 1)
        ]
        replayed = build()
        replay_started = time.monotonic()
        curve: list[dict[str, Any]] = [summary["val_loss_curve"][0]]  # genesis: the same
        evaluating = [0.0]  # seconds spent evaluating, not training

        def baseline_window(window: int, loss: float) -> None:
            now = time.monotonic()
            each_way = ddp_bytes_per_worker(
                parameters, window * manifest.inner_steps, len(trainers)
            )
            curve.append(
                {
                    "height": window,
                    "seconds": round(now - replay_started - evaluating[0], 1),
                    "bytes_per_trainer": 2 * each_way,
                    "val_loss": round(loss, 4),
                }
            )
            evaluating[0] += time.monotonic() - now

        baseline = ddp_equivalent(
            replayed,
            windows,
            steps=manifest.inner_steps,
            seed_of=lambda w, t: window_seed(peer_ids[t], w + 1),
            lr_scale=manifest.inner_optimizer.lr_scale,
            on_window=baseline_window,
        )
        summary["baseline_curve"] = curve
        summary["baseline_seconds"] = curve[-1]["seconds"]
        summary["baseline_val_loss"] = round(baseline, 4)
        summary["val_loss_ratio"] = round(val_loss / baseline, 4)
    if isinstance(workload, TorchModule) and hasattr(workload.model, "save_pretrained"):  # HF
        out = network.workdir / "model-hf"
        summary["export_hf"] = export_hf(seed_dir, out, workload=experiment.code)["directory"]
    summary["bytes_ratio"] = round(
        summary["ddp_bytes_per_trainer"] / max(1, summary["bytes_per_trainer"]), 1
    )
    if summary["val_loss_curve"]:
        summary["loss_png"] = _plot_loss(network.workdir / LOSS_PNG, summary, console)
    return summary


def _validation(
    workload: Any, weights: dict[str, Any], console: Any
) -> tuple[str | None, float | None, float | None]:
    """(why there is no validation loss, the genesis weights' loss, ``weights``' loss): the
    losses are None, and the reason said, when the workload has no validation data."""
    from p2ptrain.torch.capabilities import PreparedDataUser

    missing = workload.validation_missing if isinstance(workload, PreparedDataUser) else None
    if missing:
        console.print(f"[yellow]no validation loss: {missing}")
        return missing, None, None
    return None, workload.evaluate(workload.initial_weights()), workload.evaluate(weights)


def _rounded(loss: float | None) -> float | None:
    return None if loss is None else round(loss, 4)


def _loss_curve(
    seed_dir: Path,
    certified: list[_Certified],
    workload: Any,
    genesis_val_loss: float,
    console: Any,
) -> list[dict[str, Any]]:
    """The validation loss of the genesis weights (at 0 s and 0 bytes), then of each head
    the seed certified, with when and what it cost (the seed keeps every head for this; one
    it no longer holds is left out, with a note)."""
    from p2ptrain.node.export import canonical_weights

    genesis: dict[str, Any] = {"height": 0, "seconds": 0.0, "bytes_per_trainer": 0}
    curve = [{**genesis, "val_loss": round(genesis_val_loss, 4)}]
    for window in certified:
        try:
            *_, weights = canonical_weights(seed_dir, window.head_id)
        except LocalError as exc:
            console.print(f"[yellow]loss curve: window {window.height} left out: {exc}")
            continue
        curve.append(
            {
                "height": window.height,
                "seconds": round(window.seconds, 1),
                "bytes_per_trainer": window.bytes_per_trainer,
                "val_loss": round(workload.evaluate(weights), 4),
            }
        )
    return curve


def _plot_loss(path: Path, summary: dict[str, Any], console: Any) -> str | None:
    """Draw ``loss.png`` from the summary's curve and baseline; its path (None, with a
    note, when matplotlib is not installed)."""
    from p2ptrain.cli.loss_plot import NO_MATPLOTLIB, LossPoint, can_plot, plot_loss

    if not can_plot():
        console.print(NO_MATPLOTLIB)
        return None
    certified = [
        LossPoint(p["seconds"], p["bytes_per_trainer"], p["val_loss"])
        for p in summary["val_loss_curve"]
    ]
    baseline = [
        LossPoint(p["seconds"], p["bytes_per_trainer"], p["val_loss"])
        for p in summary["baseline_curve"]
    ]
    title = f"{summary['trainers']} trainers, {summary['windows_certified']} windows"
    plot_loss(path, certified, baseline, title=title)
    return str(path)


def _print_summary(summary: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="p2ptrain demo", show_header=False)
    table.add_row("windows certified", str(summary["windows_certified"]))
    if summary["val_loss"] is None:
        table.add_row("validation loss", f"none: {summary['validation_missing']}")
    else:
        table.add_row(
            "validation loss (canonical)",
            f"{summary['val_loss']:.4f}  (at genesis {summary['genesis_val_loss']:.4f}; "
            f"{summary['validation_samples']} validation samples)",
        )
    if summary["baseline_val_loss"] is not None:
        table.add_row(
            "validation loss (DDP-equivalent)",
            f"{summary['baseline_val_loss']:.4f}  (ratio {summary['val_loss_ratio']:.3f})",
        )
    table.add_row(
        "bytes per trainer (measured)",
        f"{summary['bytes_per_trainer_sent'] / 1e6:.2f} MB sent, "
        f"{summary['bytes_per_trainer_received'] / 1e6:.2f} MB received",
    )
    if summary.get("bytes_per_trainer_received_by_kind") is not None:
        table.add_row(
            "a trainer's downloads by kind",
            _by_kind_text(summary["bytes_per_trainer_received_by_kind"]),
        )
        table.add_row(
            "a trainer's uploads by kind", _by_kind_text(summary["bytes_per_trainer_sent_by_kind"])
        )
    if summary.get("gossip_bytes_per_window") is not None:
        table.add_row(
            "gossip a window, per trainer",
            f"{summary['gossip_bytes_per_window'] / 1e3:.1f} kB sent and received "
            f"(its update: {summary['update_bytes_per_window'] / 1e3:.1f} kB)",
        )
    table.add_row(
        "DDP would send + receive",
        f"{summary['ddp_bytes_per_trainer'] / 1e6:.1f} MB by formula  "
        f"({summary['bytes_ratio']:.0f}x more)",
    )
    if summary.get("compute_utilisation") is not None:
        table.add_row(
            "trainer compute utilisation", f"{100 * summary['compute_utilisation']:.0f} %"
        )
    nodes = summary["nodes"]
    table.add_row(
        "peak memory per node",
        ", ".join(f"{name} {n['peak_rss_mib']:.0f} MiB" for name, n in nodes.items()),
    )
    reduced = [
        f"{name} {n['reduction_seconds']:.3f} s (window {n['reduction_window']})"
        for name, n in nodes.items()
        if n["reduction_seconds"] is not None
    ]
    if reduced:
        table.add_row("last reduction per node", ", ".join(reduced))
    table.add_row("checkpoint", summary["checkpoint"])
    if summary["val_loss"] is not None:
        drawn = summary["loss_png"] or "not drawn (matplotlib is not installed)"
        table.add_row("loss plot", drawn)
    if summary["export_hf"]:
        table.add_row("Hugging Face export", summary["export_hf"])
    table.add_row("time", f"{summary['seconds']:.0f} s")
    console.print(table)
    sys.stdout.flush()
