"""The trainer role: train each window from the canonical head, publish the update.

Training runs in a worker thread (the event loop keeps answering the network): the lease's
samples, the inner steps of the workload, Δ = θ_base - θ_local, its encoding with the
experiment's codec. The inner optimizer state is saved after each window. A trainer without
a server of its own pushes its update blob to a reachable peer (a seed first) before it
gossips the signed update.

Training a window is the role's main step: a window whose training raises is recorded as
that window's error (see :mod:`.failures`) and no update goes out for it; the trainer trains
the next window once the network certifies one without it, or, if the head has not moved
after the policy's back-off (2, 4, ... s), the same window again.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from p2ptrain.aggregate.codecs import WindowEncoders
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed
from p2ptrain.core.manifests import InnerOptimizerSpec, ShardInfo
from p2ptrain.core.tensors import schema_of
from p2ptrain.data.shards import lease_indices
from p2ptrain.driver.failures import FailureBook
from p2ptrain.driver.runner import RoleRunner, Step
from p2ptrain.driver.services import PeerServices
from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.shard_cache import ShardCache
from p2ptrain.node.trainer_window import TrainedUpdate, restore_trainer_state, train_update
from p2ptrain.observe.events import (
    NodeEvent,
    Published,
    ShardsFetched,
    Trained,
    TrainingStarted,
    compute_utilisation,
)
from p2ptrain.observe.status import DataStatus, TrainerWindow
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.effects import Publish, TrainLater
from p2ptrain.protocol.leases import Lease
from p2ptrain.protocol.policy import TrainerPolicy
from p2ptrain.protocol.reduction import BaseState
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.torch.capabilities import PreparedDataUser, RateScheduled
from p2ptrain.torch.workload import Workload

__all__ = [
    "TRAIN_STEP",
    "TrainerRunner",
    "TrainingInterrupted",
    "inner_lr_scaler",
    "warn_if_other_lr",
    "window_seed",
]

logger = logging.getLogger(__name__)

#: How long an update said again waits for a gossip connection (a seed restarting).
_RESEND_WAIT_S = 60.0

TRAIN_STEP = "training"


def window_seed(peer_id: str, window: int) -> int:
    """The seed of a trainer's minibatch order in a window (the demo's DDP baseline draws
    the same minibatches with it)."""
    digest = hashlib.sha256(f"p2ptrain/v1/batches\0{peer_id}\0{window}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def inner_lr_scaler(workload: Workload, spec: InnerOptimizerSpec) -> Callable[[float], None] | None:
    """How this trainer follows the manifest's inner schedule (None: the rate never
    changes), or :class:`LocalError` when the workload cannot change its rate."""
    if not spec.scheduled:
        return None
    if not isinstance(workload, RateScheduled):
        raise LocalError(
            f"the experiment schedules the inner learning rate ({spec.schedule}, "
            f"{spec.warmup_windows} warm-up windows), but the workload "
            f"{type(workload).__name__} has no set_lr_scale(scale); build it as a "
            "p2ptrain.TorchWorkload or give it that method"
        )
    return workload.set_lr_scale


def warn_if_other_lr(workload: Workload, spec: InnerOptimizerSpec) -> str | None:
    """Warn once (and return the warning) when no parameter group of the workload's
    optimizer was built with the experiment's ``inner_optimizer.lr``: the trainer trains at
    its optimizer's rates (times the schedule), so trainers of one experiment may differ."""
    rates = workload.base_lrs if isinstance(workload, RateScheduled) else ()
    if not rates or any(math.isclose(r, spec.lr, rel_tol=1e-6) for r in rates):
        return None
    shown = ", ".join(f"{r:g}" for r in sorted(set(rates)))
    warning = (
        f"this trainer's optimizer was built with learning rate {shown}, the experiment's "
        f"inner_optimizer.lr is {spec.lr:g}; it trains at {shown} (times the experiment's "
        "schedule): build the optimizer with the experiment's rate to train like the others"
    )
    logger.warning("%s", warning)
    return warning


class TrainingInterrupted(LocalError):
    """The trainer was killed while training a window (a rank of its pod died, it ran out
    of memory): that window's update was never sent."""

    def __init__(self, window: int) -> None:
        super().__init__(
            f"the trainer was stopped while training window {window} (a rank of its pod "
            "died, or the process was killed); no update was sent for it, and it trains the "
            "next window from its saved state"
        )
        self.window = window


class TrainerRunner(RoleRunner):
    main_step = TRAIN_STEP
    machine: TrainerMachine
    policy: TrainerPolicy

    def __init__(
        self,
        machine: TrainerMachine,
        workload: Workload,
        services: PeerServices,
        failures: FailureBook,
        emit: Callable[[NodeEvent], None],
        *,
        store: NodeStore,
        shards: ShardCache | None = None,
    ) -> None:
        """``store``: the node's (the trainer's state is saved there); ``shards``: the cache
        of a ``sharded`` experiment's shards (the lease's shards are fetched into it before
        each window)."""
        super().__init__("trainer", machine, services, failures, emit)
        self.workload = workload
        self.store = store
        self.shards = shards
        self.manifest = machine.manifest
        self.peer_id = services.peer_id
        self._lr_scale = inner_lr_scaler(workload, self.manifest.inner_optimizer)
        warn_if_other_lr(workload, self.manifest.inner_optimizer)
        genesis = machine.base.weights
        self._encoders = WindowEncoders(
            self.manifest.codec, schema_of(genesis), seed=window_seed(self.peer_id, 0)
        )
        #: The encoder of the next window to train (the codec changes after a dense warm-up).
        self._encoder = self._encoders.at(machine.base.head.height + 1)
        self._train_ready = asyncio.Event()
        self._pending: act.Train | None = None
        #: The head a Train names, as the machine held it when it asked (a trainer ahead
        #: of the chain may start after the head moved on).
        self._train_base: BaseState = machine.base
        #: Our published updates whose window is not certified yet (id, blob), and the
        #: blobs of those the chain did not accept, for the worker thread to requeue.
        self._unsettled: dict[int, tuple[str, bytes]] = {}
        self._requeue: list[bytes] = []
        #: Every window trained (its compute utilisation is in the status).
        self._trained: list[Trained] = []
        #: Our own pseudo-gradients of windows no certified head we hold includes yet.
        self._own: dict[int, dict[str, torch.Tensor]] = {}
        #: Our update blobs being pushed to a reachable peer (the collector keeps them).
        self.pushing: set[str] = set()

    def forever(self) -> Iterator[tuple[str, Step]]:
        yield "waiting to train", self._train_forever()

    def start(self, now: float) -> None:
        """Train the window after the head we hold (restored or genesis); a window whose
        training the last run did not finish (it was killed) is recorded as failed."""
        restore_trainer_state(self.store, self.services.experiment_id, self.workload, self._encoder)
        interrupted = self.store.interrupted_training()
        if interrupted is not None:
            self.failed(TRAIN_STEP, interrupted, TrainingInterrupted(interrupted))
        super().start(now)

    def handlers(self) -> dict[type[Any], Callable[[Any], object]]:
        handlers = super().handlers()
        adopted, publish = handlers[act.Adopted], handlers[Publish]

        def settled(effect: act.Adopted) -> None:
            self._settle(effect)
            adopted(effect)

        def update_or(effect: Publish) -> None:
            if effect.blob is None:
                publish(effect)
            else:  # our update: it goes out once a peer can fetch its blob
                self.spawn(self._publish(effect), "publishing an update", self.window)

        return {
            **handlers,
            act.Adopted: settled,
            act.Train: self._to_train,
            Publish: update_or,
            TrainLater: lambda e: self.spawn(
                self._train_later(e), "waiting to train again", e.train.window
            ),
        }

    def _to_train(self, effect: act.Train) -> None:
        if self.machine.base.head_id == effect.base_head:
            self._train_base = self.machine.base
        self._pending = effect
        self._train_ready.set()

    def base_moved(self, adopted: act.Adopted) -> None:
        self._settle(adopted)
        super().base_moved(adopted)

    async def _train_forever(self) -> None:
        machine = self.machine
        while True:
            await self._train_ready.wait()
            self._train_ready.clear()
            action, self._pending = self._pending, None
            if action is None or not machine.training(action):
                continue
            failures = self.failures.in_a_row(self.role)
            with self.guard(TRAIN_STEP, action.window):
                await self._train(action)
            in_a_row = self.failures.in_a_row(self.role)
            if in_a_row > failures:
                self.execute(self.policy.train_failed(time.monotonic(), action, in_a_row))

    async def _train_later(self, effect: TrainLater) -> None:
        """Training raised: the policy offers the same window again after a back-off, unless
        a newer head came first (a network waiting for this trainer is not left stalled)."""
        await asyncio.sleep(effect.delay_s)
        if self._pending is None:
            self.execute(self.policy.train_due(time.monotonic(), effect.train))

    async def _train(self, action: act.Train) -> None:
        base = self._train_base
        if base.head_id != action.base_head:
            return  # asked before the head we hold now: a newer Train follows
        started = time.monotonic()
        await self._lease_data(self.machine.lease(action.window))
        self.emit(
            TrainingStarted(
                peer_id=self.peer_id,
                window=action.window,
                data_seconds=round(time.monotonic() - started, 3),
            )
        )
        self.store.begin_training(action.window)
        try:
            update = await asyncio.to_thread(self._train_window, action, base)
        finally:
            self.store.end_training()
        blob, before, after = update.blob, update.loss_before, update.loss_after
        trained = Trained(
            peer_id=self.peer_id,
            window=action.window,
            loss_before=before,
            loss_after=after,
            seconds=round(time.monotonic() - started, 2),
            blob_bytes=len(blob),
            inner_seconds=round(update.inner_seconds, 4),
            inner_ended_at=update.inner_ended_at,
        )
        self._trained.append(trained)
        share = compute_utilisation(self._trained)
        self.last_trained = TrainerWindow(
            window=action.window,
            loss_before=before,
            loss_after=after,
            seconds=trained.seconds,
            blob_bytes=len(blob),
            compute_utilisation=None if share is None else round(share, 4),
        )
        self.emit(trained)
        self.execute(self.policy.trained(time.monotonic(), action, blob, before, after))

    async def _lease_data(self, lease: Lease) -> None:
        """Fetch the prepared shards ``lease`` names that this node does not hold (each
        verified by its hash; a peer that served other bytes is reported), then record the
        lease in the cache, which evicts the least recently leased shards past its size."""
        cache = self.shards
        if cache is None:
            return
        named = [cache.shard(name) for name in lease.shards]
        missing = [s for s in named if not await asyncio.to_thread(cache.held, s)]
        if missing:
            started = time.monotonic()

            async def fetch(shard: ShardInfo) -> int:
                result = await self.services.download(shard.blob_id, size=shard.bytes, kind="shard")
                downloaded = 0 if result is None else sum(result.bytes_by_provider.values())
                cache.fetched(shard, downloaded)
                return downloaded

            downloaded = await asyncio.gather(*(fetch(shard) for shard in missing))
            self.emit(
                ShardsFetched(
                    peer_id=self.peer_id,
                    window=lease.window,
                    shards=tuple(s.name for s in missing),
                    bytes=sum(downloaded),
                    seconds=round(time.monotonic() - started, 3),
                )
            )
        cache.leased(lease.shards)

    def data_status(self) -> DataStatus | None:
        """What the trainer trains on, and (prepared shards) what it holds and fetched."""
        if not isinstance(self.workload, PreparedDataUser) or self.workload.data is None:
            return None
        said = self.workload.data.describe()
        if self.shards is None:
            return DataStatus(kind=said.kind, descriptor=said.descriptor, location=said.location)
        return self.shards.status(said.kind, said.descriptor, said.location)

    def _train_window(self, action: act.Train, base: BaseState) -> TrainedUpdate:
        """In a worker thread: the inner steps, the pseudo-gradient, its encoding."""
        lease = self.machine.lease(action.window)
        if isinstance(self.workload, PreparedDataUser) and self.workload.data is not None:
            self.workload.data.begin_lease(lease)
        indices = lease_indices(self.manifest.dataset, lease)
        metadata = {"window": str(action.window), "experiment": self.services.experiment_id}
        self._encoder = self._encoders.at(action.window)
        requeue, self._requeue = self._requeue, []
        for blob in requeue:  # here, in the thread that encodes: never during an encode
            self._encoder.requeue_unaccepted(blob)
        ahead = self.manifest.window.staleness > 0
        if self._lr_scale is not None:
            self._lr_scale(self.manifest.inner_optimizer.lr_scale(action.window))
        update = train_update(
            self.workload,
            self._encoder,
            self._start_weights(action.window, base),
            indices,
            steps=self.manifest.inner_steps,
            seed=window_seed(self.peer_id, action.window),
            save_state=lambda state: self.store.save_trainer_state(state, metadata),
            keep_delta=ahead,
        )
        if update.delta is not None:
            self._own[action.window] = update.delta
        return update._replace(delta=None)

    def _start_weights(self, window: int, base: BaseState) -> Mapping[str, torch.Tensor]:
        """Where window ``window`` starts: the base head's weights, minus our own
        pseudo-gradients of the windows between that head and this one (trained, published,
        not yet in a certified head), so a trainer ahead of the chain goes on from its own
        progress instead of discarding it. The update is still ``start - end``: only this
        window's work."""
        for old in [w for w in self._own if w <= base.head.height]:
            del self._own[old]
        pending = [self._own[w] for w in range(base.head.height + 1, window) if w in self._own]
        if not pending:
            return base.weights
        start = {name: tensor.clone() for name, tensor in base.weights.items()}
        for delta in pending:
            for name, tensor in start.items():
                tensor.sub_(delta[name])
        return start

    async def _publish(self, effect: Publish) -> None:
        """The blob is stored (an earlier effect); one that no peer could fetch from us is
        pushed to a reachable peer before the update goes out."""
        services = self.services
        signed, blob = effect.record, effect.blob
        assert isinstance(signed, Signed) and blob is not None
        window, blob_id = signed.record.window, sha256_hex(blob)
        if services.net.address is None:
            self.pushing.add(blob_id)  # the collector keeps it meanwhile
            try:
                dropped = functools.partial(self._push_dropped, blob_id, window)
                pushed = await services.push_blob(blob_id, dropped, window)
            finally:
                self.pushing.discard(blob_id)
            if not pushed:
                return
        if effect.again:
            # said again because no proposal named it: it must reach someone this time
            async with asyncio.timeout(_RESEND_WAIT_S):
                await services.net.wait_connected()
            services.publish("update", signed, again=True)
            logger.info(
                "window %d: update %s sent again", signed.record.window, signed.record_id[:12]
            )
            return
        services.publish("update", signed)
        if self._encoders.feeds_back(signed.record.window):
            self._unsettled[signed.record.window] = (signed.record_id, blob)
        self.emit(
            Published(
                peer_id=self.peer_id,
                window=signed.record.window,
                update_id=signed.record_id,
                bytes=len(blob),
            )
        )

    def _push_dropped(self, blob_id: str, window: int) -> str | None:
        """Why pushing ``blob_id`` (our update of ``window``) is no longer worth it."""
        if self.machine.chain.height >= window:
            return f"window {window} was certified meanwhile"
        if not self.services.store.blobs.has(blob_id):
            return "the blob is no longer in the store"
        return None

    def _settle(self, adopted: act.Adopted) -> None:
        """Our updates of windows the chain has now certified: one the head did not accept
        (missed its window, rejected, screened out) goes back into the codec's residual, to
        be sent again with the next update instead of lost."""
        chain = self.machine.chain
        for window in [w for w in self._unsettled if w <= adopted.head.height]:
            update_id, blob = self._unsettled.pop(window)
            link = chain.at(window)
            if link is not None and update_id not in link.head.accepted:
                self._requeue.append(blob)
                logger.info("window %d: our update was not accepted; requeued", window)
