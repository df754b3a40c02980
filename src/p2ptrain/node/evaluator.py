"""The evaluator: every certified head the node adopts, evaluated and reported (DESIGN §4.7).

A node started with ``--evaluate`` holds a :class:`HeadEvaluator` beside its roles, with a
workload of its own (built from the experiment manifest; never a trainer's, whose model it
would overwrite). Each head the node adopts is offered to it; it evaluates the head's weights
on the validation data in a worker thread (the event loop keeps answering the network;
a prepared dataset's validation shards are fetched first, like any blob), then
signs a :class:`~p2ptrain.core.records.MetricsReport` and gossips it on the experiment's
topic (gossip hands it back to the node, which stores it like anyone's). A report never
enters a head id.

Heads adopted faster than they are evaluated are not queued: the evaluator takes the newest
and skips the stale ones, and says so in the log and its ``evaluated`` event. An evaluation
that raises is a role error of the ``evaluator`` role (:mod:`.failures`): logged, shown in the
status and as a ``role_error`` event; the next head is evaluated as usual, and too many
failures in a row stop the node with :class:`~.failures.RoleFailed`, as for any role.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from p2ptrain.core.envelope import seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import MetricsReport
from p2ptrain.core.tensors import decode_state_dict
from p2ptrain.driver.failures import FailureBook, RoleFailed
from p2ptrain.driver.services import PeerServices
from p2ptrain.errors import BlobNotFound, ProtocolViolation, TransportError
from p2ptrain.node.persist import METRICS_KIND
from p2ptrain.observe.events import Evaluated, NodeEvent
from p2ptrain.observe.status import RoleState
from p2ptrain.torch.capabilities import ReportsEvaluation
from p2ptrain.torch.workload import Workload

__all__ = ["EVALUATE_STEP", "EVALUATOR_ROLE", "HeadEvaluator", "evaluate_head"]

logger = logging.getLogger(__name__)

EVALUATOR_ROLE = "evaluator"
EVALUATE_STEP = "evaluating"


@dataclass(frozen=True, slots=True)
class _Offer:
    height: int
    head_id: str
    weights_blob: str


def evaluate_head(
    workload: Workload, weights: dict[str, torch.Tensor]
) -> tuple[float, float | None, int]:
    """(loss, perplexity, samples) of ``weights`` on the workload's validation data:
    perplexity = exp(loss) for a language model (``workload.language_model``), samples as
    the workload tells them (``workload.validation_samples``, 0 when it does not)."""
    loss = float(workload.evaluate(weights))
    if not isinstance(workload, ReportsEvaluation):
        return loss, None, 0
    perplexity = None
    if workload.language_model:
        perplexity = math.exp(min(loss, 690.0))  # beyond that, exp overflows a float64
    return loss, perplexity, int(workload.validation_samples)


class HeadEvaluator:
    """Evaluates the newest adopted head, one at a time. ``await run()`` in the node's
    task group; :meth:`offer` each adopted head."""

    role = EVALUATOR_ROLE

    def __init__(
        self,
        *,
        workload: Workload,
        manifest: ExperimentManifest,
        identity: Identity,
        services: PeerServices,
        failures: FailureBook,
        emit: Callable[[NodeEvent], None],
    ) -> None:
        self.workload = workload
        self.manifest = manifest
        self.identity = identity
        self.services = services
        self.failures = failures
        self.emit = emit
        self._next: _Offer | None = None
        self._wake = asyncio.Event()
        self._last_height = -1
        self.evaluated = 0
        self.skipped = 0
        self.last_reason = "waiting for a certified head"

    def offer(self, height: int, head_id: str, weights_blob: str) -> None:
        """A head was adopted: evaluate it next (a head offered earlier and not yet taken
        is skipped: it is stale)."""
        if height <= self._last_height or (self._next is not None and height <= self._next.height):
            return
        self._next = _Offer(height, head_id, weights_blob)
        self._wake.set()

    async def run(self) -> None:
        """Evaluate offered heads until cancelled; raise :class:`RoleFailed` once too many
        evaluations failed in a row."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            offer, self._next = self._next, None
            if offer is None:
                continue
            skipped = 0 if self._last_height < 0 else max(0, offer.height - self._last_height - 1)
            self._last_height = offer.height
            fatal = await self._guarded(offer, skipped)
            if fatal is not None:
                raise fatal

    async def _guarded(self, offer: _Offer, skipped: int) -> RoleFailed | None:
        try:
            await self._evaluate(offer, skipped)
        except Exception as exc:
            if self.services.storage.check(f"{self.role}, {EVALUATE_STEP}", exc):
                return None
            if isinstance(exc, BlobNotFound):  # older than the heads the node keeps
                logger.info(
                    "%s, head %d: its weights were collected meanwhile", self.role, offer.height
                )
                self.last_reason = f"head {offer.height} not evaluated: its weights were collected"
                return None
            if isinstance(exc, TransportError | ProtocolViolation | OSError):
                logger.warning("%s, head %d: %s", self.role, offer.height, exc)
                self.last_reason = f"head {offer.height} not evaluated: {exc}"
                return None
            return self._failed(offer.height, exc)
        self.failures.succeeded(self.role)
        return None

    async def _evaluate(self, offer: _Offer, skipped: int) -> None:
        if skipped:
            logger.info(
                "evaluating head %d; %d older head(s) adopted meanwhile are skipped",
                offer.height,
                skipped,
            )
            self.skipped += skipped
        self.last_reason = f"evaluating head {offer.height}"
        await self._validation_shards()
        started = time.monotonic()
        loss, perplexity, samples = await asyncio.to_thread(self._evaluate_blob, offer)
        seconds = round(time.monotonic() - started, 3)
        report = MetricsReport(
            experiment_id=self.services.experiment_id,
            height=offer.height,
            head_id=offer.head_id,
            evaluator=self.identity.public_key,
            loss=loss,
            perplexity=perplexity,
            samples=samples,
        )
        self.services.publish(METRICS_KIND, seal(self.identity, report))
        self.evaluated += 1
        self.last_reason = f"head {offer.height}: validation loss {loss:.4f}"
        logger.info(
            "head %d (%s): validation loss %.4f on %d samples in %.2f s",
            offer.height, offer.head_id[:12], loss, samples, seconds,
        )  # fmt: skip
        self.emit(
            Evaluated(
                peer_id=self.services.peer_id,
                height=offer.height,
                head_id=offer.head_id,
                loss=loss,
                perplexity=perplexity,
                samples=samples,
                seconds=seconds,
                skipped=skipped,
            )
        )

    async def _validation_shards(self) -> None:
        """Fetch the prepared validation shards this node lacks (each verified by its
        hash), for a workload that validates on the prepared data's split."""
        if not getattr(self.workload, "val_from_data", False):
            return
        for shard in self.manifest.dataset.validation:
            await self.services.download(shard.blob_id, size=shard.bytes, kind="shard")

    def _evaluate_blob(self, offer: _Offer) -> tuple[float, float | None, int]:
        """In a worker thread: the head's weights from the store, evaluated."""
        blob = self.services.store.blobs.get(offer.weights_blob)
        weights = decode_state_dict(blob, expected_schema=self.manifest.workload.schema_hash)
        return evaluate_head(self.workload, weights)

    def _failed(self, height: int, exc: Exception) -> RoleFailed | None:
        self.last_reason = f"head {height}: evaluation failed: {type(exc).__name__}"
        return self.failures.report(
            self.role, height, EVALUATE_STEP, exc, peer_id=self.services.peer_id, emit=self.emit
        )

    def state(self) -> RoleState:
        return RoleState(
            role=self.role,
            last_reason=self.last_reason,
            failures_in_a_row=self.failures.in_a_row(self.role),
            statistics={"evaluated": self.evaluated, "skipped": self.skipped},
        )
