"""Tune the demo's DiLoCo defaults by simulating the network's math in one process.

Each window, every one of T trainers trains ``inner_steps`` inner steps from the canonical
weights on its real lease (``lease_for`` on a real ``ExperimentManifest``, ``lease_indices``),
encodes its pseudo-gradient ``theta_base - theta_local`` with the experiment's codec (the
demo's by default), and publishes an Update; the window is then reduced by
``p2ptrain.protocol.reduction.reduce_window`` itself -- the same admission, screening,
aggregation rule (trimmed mean by default) and outer Nesterov step a reducer runs. Only
networking and signatures are left out. The inner learning rate follows the manifest's
schedule (by default the demo's cosine decay to ``--min-lr-ratio``; ``--constant-lr``), and
``--staleness 1`` trains each window on the head before the newest plus the trainer's own
pseudo-gradient of the window in between, as trainers with ``window.staleness = 1`` do.

The run is then replayed as synchronous data parallel training on exactly the same samples
(``p2ptrain.torch.baseline.ddp_equivalent``), and the script prints both validation losses,
their ratio, the compute time of each, and the bytes each trainer sent against what a ring
all-reduce of fp32 gradients would send.

    .venv/bin/python bench/tune_diloco.py                       # the demo defaults
    .venv/bin/python bench/tune_diloco.py --inner-steps 30 --windows 12 --outer-momentum 0.8
    .venv/bin/python bench/tune_diloco.py --codec sparseloco --codec-config '{"fraction": 0.02}'

Uses one CPU thread (``--threads``), like each process of the local demo.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from p2ptrain.aggregate.codecs import WindowEncoders, codec_at
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    AGGREGATE_PRECISIONS,
    AggregationSpec,
    CodecSpec,
    ExperimentManifest,
    InnerOptimizerSpec,
    OuterOptimizerSpec,
    WindowSpec,
    WorkloadSpec,
)
from p2ptrain.core.records import Update
from p2ptrain.core.tensors import encode_state_dict, schema_hash, schema_of
from p2ptrain.data.shards import lease_indices
from p2ptrain.protocol.chain import genesis_head
from p2ptrain.protocol.leases import Lease, LeaseBook, lease_for
from p2ptrain.protocol.reduction import BaseState, Submission, reduce_window
from p2ptrain.torch.baseline import ddp_bytes_per_worker, ddp_equivalent
from p2ptrain.torch.char_gpt import (
    DEFAULT_CONFIG,
    DEMO_AGGREGATE_PRECISION,
    DEMO_CODEC,
    DEMO_DEFAULTS,
    char_gpt_workload,
)
from p2ptrain.torch.workload import TorchWorkload, WindowResult


def _identity(label: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"tune-diloco-{label}".encode()).digest())


def seed_of(window: int, trainer: int) -> int:
    """The minibatch seed of trainer ``trainer`` in window ``window`` (0-based here)."""
    return 1_000 * window + trainer


@dataclass(frozen=True)
class Figures:
    diloco_val: float
    ddp_val: float
    ratio: float
    genesis_val: float
    diloco_train_s: float
    ddp_train_s: float
    s_per_inner_step: float
    update_bytes: int
    #: what a follower downloads: every window's aggregate blob
    aggregate_bytes: int
    ddp_bytes: int
    bytes_ratio: float
    parameters: int
    val_per_window: list[float]
    #: a trainer's bytes through each window: its updates sent plus the aggregates applied
    bytes_through_window: list[int]
    #: the first window whose head reached --target (0: none did), and the bytes through it
    target_window: int = 0
    bytes_to_target: int = 0


def _manifest(
    workload: TorchWorkload,
    config: dict[str, str | int | float | bool],
    args: argparse.Namespace,
    genesis: dict[str, torch.Tensor],
) -> ExperimentManifest:
    return ExperimentManifest(
        network_id=sha256_hex(b"tune-diloco-network"),
        study=f"tune-{args.seed or 0}",
        name="char-gpt",
        authority=_identity("authority").public_key,
        workload=WorkloadSpec(name="char-gpt", schema_hash=schema_hash(genesis), config=config),
        dataset=workload.dataset_manifest(),
        inner_optimizer=InnerOptimizerSpec(
            name="adamw",
            lr=float(config["lr"]),
            schedule="constant" if args.min_lr_ratio is None else "cosine",
            decay_windows=args.decay_windows or args.windows,
            min_lr_ratio=1.0 if args.min_lr_ratio is None else args.min_lr_ratio,
            warmup_windows=args.warmup_windows,
        ),
        inner_steps=args.inner_steps,
        outer_optimizer=OuterOptimizerSpec(
            name=args.outer_optimizer, lr=args.outer_lr, momentum=args.outer_momentum
        ),
        window=WindowSpec(
            min_updates=1, max_updates=max(8, args.trainers), staleness=args.staleness
        ),
        codec=CodecSpec(name=args.codec, config=json.loads(args.codec_config)),
        aggregation=AggregationSpec(rule=args.rule, precision=args.aggregate_precision),
        validators=(_identity("validator").public_key,),
        quorum=1,
        lease_size=args.inner_steps * int(config["batch_size"]),
        genesis_weights=sha256_hex(bytes(encode_state_dict(genesis))),
    )


class _DrawnLeases(LeaseBook):
    """A lease book whose leases are drawn from ``draw_id`` instead of the experiment's id:
    with ``--lease-seed``, runs that change a setting (which changes the id) still train on
    the same samples, so their losses and their DDP replays compare row for row."""

    def __init__(self, manifest: ExperimentManifest, draw_id: str) -> None:
        super().__init__(manifest)
        self._draw_id = draw_id
        self._drawn: dict[tuple[int, str], Lease] = {}

    def lease(self, window: int, peer_id: str) -> Lease:
        lease = self._drawn.get((window, peer_id))
        if lease is None:
            lease = lease_for(self.manifest, window, peer_id, experiment_id=self._draw_id)
            self._drawn[(window, peer_id)] = lease
        return lease


def _lease_book(manifest: ExperimentManifest, args: argparse.Namespace) -> LeaseBook:
    """The experiment's own leases, or with ``--lease-seed`` leases drawn from a fixed id
    (the seed and the lease size: rows with the same H and batch see the same samples)."""
    if args.lease_seed is None:
        return LeaseBook(manifest)
    draw = f"tune-diloco-leases-{args.lease_seed}-{manifest.lease_size}".encode()
    return _DrawnLeases(manifest, sha256_hex(draw))


def _genesis_base(
    manifest: ExperimentManifest, leases: LeaseBook, genesis: dict[str, torch.Tensor]
) -> BaseState:
    head = genesis_head(manifest, leases.experiment_id)
    return BaseState(head=head, head_id=head.id, weights=genesis)


def _start_weights(
    built_on: BaseState, base: BaseState, pending: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Where a window starts: the head it builds on, minus the trainer's own pseudo-gradient
    of the window in between when that head is older than the newest (staleness 1)."""
    if built_on is base or pending is None:
        return dict(built_on.weights)
    return {name: value - pending[name] for name, value in built_on.weights.items()}


def _submission(
    manifest: ExperimentManifest,
    leases: LeaseBook,
    *,
    window: int,
    built_on: BaseState,
    who: Identity,
    lease: Lease,
    blob: bytes,
    result: WindowResult,
) -> Submission:
    """A trainer's update of ``window``, trained from ``built_on``, as it publishes it
    (unsigned: the reduction does not check signatures)."""
    update = Update(
        experiment_id=leases.experiment_id,
        window=window,
        base_head=built_on.head_id,
        trainer=who.public_key,
        lease_shards=lease.shards,
        lease_samples=lease.samples,
        delta_blob=sha256_hex(blob),
        delta_bytes=len(blob),
        codec=codec_at(manifest.codec, window).name,
        loss_before=result.loss_before,
        loss_after=result.loss_after,
    )
    return Submission(update=update, update_id=update.id, blob=blob)


def _to_target(values: list[float], through: list[int], target: float) -> tuple[int, int]:
    """The first window whose loss is at most ``target`` and the bytes through it (0, 0:
    none is)."""
    reached = [w for w, value in enumerate(values, start=1) if value <= target]
    return (reached[0], through[reached[0] - 1]) if reached else (0, 0)


def _replay_ddp(
    args: argparse.Namespace,
    workload: TorchWorkload,
    manifest: ExperimentManifest,
    windows: list[list[list[int]]],
) -> tuple[float, float]:
    """DDP's validation loss on the run's samples and its seconds (NaN with --no-ddp)."""
    if args.no_ddp:
        return float("nan"), 0.0
    started = time.perf_counter()
    loss = ddp_equivalent(
        workload,
        windows,
        steps=args.inner_steps,
        seed_of=seed_of,
        lr_scale=manifest.inner_optimizer.lr_scale,
    )
    return loss, time.perf_counter() - started


def _model_config(args: argparse.Namespace) -> dict[str, str | int | float | bool]:
    """The demo's char-GPT config with the command line's changes."""
    config = dict(DEFAULT_CONFIG)
    for key in (
        "lr",
        "batch_size",
        "n_layer",
        "n_embd",
        "n_head",
        "block_size",
        "seed",
        "samples_per_shard",
    ):
        value = getattr(args, key)
        if value is not None:
            config[key] = value
    return config


def simulate(args: argparse.Namespace) -> Figures:
    config = _model_config(args)
    trainers = [char_gpt_workload(config) for _ in range(args.trainers)]
    genesis = trainers[0].initial_weights()
    manifest = _manifest(trainers[0], config, args, genesis)
    leases = _lease_book(manifest, args)
    identities = [_identity(f"trainer-{t}") for t in range(args.trainers)]
    encoders = [
        WindowEncoders(manifest.codec, schema_of(genesis), seed=t) for t in range(args.trainers)
    ]
    base = _genesis_base(manifest, leases, genesis)
    genesis_val = trainers[0].evaluate(genesis)
    #: the heads before ``base`` (newest last) and each trainer's own deltas not yet in one
    older: list[BaseState] = []
    own: list[dict[str, torch.Tensor] | None] = [None] * args.trainers
    windows: list[list[list[int]]] = []
    val_per_window: list[float] = []
    train_s = 0.0
    update_bytes = aggregate_bytes = 0
    through: list[int] = []
    for w in range(args.windows):
        cohort: list[Submission] = []
        window_indices: list[list[int]] = []
        # staleness s: window w trains on the head s windows back, from there plus the
        # trainer's own pseudo-gradient of the window in between (as trainer_runner does)
        built_on = older[0] if args.staleness and older else base
        for workload in trainers:  # the manifest's inner schedule, as trainer_runner sets it
            workload.set_lr_scale(manifest.inner_optimizer.lr_scale(base.window))
        for t, (workload, who) in enumerate(zip(trainers, identities, strict=True)):
            lease = leases.lease(base.window, who.peer_id)
            indices = lease_indices(manifest.dataset, lease)
            window_indices.append(indices)
            start = _start_weights(built_on, base, own[t])
            started = time.perf_counter()
            result = workload.train_window(
                start, indices, steps=args.inner_steps, seed=seed_of(w, t)
            )
            train_s += time.perf_counter() - started
            delta = {name: start[name] - result.weights[name] for name in genesis}
            own[t] = delta
            blob = encoders[t].at(base.window).encode(delta)
            update_bytes += len(blob)
            cohort.append(
                _submission(
                    manifest,
                    leases,
                    window=base.window,
                    built_on=built_on,
                    who=who,
                    lease=lease,
                    blob=blob,
                    result=result,
                )
            )
        windows.append(window_indices)
        bases = {base.head_id, built_on.head_id}
        reduction = reduce_window(manifest, base, cohort, leases, bases)
        if reduction.head is None or reduction.weights is None or reduction.head_id is None:
            raise SystemExit(f"window {base.window} produced no head: {reduction.reason}")
        if reduction.aggregate_blob is not None:
            aggregate_bytes += len(reduction.aggregate_blob)
        through.append(update_bytes // args.trainers + aggregate_bytes)
        older = [base][: args.staleness]
        base = BaseState(
            head=reduction.head,
            head_id=reduction.head_id,
            weights=reduction.weights,
            optimizer_state=reduction.optimizer_state,
        )
        val_per_window.append(trainers[0].evaluate(base.weights))
        if args.verbose:
            print(
                f"window {reduction.window:3d}: val {val_per_window[-1]:.4f}  "
                f"({len(reduction.accepted)} accepted; {reduction.reason})",
                flush=True,
            )
    diloco_val = val_per_window[-1]
    ddp_val, ddp_s = _replay_ddp(args, trainers[0], manifest, windows)
    parameters = sum(t.numel() for t in genesis.values())
    ddp_bytes = ddp_bytes_per_worker(parameters, args.windows * args.inner_steps, args.trainers)
    target_window, bytes_to_target = _to_target(val_per_window, through, args.target)
    return Figures(
        target_window=target_window,
        bytes_to_target=bytes_to_target,
        bytes_through_window=through,
        diloco_val=diloco_val,
        ddp_val=ddp_val,
        ratio=diloco_val / ddp_val,
        genesis_val=genesis_val,
        diloco_train_s=train_s,
        ddp_train_s=ddp_s,
        s_per_inner_step=train_s / (args.trainers * args.windows * args.inner_steps),
        update_bytes=update_bytes // args.trainers,
        aggregate_bytes=aggregate_bytes,
        ddp_bytes=ddp_bytes,
        bytes_ratio=ddp_bytes * args.trainers / update_bytes,
        parameters=parameters,
        val_per_window=val_per_window,
    )


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=int(DEMO_DEFAULTS["trainers"]))
    parser.add_argument("--inner-steps", type=int, default=int(DEMO_DEFAULTS["inner_steps"]))
    parser.add_argument("--windows", type=int, default=int(DEMO_DEFAULTS["windows"]))
    parser.add_argument("--outer-lr", type=float, default=float(DEMO_DEFAULTS["outer_lr"]))
    parser.add_argument(
        "--outer-momentum", type=float, default=float(DEMO_DEFAULTS["outer_momentum"])
    )
    parser.add_argument("--outer-optimizer", default="nesterov", choices=("nesterov", "sgd"))
    parser.add_argument("--lr", type=float, default=None, help="inner AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--n-embd", type=int, default=None)
    parser.add_argument("--n-head", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=None,
        help="the dataset's shard size: a lease is whole shards, so smaller shards spread "
        "a trainer's window over more of the text",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="model seed; also reshuffles the leases"
    )
    parser.add_argument(
        "--lease-seed",
        type=int,
        default=None,
        help="draw the leases from this seed instead of the experiment's id, so that rows "
        "changing a setting train on the same samples (and replay the same DDP run)",
    )
    parser.add_argument("--codec", default=DEMO_CODEC)
    parser.add_argument("--codec-config", default="{}", help="the codec's config, as JSON")
    parser.add_argument("--staleness", type=int, default=0, choices=(0, 1))
    parser.add_argument(
        "--min-lr-ratio",
        type=float,
        default=float(DEMO_DEFAULTS["min_lr_ratio"]),
        help="the inner lr decays along a cosine to this fraction over the run",
    )
    parser.add_argument(
        "--constant-lr",
        dest="min_lr_ratio",
        action="store_const",
        const=None,
        help="keep the inner lr constant",
    )
    parser.add_argument(
        "--decay-windows",
        type=int,
        default=0,
        help="the cosine's length in windows (default --windows); past it the inner lr "
        "stays at its floor, as a run to a target goes on past the reference run",
    )
    parser.add_argument(
        "--warmup-windows",
        type=int,
        default=0,
        help="the inner lr rises linearly to its rate over this many windows first",
    )
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP replay")
    parser.add_argument("--rule", default="trimmed_mean")
    parser.add_argument(
        "--aggregate-precision", default=DEMO_AGGREGATE_PRECISION, choices=AGGREGATE_PRECISIONS
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.0,
        help="report the first window whose validation loss is at most this, and a "
        "trainer's bytes (updates sent, aggregates applied) through it",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every window")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _arguments(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    figures = simulate(args)
    total = time.perf_counter() - started
    print(
        f"T={args.trainers} H={args.inner_steps} W={args.windows} "
        f"outer={args.outer_lr}/{args.outer_momentum} lr={args.lr or DEFAULT_CONFIG['lr']} "
        f"B={args.batch_size or DEFAULT_CONFIG['batch_size']} params={figures.parameters}\n"
        f"  val loss: genesis {figures.genesis_val:.4f}  diloco {figures.diloco_val:.4f}  "
        f"ddp {figures.ddp_val:.4f}  ratio {figures.ratio:.4f}\n"
        f"  compute: diloco {figures.diloco_train_s:.1f}s (all trainers)  ddp "
        f"{figures.ddp_train_s:.1f}s  {figures.s_per_inner_step * 1000:.1f} ms/inner step  "
        f"total {total:.1f}s\n"
        f"  bytes per trainer: {args.codec} updates {figures.update_bytes:,}  aggregates "
        f"{figures.aggregate_bytes:,}  ddp "
        f"{figures.ddp_bytes:,}  ratio {figures.bytes_ratio:.0f}x\n"
        f"  val per window: {' '.join(f'{v:.3f}' for v in figures.val_per_window)}"
        + (
            f"\n  target {args.target}: reached at window {figures.target_window}, "
            f"{figures.bytes_to_target:,} bytes per trainer"
            if args.target
            else ""
        ),
        flush=True,
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": vars(args), "total_s": total, **asdict(figures)}, out, indent=1)


if __name__ == "__main__":
    main()
