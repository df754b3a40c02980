"""A pod: one trainer made of several trusted ranks on ``torch.distributed``.

A pod is launched by ``torchrun`` (``p2ptrain train --pod-ranks N`` launches it). Rank 0 is
the node: it holds the identity, speaks for the pod on the network and trains its share;
every other rank only trains. Each window, rank 0 tells the ranks what to do on the pod's
*command* group and they all run the inner steps of the window together on the *work*
group:

1. the window's command (steps, seed, learning-rate scale) goes out on the command group,
   a gloo group with a long timeout (between windows the ranks wait there for as long as
   the network takes to certify a head);
2. rank 0 loads the window's base weights and broadcasts them, and, when the pod was just
   formed or rank 0 restored a saved state, its inner optimizer's state;
3. every global minibatch of the window (the same :func:`~.workload.minibatch_plan` a single
   trainer draws) is split into ``world`` consecutive parts; rank 0 collates each part and
   sends it to its rank (the lease's data stays with rank 0: a rank needs no data of its
   own), and every rank runs one inner step on its part under
   :class:`~torch.nn.parallel.DistributedDataParallel`, which averages the gradients, so the
   replicas and their optimizer states stay identical;
4. the losses are summed over the ranks, weighted by the parts' sizes.

So the pod's update is a single trainer's update computed by ``world`` ranks: a 1-rank pod
computes exactly what a trainer computes. The work group runs with the pod's timeout (not
torch's 30 minutes): a rank that dies makes the others' next collective fail within it, the
window fails, and ``torchrun`` restarts the pod.

The workload says how its model is wrapped: a :class:`PodWrapped` workload returns the
module to run (its own wrap); otherwise the model is wrapped in DDP. Batches travel as their
tree of tensors (``torch.utils._pytree``) with a JSON header, never pickled.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from p2ptrain.errors import LocalError
from p2ptrain.torch.batch_loss import BatchLoss, inner_step
from p2ptrain.torch.optimizer_state import flatten_optimizer_state, restore_optimizer_state
from p2ptrain.torch.placement import seeded_rng
from p2ptrain.torch.weights import load_weights, parameter_names, snapshot
from p2ptrain.torch.workload import scale_learning_rates

__all__ = [
    "COMMAND_TIMEOUT",
    "PodGroup",
    "PodReplica",
    "PodSettings",
    "PodUnformed",
    "PodWrapped",
    "follow",
    "pod_settings",
    "split_batch",
]

logger = logging.getLogger(__name__)

#: How long a rank waits for rank 0's next command (a head can take long to certify).
COMMAND_TIMEOUT = datetime.timedelta(days=7)
#: The largest command or header a rank accepts (they are small JSON objects).
_MAX_HEADER_BYTES = 1 << 24
_DTYPES = {str(dtype): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)}  # fmt: skip


class PodUnformed(LocalError):
    """The pod's process group could not be formed (a rank or the store is gone): what
    starts the pod (torchrun, a cluster) may start it again, unlike a usage error."""

    exit_code = 3


@dataclass(frozen=True)
class PodSettings:
    """Where this process sits in its pod (what ``torchrun`` says) and how long a collective
    may take."""

    rank: int
    world_size: int
    local_rank: int = 0
    #: ``torchrun``'s restart count: how many times the pod was restarted.
    restart: int = 0
    #: Seconds a collective of a window may take before the window fails.
    timeout_s: float = 60.0
    #: The store ``torchrun``'s agent hosts for the ranks (``MASTER_ADDR:MASTER_PORT``
    #: with ``TORCHELASTIC_USE_AGENT_STORE``); None: ``init_method="env://"``.
    agent_store: tuple[str, int] | None = None
    #: How the ranks wrap the model: ``ddp``, ``fsdp2``, or None for the workload's choice.
    wrap: str | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise LocalError(
                f"pod rank {self.rank} of {self.world_size}: the rank must be in "
                "[0, world size); start the pod with torchrun or --pod-ranks N"
            )
        if not 0 < self.timeout_s <= 3600:
            raise LocalError(f"--pod-timeout-s {self.timeout_s:g}: use a value in (0, 3600]")
        if self.wrap not in (None, "ddp", "fsdp2"):
            raise LocalError(f"--pod-wrap {self.wrap!r}: use ddp or fsdp2")


def pod_settings(
    environ: Mapping[str, str], *, timeout_s: float, wrap: str | None = None
) -> PodSettings:
    """A rank's :class:`PodSettings` from the variables ``torchrun`` sets in its
    environment (``environ``, given by the program that reads it)."""
    try:
        agent_store = None
        if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            agent_store = (environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
        return PodSettings(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            timeout_s=timeout_s,
            agent_store=agent_store,
            wrap=wrap,
        )
    except (KeyError, ValueError) as exc:
        raise LocalError(
            f"this trainer runs under torchrun, but RANK / WORLD_SIZE are missing or not "
            f"numbers ({exc}); start it with torchrun --nproc-per-node N -m p2ptrain train ... "
            "or p2ptrain train --pod-ranks N"
        ) from exc


@runtime_checkable
class PodWrapped(Protocol):
    """A workload that wraps its model for a pod itself (FSDP, tensor parallel, its own
    DDP options): returns the module every inner step runs, over ``group``, the pod's work
    process group. Its parameters must stay the workload's (loaded and read by name)."""

    def wrap_for_pod(self, model: nn.Module, group: dist.ProcessGroup) -> nn.Module: ...


class PodGroup:
    """The pod's two process groups: *commands* (the default group: gloo,
    :data:`COMMAND_TIMEOUT`) and *work* (the device's backend, the pod's timeout)."""

    def __init__(self, settings: PodSettings, device: torch.device) -> None:
        self.settings = settings
        self.rank, self.world = settings.rank, settings.world_size
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        #: Where tensors travel from: NCCL sends device tensors, gloo CPU ones.
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        try:
            # the default group carries the commands: a rank waits there until rank 0 has
            # joined the network, and then between windows for as long as a head takes
            if settings.agent_store is None:
                dist.init_process_group(
                    "gloo",
                    init_method="env://",
                    rank=self.rank,
                    world_size=self.world,
                    timeout=COMMAND_TIMEOUT,
                )
            else:  # keys of its own each time torchrun starts the pod: none left from before
                host, port = settings.agent_store
                agent = TCPStore(host, port, self.world, False, timeout=COMMAND_TIMEOUT)
                store = PrefixStore(f"p2ptrain/pod/{settings.restart}", agent)
                dist.init_process_group(
                    "gloo", store=store, rank=self.rank, world_size=self.world,
                    timeout=COMMAND_TIMEOUT,
                )  # fmt: skip
        except (RuntimeError, ValueError) as exc:
            raise PodUnformed(
                f"pod rank {self.rank}: cannot form the pod's process group ({exc}); start "
                "the pod with torchrun (p2ptrain train --pod-ranks N does), and check that "
                "every rank reaches the pod's store"
            ) from exc
        commands = dist.group.WORLD
        assert commands is not None
        self.commands: dist.ProcessGroup = commands
        work = dist.new_group(
            backend=self.backend, timeout=datetime.timedelta(seconds=settings.timeout_s)
        )
        assert isinstance(work, dist.ProcessGroup)
        self.work: dist.ProcessGroup = work

    # -- commands (rank 0 to every rank) ---------------------------------------------------

    def send_command(self, command: Mapping[str, Any]) -> None:
        """Rank 0: tell every rank ``command`` (a JSON object), within the pod's timeout (a
        rank that stalls or died fails it)."""
        timeout = datetime.timedelta(seconds=self.settings.timeout_s)
        self._broadcast_json(dict(command), self.commands, torch.device("cpu"), timeout)

    def receive_command(self) -> dict[str, Any]:
        """A rank > 0: wait for rank 0's next command."""
        return self._broadcast_json(None, self.commands, torch.device("cpu"))

    def barrier(self) -> None:
        """Every rank got here (on the command group: a rank may take long to build)."""
        dist.barrier(group=self.commands)

    def _broadcast_json(
        self,
        value: dict[str, Any] | None,
        group: dist.ProcessGroup,
        device: torch.device,
        timeout: datetime.timedelta | None = None,
    ) -> dict[str, Any]:
        """Rank 0's ``value`` on every rank (rank 0 waits at most ``timeout``, when given)."""

        def broadcast(tensor: torch.Tensor) -> None:
            work = dist.broadcast(tensor, src=0, group=group, async_op=timeout is not None)
            if work is not None:
                work.wait(timeout=timeout)

        if self.rank == 0:
            assert value is not None
            payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        broadcast(size)
        length = int(size.item())
        if not 0 < length <= _MAX_HEADER_BYTES:
            raise LocalError(f"pod rank {self.rank}: a header of {length} bytes from rank 0")
        if self.rank != 0:
            payload = torch.empty(length, dtype=torch.uint8)
        buffer = payload.to(device)
        broadcast(buffer)
        if self.rank == 0:
            assert value is not None
            return value
        decoded: dict[str, Any] = json.loads(buffer.cpu().numpy().tobytes())
        return decoded

    # -- tensors of a window ---------------------------------------------------------------

    def broadcast_tensors(
        self, tensors: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """Rank 0's named tensors on every rank (``tensors`` on rank 0, None elsewhere)."""
        if self.rank == 0:
            assert tensors is not None
            described = [[n, list(t.shape), str(t.dtype)] for n, t in tensors.items()]
            self._broadcast_json({"tensors": described}, self.work, self.device)
            out = dict(tensors)
        else:
            header = self._broadcast_json(None, self.work, self.device)
            out = {
                str(name): torch.empty([int(x) for x in shape], dtype=_dtype(str(dtype)))
                for name, shape, dtype in header["tensors"]
            }
        for name, tensor in out.items():
            moved = tensor.to(self.device)
            dist.broadcast(moved, src=0, group=self.work)
            out[name] = moved.cpu() if self.rank != 0 else tensor
        return out

    def send_batch(self, batch: Any, size: int, to_rank: int) -> None:
        """Rank 0: one collated batch of ``size`` samples (a tree of tensors and JSON
        values) to ``to_rank``."""
        leaves, spec = pytree.tree_flatten(batch)
        described: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                described.append({"shape": list(leaf.shape), "dtype": str(leaf.dtype)})
            elif leaf is None or isinstance(leaf, bool | int | float | str):
                described.append({"value": leaf})
            else:
                raise LocalError(
                    f"a batch holds a {type(leaf).__name__}, which a pod cannot send to its "
                    "ranks: collate batches into tensors, numbers and strings"
                )
        header = json.dumps(
            {"size": size, "spec": pytree.treespec_dumps(spec), "leaves": described}
        ).encode()
        payload = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        dist.send(length, dst=to_rank, group=self.work)
        dist.send(payload.to(self.device), dst=to_rank, group=self.work)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                dist.send(leaf.to(self.device).contiguous(), dst=to_rank, group=self.work)

    def receive_batch(self) -> tuple[Any, int]:
        """A rank > 0: the batch rank 0 sent it, and its number of samples."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src=0, group=self.work)
        length = int(size.item())
        if not 0 < length <= _MAX_HEADER_BYTES:
            raise LocalError(f"pod rank {self.rank}: a batch header of {length} bytes")
        payload = torch.empty(length, dtype=torch.uint8, device=self.device)
        dist.recv(payload, src=0, group=self.work)
        header = json.loads(payload.cpu().numpy().tobytes())
        leaves: list[Any] = []
        for leaf in header["leaves"]:
            if "value" in leaf:
                leaves.append(leaf["value"])
                continue
            tensor = torch.empty(leaf["shape"], dtype=_dtype(leaf["dtype"]), device=self.device)
            dist.recv(tensor, src=0, group=self.work)
            leaves.append(tensor)
        batch = pytree.tree_unflatten(leaves, pytree.treespec_loads(header["spec"]))
        return batch, int(header["size"])

    def sum_losses(self, weighted: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each rank's size-weighted step losses."""
        moved = weighted.to(self.device, torch.float64)
        dist.all_reduce(moved, group=self.work)
        return moved.cpu()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise LocalError(f"a pod cannot send tensors of {name}")
    return dtype


def split_batch(indices: Sequence[int], parts: int) -> list[list[int]]:
    """``indices`` cut into ``parts`` consecutive runs whose sizes differ by at most one
    (the first ones larger)."""
    size, extra = divmod(len(indices), parts)
    cuts, start = [], 0
    for part in range(parts):
        end = start + size + (1 if part < extra else 0)
        cuts.append(list(indices[start:end]))
        start = end
    return cuts


class PodReplica:
    """One rank's replica of the pod's model, wrapped in DDP (or by the workload's own
    :class:`PodWrapped` hook), and the inner steps of a window on the rank's parts of the
    minibatches. :class:`~p2ptrain.torch.pod_fsdp.ShardedReplica` shards it instead."""

    #: The wrap, as ``--pod-wrap`` names it.
    wrap = "ddp"

    def __init__(self, group: PodGroup, workload: Any, *, batch_size: int) -> None:
        if batch_size < group.world:
            raise LocalError(
                f"a pod of {group.world} ranks splits every minibatch among its ranks, and the "
                f"experiment's batches hold {batch_size} samples: use at most {batch_size} ranks"
            )
        self.group = group
        self.workload = workload
        self.model: nn.Module = workload.model
        self.optimizer: torch.optim.Optimizer = workload.optimizer
        self.base_lrs: tuple[float, ...] = tuple(workload.base_lrs)
        self.batch_loss: BatchLoss = workload.batch_loss
        self.autocast_dtype: torch.dtype | None = workload.autocast_dtype
        self.params = parameter_names(self.model)
        self.device = next(self.model.parameters()).device
        self.wrapped = self._wrap(workload)

    def _wrap(self, workload: Any) -> nn.Module:
        if isinstance(workload, PodWrapped):
            return workload.wrap_for_pod(self.model, self.group.work)
        return DistributedDataParallel(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self.group.work,
        )

    def begin(
        self,
        command: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor] | None,
        optimizer_state: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """Start a window: rank 0's weights (and optimizer state, when the command says so)
        on every rank, and the command's learning-rate scale."""
        self.load_weights(weights)
        if command.get("sync_optimizer"):
            self.load_optimizer_state(optimizer_state)
        scale = command.get("lr_scale")
        if scale is not None:
            scale_learning_rates(self.optimizer, self.base_lrs, float(scale))

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Rank 0's ``weights`` (None on the other ranks) into every rank's replica."""
        if self.group.rank == 0:
            assert weights is not None
            load_weights(self.params, weights)
        with torch.no_grad():
            for param in self.params.values():
                data = param.data
                moved = data.to(self.group.device)
                dist.broadcast(moved, src=0, group=self.group.work)
                if moved.data_ptr() != data.data_ptr():
                    data.copy_(moved)

    def load_optimizer_state(self, state: Mapping[str, torch.Tensor] | None) -> None:
        """Rank 0's optimizer ``state`` (None on the other ranks) into every rank's."""
        tensors = self.group.broadcast_tensors(state if self.group.rank == 0 else None)
        restore_optimizer_state(self.optimizer, self.params, tensors)

    def steps(self, command: Mapping[str, Any], batches: Iterator[tuple[Any, int]]) -> list[float]:
        """Run the window's steps, one per ``(batch, size)``; the losses of the pod's steps
        (every rank's, weighted by the sizes of their parts), known on every rank."""
        seed = int(command["seed"]) + self.group.rank  # rank 0 draws a single trainer's masks
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        self.wrapped.train()
        with seeded_rng(self.device, seed):
            for batch, size in batches:
                loss = inner_step(
                    self.wrapped, self.optimizer, batch, self.batch_loss, self.autocast_dtype
                )
                losses.append(loss)
                sizes.append(size)
        weighted = torch.stack(losses).double().cpu() * torch.tensor(sizes, dtype=torch.float64)
        totals = self.group.sum_losses(weighted)
        counts = self.group.sum_losses(torch.tensor(sizes, dtype=torch.float64))
        values: list[float] = (totals / counts).tolist()
        return values

    def end(self) -> None:
        """After the window's steps, on every rank (a sharded replica gathers here what
        rank 0 reads next)."""

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the replica's weights after the window (float32 CPU copies)."""
        return snapshot(self.params)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Rank 0: the optimizer state after the window, flat (as a trainer saves it)."""
        return flatten_optimizer_state(self.optimizer, self.params)


def follow(
    group: PodGroup, replica: PodReplica, on_window: Callable[[dict[str, Any]], None]
) -> int:
    """A rank > 0: train every window rank 0 commands until it says stop; returns the
    windows trained."""
    trained = 0
    while True:
        command = group.receive_command()
        kind = command.get("kind")
        if kind == "stop":
            return trained
        if kind != "window":
            raise LocalError(f"pod rank {group.rank}: an unknown command {kind!r} from rank 0")
        on_window(command)
        replica.begin(command, None, None)
        steps = int(command["steps"])
        replica.steps(command, (group.receive_batch() for _ in range(steps)))
        replica.end()
        trained += 1
