"""One rank of the cluster's gradient-sync benchmark: raw gloo against DDP's compression hooks.

``p2ptrain bench pods`` asks how many fp32 gradient bytes per second a home cluster
synchronises through the communication hook its DDP uses, against gloo all-reducing the same
fp32 gradients with no hook. This program is one of the two ranks that measure it::

    python -m p2ptrain.bench.cluster_sync_rank --rank 0 --listen HOST --params N ...
    python -m p2ptrain.bench.cluster_sync_rank --rank 1 --store HOST:PORT --params N ...

Rank 0 serves the rendezvous store at ``HOST`` on a port the kernel picks and prints it as
its first line, ``{"event": "store", "port": PORT}``. Rank 1 is given ``HOST:PORT``, or with
``--store -`` reads it on stdin, so that both can start (and import torch) at once. Gloo
binds the interface holding the address this rank reaches the store from (``lo`` on
loopback, the host's veth inside a namespace lab), as
:func:`~p2ptrain.bench.ddp_rank.gloo_interface` finds it, unless ``GLOO_SOCKET_IFNAME``
already names one. Each rank runs one torch thread.

What is measured
----------------
The gradients are those of :class:`SyncModel`: ``--tensors`` 2-D fp32 parameters holding
``--params`` numbers in all, whose loss is ``sum_i <p_i, c_i>`` for fixed gaussian ``c_i``.
Its backward is one multiply and one add per number (the gradient of ``p_i`` is ``c_i``),
next to the sync nearly free, and the gradients are dense and gaussian, as real ones are.

* **gloo** (the baseline): one blocking :func:`torch.distributed.all_reduce` of all the
  fp32 gradients as one flat tensor, the fastest way gloo has to all-reduce them (one
  all-reduce per gradient tensor is timed too, as ``gloo_per_tensor``, and is slower).
* **a hook** (``fp16``, ``bf16``, ``powersgd``, or ``allreduce``: DDP's own uncompressed
  all-reduce): the real DDP machinery, set up as the cluster sets it up (DDP's default
  buckets and ``gradient_as_bucket_view`` unless ``--bucket-mb`` / ``--bucket-view`` say
  otherwise; PowerSGD with error feedback and warm start, at rank ``--powersgd-rank``). A
  model per hook is wrapped in :class:`~torch.nn.parallel.DistributedDataParallel` with the
  hook registered. Its sync time is the median time of a backward that synchronises minus
  the median time of the same backward after a forward under :meth:`~torch.nn.parallel.
  DistributedDataParallel.no_sync`: what synchronising adds to a step, DDP's copies into
  and out of its buckets, compression, the collectives and decompression included. DDP
  starts a bucket's hook while the backward still runs; with this backward there is next
  to nothing to overlap, so the difference is the sync itself.

The methods are timed in interleaved rounds (gloo, then each hook synchronising and not, in
every round), so that a burst of load elsewhere on the machine falls on all of them alike.
Every timed run starts at a barrier of both ranks, with the gradients reset and the forward
done before it (all untimed). ``--warmup`` rounds come first and are not counted (DDP
rebuilds its buckets after its first step; PowerSGD all-reduces plainly for its first
two); each figure is the median of ``--repeats`` rounds. PowerSGD's compression rate is
reported; under PowerSGD all the gradients go in one bucket (see :func:`hook_bucket_mb`).
DDP refuses ``bf16_compress_hook`` without NCCL: on gloo the hook is reported as
unsupported, with DDP's words, rather than timed.

The last line is one JSON object, ``{"event": "figures", ...}``, a :class:`RankFigures`;
progress goes to stderr. Failures print what went wrong to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from p2ptrain.bench.ddp_rank import gloo_interface, parse_master
from p2ptrain.errors import LocalError

__all__ = [
    "HOOKS",
    "HookFigures",
    "RankFigures",
    "StorePort",
    "SyncModel",
    "hook_bucket_mb",
    "main",
    "measure",
    "tensor_shapes",
]

#: The hooks this bench knows; ``allreduce`` is DDP's built-in uncompressed all-reduce.
HOOKS = ("fp16", "bf16", "powersgd", "allreduce")

_STARTED = time.monotonic()


class StorePort(msgspec.Struct, frozen=True, tag_field="event", tag="store"):
    """Rank 0's first line: the port its rendezvous store listens on."""

    port: int


class HookFigures(msgspec.Struct, frozen=True):
    """One hook's timings on one rank (medians, seconds)."""

    sync_seconds: float  # backward_seconds - no_sync_seconds
    bucket_mb: float | None  # DDP's bucket_cap_mb for this hook; None: its default
    backward_seconds: float
    no_sync_seconds: float
    compress_rate: float | None = None  # PowerSGD's numbers before / after compression


class RankFigures(msgspec.Struct, frozen=True, tag_field="event", tag="figures"):
    """A rank's last line."""

    rank: int
    params: int
    bytes: int  # fp32 gradient bytes synchronised per run
    tensors: int
    bucket_mb: float | None
    bucket_view: bool
    repeats: int
    warmup: int
    threads: int
    interface: str
    gloo_seconds: float  # one all-reduce of all the gradients as one flat tensor
    gloo_per_tensor_seconds: float  # an all-reduce per gradient tensor
    hooks: dict[str, HookFigures]
    unsupported: dict[str, str]


def hook_bucket_mb(hook: str, bucket_mb: float | None, params: int) -> float | None:
    """DDP's bucket size for ``hook``: ``bucket_mb`` (None: DDP's default, 25 MiB after a
    first bucket of 1 MiB), but one bucket for all the gradients under PowerSGD.

    PowerSGD's hook issues its second and third all-reduce from future callbacks, on
    whichever thread completed the one before, while the backward goes on issuing the next
    bucket's first all-reduce. With two buckets in flight the ranks can issue their
    collectives in different orders; gloo pairs collectives by order, and both ranks then
    wait forever (40 MB of gradients in 25 MiB buckets hang within a few steps). One bucket has one
    chain of collectives, in one order."""
    if hook == "powersgd":
        return max(bucket_mb or 0.0, float(math.ceil(4 * params / 2**20) + 1))
    return bucket_mb


def tensor_shapes(params: int, tensors: int) -> list[tuple[int, int]]:
    """``tensors`` near-square 2-D shapes holding ``params`` numbers in all (the last takes
    the remainder). PowerSGD compresses a tensor as a matrix, so they are matrices."""
    if tensors < 1 or params < tensors:
        raise LocalError(f"--params ({params}) must be at least --tensors ({tensors}) >= 1")
    shapes = []
    left = params
    for index in range(tensors):
        size = left if index == tensors - 1 else params // tensors
        rows = max(1, int(size**0.5))
        while size % rows:
            rows -= 1
        shapes.append((rows, size // rows))
        left -= size
    return shapes


class SyncModel(torch.nn.Module):
    """Parameters of the given shapes; the loss is ``sum_i <p_i, c_i>``, so the gradient of
    ``p_i`` is the fixed gaussian ``c_i`` (not a buffer: DDP does not broadcast it)."""

    def __init__(self, shapes: Sequence[tuple[int, int]], generator: torch.Generator) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(shape)) for shape in shapes
        )
        self.coefficients = [torch.randn(shape, generator=generator) for shape in shapes]

    def forward(self) -> torch.Tensor:
        terms = [(w * c).sum() for w, c in zip(self.weights, self.coefficients, strict=True)]
        return torch.stack(terms).sum()


@dataclass(frozen=True)
class _Method:
    """One timed thing: ``prepare`` (untimed), then ``run`` (timed)."""

    name: str
    prepare: Callable[[], None]
    run: Callable[[], None]


def _gloo_methods(model: SyncModel) -> list[_Method]:
    """Raw fp32 all-reduces of the gradients: as one flat tensor, and tensor by tensor."""
    source = torch.cat([c.flatten() for c in model.coefficients])
    flat = source.clone()
    grads = [c.clone() for c in model.coefficients]

    def reset_flat() -> None:
        flat.copy_(source)

    def reset_grads() -> None:
        for grad, c in zip(grads, model.coefficients, strict=True):
            grad.copy_(c)

    def per_tensor() -> None:
        for grad in grads:
            dist.all_reduce(grad)

    return [
        _Method("gloo", reset_flat, lambda: dist.all_reduce(flat)),
        _Method("gloo_per_tensor", reset_grads, per_tensor),
    ]


def _register(ddp: DistributedDataParallel, hook: str, powersgd_rank: int) -> Any:
    """Registers ``hook`` on ``ddp``; returns PowerSGD's state (else None)."""
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    elif hook != "allreduce":
        raise LocalError(f"unknown hook {hook!r}: choose from {', '.join(HOOKS)}")
    return None


def _backward(ddp: DistributedDataParallel, name: str, *, sync: bool) -> _Method:
    """``ddp``'s backward, synchronising or not (the forward ran under ``no_sync``); the
    zeroing of the gradients and the forward are untimed."""
    losses: list[torch.Tensor] = []

    def forward() -> None:
        ddp.zero_grad(set_to_none=False)
        with nullcontext() if sync else ddp.no_sync():
            losses.append(ddp())

    def backward() -> None:
        torch.autograd.backward(losses.pop())

    return _Method(name, forward, backward)


def _medians(methods: Sequence[_Method], *, repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds of every method's ``run``, in interleaved rounds (a burst of load
    elsewhere on the machine hits every method alike); each run starts at a barrier of all
    ranks; the first ``warmup`` rounds are not counted."""
    seconds: dict[str, list[float]] = {method.name: [] for method in methods}
    for round_index in range(warmup + repeats):
        for method in methods:
            method.prepare()
            dist.barrier()
            start = time.perf_counter()
            method.run()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                seconds[method.name].append(elapsed)
    return {name: statistics.median(runs) for name, runs in seconds.items()}


def _note(text: str) -> None:
    """A progress line for the rank's log (stderr), with seconds since the process began."""
    print(f"[{time.monotonic() - _STARTED:7.2f} s] {text}", file=sys.stderr, flush=True)


def _emit(record: StorePort | RankFigures) -> None:
    print(msgspec.json.encode(record).decode(), flush=True)


def _join(rank: int, world: int, host: str, port: int, timeout_s: float) -> str:
    """Joins the gloo group whose store rank 0 serves (on port 0: one the kernel picks,
    announced on stdout); returns the interface gloo uses."""
    timeout = timedelta(seconds=timeout_s)
    where = f"{host}:{port or '(any port)'}"
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
    except (RuntimeError, OSError, ValueError) as exc:
        role = "serve" if rank == 0 else "reach"
        raise LocalError(
            f"rank {rank} could not {role} the rendezvous store at {where} within "
            f"{timeout_s:g} s: {exc}; check that rank 0 is running and the address is "
            "reachable from this host"
        ) from exc
    if rank == 0:
        _emit(StorePort(store.port))
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface(host, store.port)[0]
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except (RuntimeError, OSError, ValueError) as exc:
        raise LocalError(
            f"rank {rank} of {world} could not join the gloo group of the store at {host}:"
            f"{store.port} over {interface} within {timeout_s:g} s: {exc}"
        ) from exc
    _note(f"rank {rank} of {world} joined the gloo group at {host}:{store.port} over {interface}")
    return interface


def measure(
    *,
    rank: int,
    world: int,
    host: str,
    port: int,
    params: int,
    tensors: int,
    hooks: Sequence[str],
    bucket_mb: float | None,
    bucket_view: bool,
    powersgd_rank: int,
    repeats: int,
    warmup: int,
    timeout_s: float,
) -> RankFigures:
    """Joins the group and times gloo and every hook (see the module docstring)."""
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise LocalError(f"unknown hooks {', '.join(unknown)}: choose from {', '.join(HOOKS)}")
    if repeats < 1 or warmup < 3:
        raise LocalError("--repeats must be at least 1 and --warmup at least 3")
    shapes = tensor_shapes(params, tensors)
    interface = _join(rank, world, host, port, timeout_s)
    try:
        methods = _gloo_methods(_model(shapes))
        unsupported: dict[str, str] = {}
        states: dict[str, Any] = {}
        buckets: dict[str, float | None] = {}
        ddp: DistributedDataParallel | None = None
        for hook in hooks:
            # A model per hook: DDP wraps its parameters for good.
            buckets[hook] = hook_bucket_mb(hook, bucket_mb, params)
            ddp = DistributedDataParallel(
                _model(shapes),
                bucket_cap_mb=buckets[hook],
                gradient_as_bucket_view=bucket_view,
                init_sync=False,  # every rank built the same model from the same seed
            )
            try:
                states[hook] = _register(ddp, hook, powersgd_rank)
            except (TypeError, ValueError, RuntimeError) as exc:  # DDP's check, on every rank
                unsupported[hook] = f"DDP refuses the {hook} hook here: {exc}"
                continue
            methods.append(_backward(ddp, hook, sync=True))
            methods.append(_backward(ddp, f"{hook}/no_sync", sync=False))
        _note(f"timing {', '.join(m.name for m in methods)}: {warmup} + {repeats} rounds")
        seconds = _medians(methods, repeats=repeats, warmup=warmup)
        _note("timed")
        figures = {
            hook: HookFigures(
                sync_seconds=seconds[hook] - seconds[f"{hook}/no_sync"],
                bucket_mb=buckets[hook],
                backward_seconds=seconds[hook],
                no_sync_seconds=seconds[f"{hook}/no_sync"],
                compress_rate=None if state is None else float(state.compression_stats()[0]),
            )
            for hook, state in states.items()
        }
        # DDP's reducers and the hooks' states hold the group: they go before it does
        # (torch's teardown aborted a rank now and then with them still alive)
        methods.clear()
        states.clear()
        ddp = None
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return RankFigures(
        rank=rank,
        params=params,
        bytes=4 * params,
        tensors=tensors,
        bucket_mb=bucket_mb,
        bucket_view=bucket_view,
        repeats=repeats,
        warmup=warmup,
        threads=torch.get_num_threads(),
        interface=interface,
        gloo_seconds=seconds["gloo"],
        gloo_per_tensor_seconds=seconds["gloo_per_tensor"],
        hooks=figures,
        unsupported=unsupported,
    )


def _model(shapes: Sequence[tuple[int, int]]) -> SyncModel:
    """The same model on every rank and for every method (a fresh one per DDP wrapper)."""
    return SyncModel(shapes, torch.Generator().manual_seed(0))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.cluster_sync_rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", metavar="HOST", help="rank 0: serve the store at HOST")
    where.add_argument(
        "--store", metavar="HOST:PORT", help="other ranks: rank 0's store (-: read it from stdin)"
    )
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--hooks", default="fp16", help=f"comma-separated, of {HOOKS}")
    parser.add_argument("--bucket-mb", type=float, default=None, help="default: DDP's")
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP's gradient_as_bucket_view: gradients live in the buckets, no copies",
    )
    parser.add_argument("--powersgd-rank", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per wait")
    return parser


def _address(args: argparse.Namespace) -> tuple[str, int]:
    if (args.listen is not None) != (args.rank == 0):
        raise LocalError("rank 0 takes --listen HOST, every other rank --store HOST:PORT")
    if args.listen is not None:
        return str(args.listen), 0
    if args.store == "-":  # started before rank 0 knew its port: it comes on stdin
        line = sys.stdin.readline().strip()
        if not line:
            raise LocalError("--store -: stdin closed before rank 0's HOST:PORT came")
        return parse_master(line)
    return parse_master(str(args.store))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    try:
        if args.world < 2 or not 0 <= args.rank < args.world:
            raise LocalError("--world must be at least 2 and --rank in 0..world-1")
        host, port = _address(args)
        figures = measure(
            rank=args.rank,
            world=args.world,
            host=host,
            port=port,
            params=args.params,
            tensors=args.tensors,
            hooks=[h for h in args.hooks.split(",") if h],
            bucket_mb=args.bucket_mb,
            bucket_view=args.bucket_view,
            powersgd_rank=args.powersgd_rank,
            repeats=args.repeats,
            warmup=args.warmup,
            timeout_s=args.timeout,
        )
    except LocalError as exc:
        print(f"cluster sync rank {args.rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as exc:  # a collective failed: the peer is gone or timed out
        print(
            f"cluster sync rank {args.rank}: a collective failed ({exc}); the other rank "
            "probably exited first: see its log",
            file=sys.stderr,
            flush=True,
        )
        return 2
    _emit(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
