"""The trainer window state machine (DESIGN §4 steps 1-3).

A trainer follows the certified chain; each time its canonical head moves it trains the next
window from it (the driver runs the inner steps and encodes the pseudo-gradient, asked by a
:class:`Train` action), then publishes a signed update -- unless the head moved meanwhile, in
which case the work is stale and dropped (it would be rejected everywhere).

An update can be lost on its way (the only peer it went to crashed, a partition): a trainer
whose update no proposal has named by the end of the window's first proposer slot (its
deadline plus ``proposal_s``, from when the trainer opened the window) sends it once more.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.records import Proposal, Update
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
    updates_resent: int


@dataclass(slots=True)
class _Sent:
    """The update of the open window, until a proposal names it or it was sent again."""

    update: Signed[Update]
    blob: bytes
    again_at: float
    named: bool = False
    again: bool = False


class TrainerMachine(Follower):
    """Trains each window from the canonical head and publishes one update per window."""

    windows_trained = 0
    updates_published = 0
    stale_dropped = 0
    updates_resent = 0
    _training: tuple[int, str] | None = None
    _sent: _Sent | None = None
    _opened_at = 0.0

    def start(self, now: float) -> list[Action]:
        """Begin: train the window after the current head."""
        return self._on_base(now)

    def _on_base(self, now: float) -> list[Action]:
        self._opened_at, self._sent = now, None
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
        *,
        now: float | None = None,
    ) -> list[Action]:
        """The driver trained ``window`` from ``base_head`` and encoded ``blob`` (at
        ``now``: when to send it again is counted from it and from the window's opening)."""
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
        signed = seal(self.identity, update)
        timing = self.manifest.window
        first_slot_end = self._opened_at + timing.deadline_s + timing.proposal_s
        sent_at = self._opened_at if now is None else now
        self._sent = _Sent(signed, blob, max(first_slot_end, sent_at + timing.proposal_s))
        return [SendUpdate(signed, blob)]

    def saw_proposal(self, signed: Signed[Proposal]) -> None:
        """A proposal went by: does it name our update?"""
        sent, proposal = self._sent, signed.record
        if sent is None or proposal.window != sent.update.record.window:
            return
        update_id = sent.update.record_id
        if update_id in proposal.accepted or any(
            r.update_id == update_id for r in proposal.rejected
        ):
            sent.named = True

    def next_wakeup(self, now: float) -> float | None:
        sent = self._sent
        return None if sent is None or sent.named or sent.again else sent.again_at

    def tick(self, now: float) -> list[Action]:
        """Send the open window's update again if no proposal named it in time (once)."""
        sent = self._sent
        if sent is None or sent.named or sent.again or now < sent.again_at:
            return []
        if sent.update.record.base_head != self.base.head_id:
            return []
        sent.again = True
        self.updates_resent += 1
        self.last_reason = f"window {self.base.window}: no proposal named our update; sent again"
        return [SendUpdate(sent.update, sent.blob, again=True)]

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(
            **self._chain_statistics(),
            windows_trained=self.windows_trained,
            updates_published=self.updates_published,
            stale_dropped=self.stale_dropped,
            training_window=None if self._training is None else self._training[0],
            updates_resent=self.updates_resent,
        )
