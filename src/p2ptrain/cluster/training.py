"""One member's replica of the model, and the training of one generation on it.

Runs on the member's training thread (:mod:`p2ptrain.cluster.runtime` owns the thread). A
generation:

1. joins the generation's gloo process group through the leader's store (a prefix per
   generation), with the cluster's collective timeout, not torch's 30 minutes;
2. makes every replica the plan's source replica: the step counters, the parameters and
   buffers, and the optimizer's state (a JSON header of names, shapes and dtypes, then the
   tensors: nothing pickled) are broadcast from the source rank;
3. wraps the model in DDP with the chosen communication hook from torch
   (``fp16_compress_hook``, PowerSGD with error feedback, ``bf16_compress_hook`` where the
   backend has it, or none) and trains. Each step every rank takes its share of the step's
   samples (a seeded permutation of the training set per epoch; the step's ``batch_size x
   world`` positions, rank ``r`` every ``world``-th from ``r``), the backward pass averages
   the gradients, and one more small all-reduce sums the ranks' losses and their votes to
   end the generation; only then does the optimizer step.

Faults, and what happens: a collective that fails or times out (a member died) raises in
the middle of a step, before the optimizer stepped, so the replica still holds the last
completed step: "the step in flight" is all that is lost. A vote (someone waits to join,
this member leaves) ends the generation for every rank at the same step boundary. Either
way the process group is destroyed and the next generation starts afresh; PowerSGD's error
feedback starts afresh with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from p2ptrain.cluster.interfaces import interface_holding
from p2ptrain.cluster.membership import GenerationPlan
from p2ptrain.cluster.rendezvous import connect_generation_store
from p2ptrain.cluster.settings import (
    BACKEND,
    ClusterSettings,
    choose_compression,
    compression_problem,
)
from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import CLIP_NORM, loss_problem, to_device
from p2ptrain.torch.optimizer_state import flatten_optimizer_state, restore_optimizer_state
from p2ptrain.torch.placement import autocast_context
from p2ptrain.torch.weights import parameter_names
from p2ptrain.torch.workload import TorchWorkload

__all__ = [
    "Outcome",
    "Replica",
    "SampleOrder",
    "StepReport",
    "build_replica",
]

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 1 << 24
_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                               torch.int64, torch.int32, torch.uint8, torch.bool)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepReport:
    generation: int
    step: int
    loss: float
    seconds: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a generation ended: ``reform`` (voted, at a step boundary), ``done`` (the step
    count reached) or ``failed`` (a collective failed: a member is gone)."""

    ended: Literal["reform", "done", "failed"]
    completed_step: int
    reason: str


class SampleOrder:
    """The training set in a seeded random order, a fresh permutation each epoch."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise LocalError("the training dataset is empty; a cluster needs samples")
        self.size, self.seed = size, seed
        self._epochs: dict[int, torch.Tensor] = {}

    def _epoch(self, epoch: int) -> torch.Tensor:
        if epoch not in self._epochs:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epochs = {epoch: torch.randperm(self.size, generator=generator)}
        return self._epochs[epoch]

    def indices(self, start: int, *, rank: int, world: int, count: int) -> list[int]:
        """Rank ``rank``'s ``count`` samples of the step whose positions begin at ``start``:
        positions ``start + rank``, then every ``world``-th."""
        positions = torch.arange(start + rank, start + world * count, world)
        epochs = positions // self.size
        chosen: list[int] = []
        for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):  # the positions only grow
            chosen += self._epoch(epoch)[positions[epochs == epoch] % self.size].tolist()
        return chosen


class Replica:
    """The workload's model and optimizer, the steps they completed and the samples seen."""

    def __init__(
        self,
        workload: TorchWorkload,
        *,
        compression: str,
        collective_timeout_s: float,
        seed: int,
        steps: int | None,
    ) -> None:
        problem = compression_problem(compression, BACKEND)
        if problem is not None:
            raise LocalError(problem)
        self.workload = workload
        self.model: nn.Module = workload.model
        self.optimizer = workload.optimizer
        self.compression = compression
        self.timeout = datetime.timedelta(seconds=collective_timeout_s)
        self.steps = steps
        self.order = SampleOrder(len(workload.train_dataset), seed)
        self.device = next(self.model.parameters()).device
        self._params = parameter_names(self.model)
        self.completed_step = 0
        self.samples_seen = 0
        #: What the gradients travel as in the current generation (``auto``'s choice).
        self.chosen = compression
        #: Failed generations' process groups, kept until they can be released safely
        #: (:meth:`_retire`).
        self._retired: list[tuple[float, Any]] = []

    def run(
        self,
        plan: GenerationPlan,
        rank: int,
        *,
        store: Any,
        vote: Callable[[], bool],
        on_step: Callable[[StepReport], None],
    ) -> Outcome:
        """Train generation ``plan`` as ``rank`` until it ends (see the module docstring).
        ``store`` is the leader's own store on rank 0, None elsewhere."""
        self._bury_released()
        failed = False
        try:
            if store is None:
                store = connect_generation_store(
                    plan.store_host, plan.store_port, self.timeout.total_seconds()
                )
            prefixed = PrefixStore(f"p2ptrain/cluster/{plan.number}/", store)
            dist.init_process_group(
                BACKEND, store=prefixed, rank=rank, world_size=plan.world, timeout=self.timeout
            )
            self._sync(plan.source_rank, rank)
            return self._train(plan, rank, vote, on_step)
        except RuntimeError as exc:  # gloo's failures and timeouts, torch.distributed's
            failed = True
            return Outcome("failed", self.completed_step, _first_line(exc))
        finally:
            if dist.is_initialized():
                if failed:  # see _retire
                    self._retire(dist.group.WORLD)
                with contextlib.suppress(RuntimeError):
                    dist.destroy_process_group()

    def _retire(self, group: Any) -> None:
        """Keep a failed generation's process group referenced for a while (not its DDP
        wrapper, whose hooks must leave the parameters).
        After a collective failed, gloo's worker threads may still hold work of that
        generation (another bucket's all-reduce waiting on the dead member until its
        timeout); were the last reference to the group dropped there, the group's
        destructor would run on that very thread, join it, and abort the process
        ("Resource deadlock avoided"). Released here, on this thread, once every such work
        has surely ended (twice the collective timeout later)."""
        until = time.monotonic() + 2 * self.timeout.total_seconds()
        self._retired.append((until, group))

    def _bury_released(self) -> None:
        now = time.monotonic()
        self._retired = [entry for entry in self._retired if entry[0] > now]

    def _train(
        self,
        plan: GenerationPlan,
        rank: int,
        vote: Callable[[], bool],
        on_step: Callable[[StepReport], None],
    ) -> Outcome:
        compression = self.compression
        if compression == "auto":
            compression = choose_compression(self._probe())
            logger.info("generation %d: gradients travel as %s", plan.number, compression)
        self.chosen = compression
        parameter_mib = sum(p.numel() * p.element_size() for p in self._params.values()) / 2**20
        ddp = DistributedDataParallel(
            self.model,
            init_sync=False,
            # gradients live in DDP's buckets: no copy in or out (nearly raw gloo's speed)
            gradient_as_bucket_view=True,
            # PowerSGD issues its later all-reduces from gloo's threads: with two buckets in
            # flight the ranks can issue them in different orders and wait for each other
            # for good, so under PowerSGD every gradient goes in one bucket
            bucket_cap_mb=parameter_mib + 1 if compression == "powersgd" else None,
        )
        try:
            self._register_hook(ddp, plan, compression)
            ddp.train()  # type: ignore[no-untyped-call]
            while self.steps is None or self.completed_step < self.steps:
                last = self.steps is not None and self.completed_step + 1 >= self.steps
                started = time.perf_counter()
                loss, voted = self._step(ddp, rank, plan.world, vote() or last)
                on_step(StepReport(plan.number, self.completed_step, loss,
                                   time.perf_counter() - started))  # fmt: skip
                if self.steps is not None and self.completed_step >= self.steps:
                    break
                if voted:
                    return Outcome("reform", self.completed_step, "a member voted to re-form")
            return Outcome("done", self.completed_step, f"completed {self.steps} steps")
        finally:
            del ddp  # its reducer's hooks leave the parameters with it

    def _probe(self) -> float:
        """The fp32 bytes per second a plain all-reduce among this generation's members
        synchronises (4 MiB, the median of three after one to warm up; the slowest
        member's, so every member chooses alike)."""
        probe = torch.zeros(1 << 20, dtype=torch.float32)
        seconds = []
        for _ in range(4):
            started = time.perf_counter()
            dist.all_reduce(probe)
            seconds.append(time.perf_counter() - started)
        slowest = torch.tensor([sorted(seconds[1:])[1]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return probe.numel() * probe.element_size() / max(float(slowest), 1e-9)

    def _register_hook(
        self, ddp: DistributedDataParallel, plan: GenerationPlan, compression: str
    ) -> None:
        if compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compression == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=1,
                start_powerSGD_iter=2,  # the least allowed with error feedback
                use_error_feedback=True,
                warm_start=True,
                random_seed=plan.number,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def _step(
        self, ddp: DistributedDataParallel, rank: int, world: int, vote: bool
    ) -> tuple[float, bool]:
        """One step; returns the mean loss over the ranks and whether any rank voted."""
        workload = self.workload
        indices = self.order.indices(
            self.samples_seen, rank=rank, world=world, count=workload.batch_size
        )
        batch = to_device(workload.collate(indices), self.device)
        with autocast_context(self.device, workload.autocast_dtype):
            loss = workload.batch_loss(ddp, batch)
        problem = loss_problem(loss)
        if problem is not None:
            raise LocalError(problem)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM)
        tally = torch.tensor([float(loss.detach()), 1.0 if vote else 0.0], dtype=torch.float64)
        dist.all_reduce(tally)
        self.optimizer.step()
        self.completed_step += 1
        self.samples_seen += workload.batch_size * world
        return float(tally[0]) / world, bool(tally[1] > 0)

    # -- the source's state on every rank ---------------------------------------------------

    def _sync(self, source: int, rank: int) -> None:
        """The source's counters, parameters, buffers and optimizer state on every rank. A
        receiver takes them only once it has all of them: a broadcast that fails half-way
        leaves its replica as it was."""
        mine = rank == source
        counters = torch.tensor([self.completed_step, self.samples_seen], dtype=torch.int64)
        dist.broadcast(counters, src=source)
        tensors = [t.data for t in (*self.model.parameters(), *self.model.buffers())]
        incoming = [t.to("cpu") if mine else torch.empty_like(t, device="cpu") for t in tensors]
        for tensor in incoming:
            dist.broadcast(tensor, src=source)
        state = flatten_optimizer_state(self.optimizer, self._params) if mine else None
        described = None if state is None else [[n, list(t.shape), str(t.dtype)]
                                                 for n, t in state.items()]  # fmt: skip
        header = _broadcast_json(described, source, rank)
        received: dict[str, torch.Tensor] = {}
        for name, shape, dtype in header:
            tensor = state[name] if state is not None else torch.empty(shape, dtype=_dtype(dtype))
            dist.broadcast(tensor, src=source)
            received[name] = tensor
        self.optimizer.zero_grad(set_to_none=True)
        if mine:
            return
        with torch.no_grad():
            for tensor, value in zip(tensors, incoming, strict=True):
                tensor.copy_(value)
        restore_optimizer_state(self.optimizer, self._params, received)
        self.completed_step, self.samples_seen = (int(v) for v in counters.tolist())


def _broadcast_json(value: Any, source: int, rank: int) -> Any:
    """``value`` (JSON) from ``source`` on every rank; ``value`` is None elsewhere."""
    if rank == source:
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=source)
    length = int(size.item())
    if not 0 < length <= _MAX_HEADER_BYTES:
        raise RuntimeError(f"a state header of {length} bytes from rank {source}")
    if rank != source:
        payload = torch.empty(length, dtype=torch.uint8)
    dist.broadcast(payload, src=source)
    return value if rank == source else json.loads(payload.numpy().tobytes())


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise RuntimeError(f"the source rank sent optimizer state of {name}")
    return dtype


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def use_gloo_interface(interface: str) -> None:
    """Make gloo bind ``interface`` (gloo takes its device only from the environment)."""
    os.environ["GLOO_SOCKET_IFNAME"] = interface


def build_replica(settings: ClusterSettings, host: str) -> Replica:
    """This member's replica of ``settings.workload`` (torch threads set, gloo bound to the
    interface that holds ``host``)."""
    from p2ptrain.torch.registry import make_workload

    torch.set_num_threads(settings.threads)
    interface = settings.gloo_interface or interface_holding(host)
    if interface is None:
        raise LocalError(
            f"no interface of this machine holds --host {host}: give one of its IPv4 "
            "addresses (ip -4 addr shows them), or set GLOO_SOCKET_IFNAME"
        )
    use_gloo_interface(interface)
    workload = make_workload(settings.workload, settings.config)
    if not isinstance(workload, TorchWorkload):
        raise LocalError(
            f"workload {settings.workload!r} is a {type(workload).__name__}; a cluster trains "
            "a TorchWorkload's model and optimizer with DDP"
        )
    return Replica(
        workload,
        compression=settings.compression,
        collective_timeout_s=settings.collective_timeout_s,
        seed=settings.seed,
        steps=settings.steps,
    )
