"""The trainer window state machine (DESIGN §4 steps 1-3).

A trainer follows the certified chain; each time its canonical head moves it trains the next
window from it (the driver runs the inner steps and encodes the pseudo-gradient, asked by a
:class:`Train` action), then publishes a signed update -- unless the head moved meanwhile, in
which case the work is stale and dropped (it would be rejected everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import seal
from p2ptrain.core.records import Update
from p2ptrain.protocol.actions import Action, SendUpdate, Train
from p2ptrain.protocol.follower import Follower, FollowerStatistics
from p2ptrain.protocol.leases import Lease, lease_for

__all__ = ["TrainerMachine", "TrainerStatistics"]


@dataclass(frozen=True, slots=True)
class TrainerStatistics(FollowerStatistics):
    windows_trained: int
    updates_published: int
    stale_dropped: int
    training_window: int | None


class TrainerMachine(Follower):
    """Trains each window from the canonical head and publishes one update per window."""

    windows_trained = 0
    updates_published = 0
    stale_dropped = 0
    _training: tuple[int, str] | None = None

    def start(self, now: float) -> list[Action]:
        """Begin: train the window after the current head."""
        return self._on_base(now)

    def _on_base(self, now: float) -> list[Action]:
        self._training = (self.base.window, self.base.head_id)
        self.windows_trained += 1
        self.last_reason = f"training window {self.base.window} on {self.base.head_id[:12]}"
        return [Train(self.base.window, self.base.head_id)]

    def lease(self, window: int) -> Lease:
        return lease_for(
            self.manifest, window, self.identity.peer_id, experiment_id=self.experiment_id
        )

    def finish(
        self,
        window: int,
        base_head: str,
        blob: bytes,
        loss_before: float,
        loss_after: float,
    ) -> list[Action]:
        """The driver trained ``window`` from ``base_head`` and encoded ``blob``."""
        if self._training != (window, base_head) or self.base.head_id != base_head:
            self.stale_dropped += 1
            self.last_reason = f"window {window}: dropped, the head moved while it trained"
            return []
        self._training = None
        lease = self.lease(window)
        update = Update(
            experiment_id=self.experiment_id,
            window=window,
            base_head=base_head,
            trainer=self.key,
            lease_shards=lease.shards,
            lease_samples=lease.samples,
            delta_blob=sha256_hex(blob),
            delta_bytes=len(blob),
            codec=self.manifest.codec.name,
            loss_before=loss_before,
            loss_after=loss_after,
        )
        self.updates_published += 1
        self.last_reason = f"published the update of window {window}"
        return [SendUpdate(seal(self.identity, update), blob)]

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(
            **self._chain_statistics(),
            windows_trained=self.windows_trained,
            updates_published=self.updates_published,
            stale_dropped=self.stale_dropped,
            training_window=None if self._training is None else self._training[0],
        )
