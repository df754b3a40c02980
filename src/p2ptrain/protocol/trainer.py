"""The trainer window state machine (DESIGN §4 steps 1-3).

A trainer follows the certified chain; each time its canonical head moves it trains the next
window from it (the driver runs the inner steps and encodes the pseudo-gradient, asked by a
:class:`Train` action), then publishes a signed update -- unless the head moved meanwhile, in
which case the work is stale and dropped (it would be rejected everywhere).

With a staleness allowance (``window.staleness``) it does not wait for the window it
published to be certified: it trains the next one on the head it holds.

An update can be lost on its way (the only peer it went to crashed, a partition): a trainer
whose update no proposal has named by the end of the window's first proposer slot (the
deadline runs from the window's first update, so at the latest ``deadline_s`` plus
``proposal_s`` after its own was sent) sends it once more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from p2ptrain.aggregate.codecs import codec_at
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Proposal, Update
from p2ptrain.protocol.actions import Action, SendUpdate, Train
from p2ptrain.protocol.follower import ChainRole, Follower, FollowerStatistics
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
    """An update sent, until a proposal names it or it was sent again."""

    update: Signed[Update]
    blob: bytes
    again_at: float
    named: bool = False
    again: bool = False


class TrainerMachine(ChainRole):
    """Trains each window from the canonical head and publishes one update per window,
    over the node's follower (``follow``; or the genesis weights, for a trainer alone).

    With ``window.staleness`` s > 0 the trainer does not wait for a window to be certified:
    once it published window ``w`` it trains window ``w + 1`` on the head it holds, as long
    as that head is at most s heights behind the window's own base (height ``w``). Its
    update names the head it built on; validators accept it as long as the head is within
    the allowance (one-step-delayed outer steps when s = 1)."""

    windows_trained = 0
    updates_published = 0
    stale_dropped = 0
    updates_resent = 0
    #: (window, base head id, base height) of the window being trained.
    _training: tuple[int, str, int] | None = None
    _published_window = 0
    _opened_at = 0.0

    def __init__(
        self,
        manifest: ExperimentManifest,
        identity: Identity,
        follow: Mapping[str, torch.Tensor] | Follower,
    ) -> None:
        super().__init__(self.follower_of(manifest, identity, follow))
        #: Updates sent, by window, until their window is certified.
        self._sent: dict[int, _Sent] = {}

    def start(self, now: float) -> list[Action]:
        """Begin: train the window after the current head."""
        return self._next(now)

    def on_base(self, now: float) -> list[Action]:
        for window in [w for w in self._sent if w < self.base.window]:
            del self._sent[window]  # certified (or given up): nothing to send again
        training = self._training
        if training is not None and self._valid(*training):
            return []  # what is being trained still counts: go on with it
        self._training = None
        return self._next(now)

    def _valid(self, window: int, base_head: str, base_height: int) -> bool:
        """Whether an update of ``window`` built on ``base_head`` is, or will be when its
        window opens, accepted: not for a certified window, and its base on our chain and
        within the staleness allowance of the window's own base."""
        link = self.chain.at(base_height)
        return (
            window >= self.base.window
            and window - 1 - base_height <= self.manifest.window.staleness
            and link is not None
            and link.head_id == base_head
        )

    def _next(self, now: float) -> list[Action]:
        """Train the next window if the head we hold is recent enough for it."""
        if self._training is not None:
            return []
        window = max(self.base.window, self._published_window + 1)
        lag = window - 1 - self.base.head.height
        if lag > self.manifest.window.staleness:
            self.last_reason = (
                f"published window {self._published_window}; waiting for head "
                f"{window - 1 - self.manifest.window.staleness} to train window {window}"
            )
            return []
        self._opened_at = now
        self._training = (window, self.base.head_id, self.base.head.height)
        self.windows_trained += 1
        ahead = f" ({lag} head{'s' if lag > 1 else ''} behind)" if lag else ""
        self.last_reason = f"training window {window} on {self.base.head_id[:12]}{ahead}"
        return [Train(window, self.base.head_id)]

    def training(self, train: Train) -> bool:
        """Whether ``train`` is the window this machine wants trained now."""
        return self._training is not None and self._training[:2] == (
            train.window,
            train.base_head,
        )

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
        training = self._training
        if training is None or training[:2] != (window, base_head) or not self._valid(*training):
            self.stale_dropped += 1
            self.last_reason = f"window {window}: dropped, the head moved while it trained"
            if training is not None and training[:2] == (window, base_head):
                self._training = None
                return self._next(self._opened_at if now is None else now)
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
            codec=codec_at(self.manifest.codec, window).name,
            loss_before=loss_before,
            loss_after=loss_after,
        )
        self.updates_published += 1
        self._published_window = max(self._published_window, window)
        self.last_reason = f"published the update of window {window}"
        signed = seal(self.identity, update)
        timing = self.manifest.window
        sent_at = self._opened_at if now is None else now
        # a participant's deadline runs from the window's first update, at the latest ours
        first_slot_end = sent_at + timing.deadline_s + timing.proposal_s
        self._sent[window] = _Sent(signed, blob, first_slot_end)
        return [SendUpdate(signed, blob), *self._next(sent_at)]

    def saw_proposal(self, signed: Signed[Proposal]) -> None:
        """A proposal went by: does it name our update?"""
        proposal = signed.record
        sent = self._sent.get(proposal.window)
        if sent is None:
            return
        update_id = sent.update.record_id
        if update_id in proposal.accepted or any(
            r.update_id == update_id for r in proposal.rejected
        ):
            sent.named = True

    def _waiting(self) -> list[_Sent]:
        return [s for s in self._sent.values() if not s.named and not s.again]

    def next_wakeup(self, now: float) -> float | None:
        return min((s.again_at for s in self._waiting()), default=None)

    def tick(self, now: float) -> list[Action]:
        """Send the open window's update again if no proposal named it in time (once)."""
        actions: list[Action] = []
        for sent in self._waiting():
            if now < sent.again_at or sent.update.record.window != self.base.window:
                continue
            sent.again = True
            self.updates_resent += 1
            self.last_reason = (
                f"window {self.base.window}: no proposal named our update; sent again"
            )
            actions.append(SendUpdate(sent.update, sent.blob, again=True))
        return actions

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(
            **self._chain_statistics(),
            windows_trained=self.windows_trained,
            updates_published=self.updates_published,
            stale_dropped=self.stale_dropped,
            training_window=None if self._training is None else self._training[0],
            updates_resent=self.updates_resent,
        )
