"""A trainer made of a pod of ranks: rank 0's workload, and the loop of every other rank.

Rank 0 is an ordinary node whose trainer's workload is a :class:`PodWorkload`: the node's
workload, checked against the experiment as any trainer's, whose :meth:`train_window` runs
the window on every rank of the pod (:mod:`p2ptrain.torch.pod`). Everything else (the
weights it starts from, the initial weights, the optimizer state it saves, the data it
leases) is the node's workload's. The other ranks run :func:`run_pod_rank`: they are told
the experiment by rank 0, build its workload the way any trainer does (the same
``--workload``), and train each window rank 0 commands until it says stop.

A rank that dies fails the window in flight: rank 0's next collective raises within the
pod's timeout (the trainer records the window's failure, as for any role failure), and
``torchrun`` restarts the whole pod, which resumes from the node's saved state. When
``torchrun`` stops rank 0 before it could record the failure, the trainer records it as it
starts again (:meth:`~p2ptrain.node.persist.NodeStore.interrupted_window`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest
from p2ptrain.data.pipelines import DataPipeline
from p2ptrain.driver.failures import EndsTheNode
from p2ptrain.errors import LocalError
from p2ptrain.node.setup import NodeSettings
from p2ptrain.node.workload_check import build_workload
from p2ptrain.torch.placement import resolve_device
from p2ptrain.torch.pod import PodGroup, PodReplica, PodSettings, follow, split_batch
from p2ptrain.torch.workload import (
    LOSS_AFTER_STEPS,
    TorchWorkload,
    WindowResult,
    Workload,
    minibatch_plan,
)

__all__ = ["PodBroken", "PodWorkload", "form_pod", "run_pod_rank"]

logger = logging.getLogger(__name__)

_MAX_MANIFEST_BYTES = 1 << 24


def _torch_workload(workload: Workload, rank: int) -> TorchWorkload:
    if not isinstance(workload, TorchWorkload):
        raise LocalError(
            f"pod rank {rank}: a pod trains a TorchWorkload (the model, optimizer and data "
            f"every factory's parts become); this workload is a {type(workload).__name__}: "
            "train it without --pod-ranks, or build it as a p2ptrain.TorchWorkload"
        )
    return workload


class PodBroken(EndsTheNode):
    """A collective of the pod's window failed: a rank died, stalled past the pod's timeout
    or raised. The window fails, and the node stops so that torchrun starts the pod again."""

    def __init__(self, world: int, timeout_s: float, cause: BaseException) -> None:
        super().__init__(
            f"a rank of this pod of {world} stopped answering within {timeout_s:g} s or "
            f"failed ({str(cause).splitlines()[0][:200]}); the node stops so that torchrun "
            "starts the pod again from its saved state (see the other ranks' log lines; "
            "--pod-timeout-s sets how long a collective may take)"
        )


class PodWorkload:
    """Rank 0's workload: ``inner`` (the node's own, checked), whose windows the whole pod
    trains."""

    def __init__(self, inner: TorchWorkload, group: PodGroup, replica: PodReplica) -> None:
        self.inner = inner
        self.group = group
        self.replica = replica
        self._lr_scale: float | None = None
        #: A restored optimizer state, loaded into every rank at the next window.
        self._restored: dict[str, torch.Tensor] | None = None
        #: Why the pod's process groups can no longer be used (a collective failed).
        self.broken: BaseException | None = None

    @property
    def world_size(self) -> int:
        return self.group.world

    # -- the window, on every rank ---------------------------------------------------------

    def train_window(
        self,
        weights: Mapping[str, torch.Tensor],
        indices: Sequence[int],
        *,
        steps: int,
        seed: int,
    ) -> WindowResult:
        inner = self.inner
        plan = minibatch_plan(indices, steps=steps, batch_size=inner.batch_size, seed=seed)
        state, self._restored = self._restored, None
        command = {
            "kind": "window",
            "steps": steps,
            "seed": seed,
            "lr_scale": self._lr_scale,
            "sync_optimizer": bool(state),
        }
        try:
            self.group.send_command(command)
            self.replica.begin(command, weights, state)
            losses = self.replica.steps(command, self._parts(plan))
            self.replica.end()
        except RuntimeError as exc:  # a collective failed: a rank died, stalled or erred
            self.broken = exc
            raise PodBroken(self.group.world, self.group.settings.timeout_s, exc) from exc
        tail = losses[-LOSS_AFTER_STEPS:]
        return WindowResult(
            weights=self.replica.weights(),
            loss_before=losses[0],
            loss_after=sum(tail) / len(tail),
            samples=steps * inner.batch_size,
        )

    def _parts(self, plan: list[list[int]]) -> Iterator[tuple[Any, int]]:
        """Each minibatch cut among the ranks: the other ranks' parts sent, ours yielded."""
        for batch in plan:
            parts = split_batch(batch, self.group.world)
            for rank in range(1, self.group.world):
                self.group.send_batch(self.inner.collate(parts[rank]), len(parts[rank]), rank)
            yield self.inner.collate(parts[0]), len(parts[0])

    def close(self) -> None:
        """Tell the other ranks to stop, and leave the pod's process groups (a broken pod
        is left as it is: torchrun ends its ranks)."""
        if self.broken is not None:
            return
        try:
            self.group.send_command({"kind": "stop"})
        except RuntimeError as exc:  # a rank is gone already: torchrun ends the others
            logger.warning("pod: the ranks could not be told to stop: %s", exc)
            return
        self.group.close()

    # -- everything else is rank 0's workload's --------------------------------------------

    def set_lr_scale(self, scale: float) -> None:
        self._lr_scale = scale
        self.inner.set_lr_scale(scale)

    @property
    def base_lrs(self) -> tuple[float, ...]:
        return self.inner.base_lrs

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The pod's inner optimizer state after the last window (what the trainer saves)."""
        return self.replica.optimizer_state()

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A saved state, loaded into every rank when the next window begins."""
        self._restored = dict(tensors)

    def initial_weights(self) -> dict[str, torch.Tensor]:
        return self.inner.initial_weights()

    def dataset_manifest(self) -> DatasetManifest:
        return self.inner.dataset_manifest()

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> float:
        return self.inner.evaluate(weights)

    @property
    def val_from_data(self) -> bool:
        return self.inner.val_from_data

    @property
    def data(self) -> DataPipeline | None:
        return self.inner.data

    def use_data(self, pipeline: DataPipeline) -> None:
        self.inner.use_data(pipeline)

    @property
    def validation_missing(self) -> str | None:
        return self.inner.validation_missing


def _make_replica(group: PodGroup, workload: TorchWorkload, wrap: str) -> PodReplica:
    """The workload's model wrapped for the pod. torch.distributed's FSDP and checkpoint
    modules are imported here, when a pod forms: importing them takes every process that
    loads this module (each trainer) a second and a half."""
    from p2ptrain.torch.pod_fsdp import make_replica

    return make_replica(group, workload, batch_size=workload.batch_size, wrap=wrap)


def form_pod(pod: PodSettings, workload: Workload, manifest: ExperimentManifest) -> PodWorkload:
    """Rank 0: form the pod's process groups, tell the ranks the experiment and the wrap,
    wait until each built its workload, and wrap the model (blocking: run it off the event
    loop)."""
    inner = _torch_workload(workload, 0)
    wrap = pod.wrap or inner.pod_wrap
    group = PodGroup(pod, inner.device)
    try:
        command = {"kind": "experiment", "manifest": encode(manifest).hex(), "wrap": wrap}
        group.send_command(command)
        group.barrier()
        replica = _make_replica(group, inner, wrap)
    except BaseException:
        group.close()
        raise
    logger.info("pod of %d ranks formed (%s, %s)", group.world, group.backend, wrap)
    return PodWorkload(inner, group, replica)


def run_pod_rank(settings: NodeSettings, pod: PodSettings) -> int:
    """A rank > 0: build the experiment's workload (rank 0 says which experiment) and train
    every window rank 0 commands; returns the windows trained."""
    torch.set_num_threads(settings.threads)
    device = resolve_device(settings.device)
    group = PodGroup(pod, device)
    try:
        command = group.receive_command()
        if command.get("kind") != "experiment":
            raise LocalError(f"pod rank {pod.rank}: rank 0 sent {command.get('kind')!r} first")
        manifest = decode(
            ExperimentManifest,
            bytes.fromhex(str(command["manifest"])),
            max_bytes=_MAX_MANIFEST_BYTES,
        )
        workload = _torch_workload(build_workload(manifest, settings.workload), pod.rank)
        if device.type != "cpu":
            workload.place(device)
        group.barrier()
        wrap = str(command.get("wrap", "ddp"))
        replica = _make_replica(group, workload, wrap)
        logger.info("pod rank %d of %d: ready (pid in the pod's log)", pod.rank, pod.world_size)

        def starting(window: dict[str, Any]) -> None:
            logger.info("pod rank %d: training a window (%s steps)", pod.rank, window["steps"])

        return follow(group, replica, starting)
    finally:
        group.close()
