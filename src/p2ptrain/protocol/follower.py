"""Following the certified chain: what every role does when a certificate arrives.

A follower verifies each certified head against its chain (:class:`HeadChain`), then needs
the head's weights (and outer-optimizer state) before it can build on it: it either computed
them itself (a validator that reduced the same cohort), or, holding the parent's state,
fetches only the head's aggregate and applies the outer step itself -- the result must hash
to the head's weights and optimizer blobs, else it fetches the full state -- or fetches the
full state from the peer that sent the certificate, checking its hashes against the head. A
certificate more than one height ahead starts a catch-up from that peer, verified link by
link.

Catch-up at any distance: the links come in pages (:class:`~.chain.ChainPage`, at most
:data:`~.chain.MAX_LINKS_PER_PAGE` each); each page is verified against the chain and
adopted as links (without states), and the next is asked for until the chain reaches the
provider's tip. Then the follower fetches a state the provider says it holds -- the
aggregate of the head after its base while that is held and the tip is near, else the
newest held head's full state -- never the state of a head every node has collected.
While its base is behind the chain it says so (:attr:`Follower.catching_up`); when nobody
holds the state it needs, it says that too (a :class:`~.actions.Notice`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2ptrain.aggregate.aggregate_blob import decode_aggregate
from p2ptrain.aggregate.codecs import precision_at
from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.identity import Identity, peer_id_of
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Head
from p2ptrain.core.spool import Blob
from p2ptrain.core.tensors import decode_state_dict, encode_state_dict, schema_hash, schema_of
from p2ptrain.errors import ProtocolViolation
from p2ptrain.protocol.actions import (
    Action,
    Adopted,
    FetchAggregate,
    FetchChain,
    FetchState,
    Notice,
    Reported,
)
from p2ptrain.protocol.chain import CertifiedHead, ChainPage, HeadChain
from p2ptrain.protocol.reduction import BaseState, blob_ids, outer_step
from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS

__all__ = ["ChainRole", "Follower", "FollowerStatistics"]

#: The largest weights or optimizer blob a follower decodes (4 GiB).
MAX_STATE_BYTES = 4 << 30
#: How far behind the chain's tip a follower still goes link by link, by aggregates;
#: further, it fetches a full state. Peers keep the blobs (aggregates included) of their
#: last ``--keep-heads`` heads, 3 by default: older aggregates are collected everywhere.
MAX_AGGREGATE_LINKS = DEFAULT_KEEP_HEADS


@dataclass(frozen=True, slots=True)
class FollowerStatistics:
    """What every role machine counts (the trainer's and participant's add to it)."""

    height: int
    adopted_height: int
    conflicts: int
    last_reason: str
    aggregates_applied: int
    aggregate_mismatches: int
    outer_steps: int
    certificate_checks: int
    #: Empty while the base is at the tip; else where catch-up stands, for people.
    catching_up: str


class Follower:
    """A node's one view of the certified chain: its :class:`HeadChain`, the base state it
    builds on (weights and outer-optimizer state, one copy) and the encoded state it
    serves. Alone it is the machine of seeds and viewers; a trainer, reducer or validator is
    a :class:`ChainRole` over it, and the roles of one node share one follower (each
    certificate verified once, one outer step per head)."""

    #: What the machine did last, or why the open window has no head yet.
    last_reason = "following the certified chain"
    #: Heads adopted by applying their aggregate ourselves, and those where our outer step
    #: did not give the certified weights (then the full state was fetched).
    aggregates_applied = 0
    aggregate_mismatches = 0
    #: Outer steps that moved the base: applying a certified aggregate, or adopting a head
    #: a participant of this node reduced (the step its reduction took).
    outer_steps = 0

    def __init__(
        self,
        manifest: ExperimentManifest,
        identity: Identity,
        genesis_weights: Mapping[str, torch.Tensor],
    ) -> None:
        self.manifest = manifest
        self.identity = identity
        self.key = identity.public_key
        self.chain = HeadChain(manifest)
        self.experiment_id = self.chain.experiment_id
        self._schema_hash = schema_hash(genesis_weights)
        self._schema = schema_of(genesis_weights)
        tip = self.chain.tip
        if sha256_hex(_encoded(genesis_weights)) != tip.head.weights_blob:
            raise ProtocolViolation("the genesis weights do not match manifest.genesis_weights")
        self.base = BaseState(tip.head, tip.head_id, dict(genesis_weights), None)
        self._served: tuple[str, tuple[bytes | bytearray, bytes | bytearray | None]] | None = None
        #: The highest height a provider's verified page said its chain reaches.
        self._tip_seen = 0
        #: Why the base cannot reach the chain's tip now (no provider holds a state).
        self._stalled: str | None = None
        #: The state of a head this node computed (a participant's reductions), if any.
        self.state_source: Callable[[str], BaseState | None] | None = None

    def _known_state(self, head_id: str) -> BaseState | None:
        """The state of ``head_id`` if a role of this node computed it (its reduction)."""
        return None if self.state_source is None else self.state_source(head_id)

    # --- the driver's clock ------------------------------------------------------------

    def next_wakeup(self, now: float) -> float | None:
        """A follower moves only when something arrives."""
        return None

    def tick(self, now: float) -> list[Action]:
        return []

    def on_base(self, now: float) -> list[Action]:
        """A follower alone does nothing more when its base moved."""
        return []

    def statistics(self) -> FollowerStatistics:
        return FollowerStatistics(**self._chain_statistics())

    def _chain_statistics(self) -> dict[str, Any]:
        """The fields of :class:`FollowerStatistics`, for the subclasses' records."""
        return {
            "height": self.chain.height,
            "adopted_height": self.base.head.height,
            "conflicts": len(self.chain.conflicts),
            "last_reason": self.last_reason,
            "aggregates_applied": self.aggregates_applied,
            "aggregate_mismatches": self.aggregate_mismatches,
            "outer_steps": self.outer_steps,
            "certificate_checks": self.chain.certificate_checks,
            "catching_up": self.catching_up,
        }

    @property
    def catching_up(self) -> str:
        """Where catch-up stands ("catching up: at height h, tip H ..."), or "" when the
        base is at the chain's tip or one height behind it (a window being adopted)."""
        base, chain = self.base.head.height, self.chain.height
        tip = max(chain, self._tip_seen)
        if tip - base <= 1 and self._stalled is None:
            return ""
        text = f"catching up: at height {base}, tip {tip}"
        if chain < tip:
            text += f", certified links verified to {chain}"
        return text if self._stalled is None else f"{text}; {self._stalled}"

    # --- inputs --------------------------------------------------------------------------

    def receive_certificate(
        self, now: float, head: Head, certificate: QuorumCertificate, sender: bytes
    ) -> list[Action]:
        """A certified head from ``sender`` (anyone may relay one; only its certificate and
        hashes are trusted)."""
        height = self.chain.height
        if head.height > height + 1:
            return [FetchChain(sender, height)]  # verified page by page
        conflicts = len(self.chain.conflicts)
        verdict = self.chain.extend(head, certificate)
        if not verdict:
            if head.height <= height and len(self.chain.conflicts) == conflicts:
                return []  # a head we hold, relayed again
            return [Reported(peer_id_of(sender), verdict.reason)]
        head_id = self.chain.tip.head_id
        known = self._known_state(head_id)
        if known is not None:
            self.outer_steps += 1  # the step our reduction took, now the base
            return self._adopt(now, known, verdict.reason)
        after_base = self._next_link()
        if after_base is not None:
            return [FetchAggregate(sender, after_base.head, after_base.head_id)]
        return [FetchState(sender, head, head_id)]

    def _next_link(self) -> CertifiedHead | None:
        """The certified head after our base, when following the chain by aggregates is
        the way to the tip (it is at most :data:`MAX_AGGREGATE_LINKS` heads away)."""
        ahead = self.chain.height - self.base.head.height
        link = self.chain.at(self.base.head.height + 1)
        if not 0 < ahead <= MAX_AGGREGATE_LINKS or link is None:
            return None
        return link if link.head.aggregate_blob is not None else None

    def receive_aggregate(self, now: float, head_id: str, aggregate_blob: bytes) -> list[Action]:
        """The aggregate of the head after our base (its hash already checked):
        step our base with it and adopt the result if it hashes to the head's weights and
        optimizer state; otherwise fetch the full state (a machine whose arithmetic
        differs from the quorum's must still follow the chain)."""
        link, tip = self._next_link(), self.chain.tip
        if link is None or link.head_id != head_id:
            return []  # adopted meanwhile, or the chain moved on
        head = link.head
        if sha256_hex(aggregate_blob) != head.aggregate_blob:  # the transport checks it
            return [FetchState(None, tip.head, tip.head_id)]
        try:
            pseudo_gradient = decode_aggregate(
                aggregate_blob,
                self._schema,
                max_bytes=MAX_STATE_BYTES,
                precision=precision_at(
                    self.manifest.codec, self.manifest.aggregation.precision, head.height
                ),
            )
        except ProtocolViolation as error:
            return [
                Reported("state", f"certified aggregate does not decode: {error}"),
                FetchState(None, tip.head, tip.head_id),
            ]
        step = outer_step(self.manifest, self.base, pseudo_gradient)
        self.outer_steps += 1
        weights, optimizer = blob_ids(step.weights_blob, step.optimizer_blob)
        if weights != head.weights_blob or optimizer != head.optimizer_blob:
            self.aggregate_mismatches += 1
            self.last_reason = (
                f"height {head.height}: our outer step of the aggregate does not give the "
                "certified weights; fetching the full state"
            )
            return [FetchState(None, tip.head, tip.head_id)]
        self.aggregates_applied += 1
        state = BaseState(head, head_id, step.weights, step.optimizer_state, aggregate_blob)
        assert isinstance(step.weights_blob, bytearray)  # stepped in memory (no spool)
        assert step.optimizer_blob is None or isinstance(step.optimizer_blob, bytearray)
        self._served = (head_id, (step.weights_blob, step.optimizer_blob))
        actions = self._adopt(now, state, f"applied the aggregate of height {head.height}")
        following = self._next_link()  # certified meanwhile: on to the next
        if following is not None:
            actions.append(FetchAggregate(None, following.head, following.head_id))
        return actions

    def window_bases(self) -> tuple[str, ...]:
        """The heads an update of the open window may build on: the base and the
        ``window.staleness`` certified heads before it (those the chain holds)."""
        height = self.base.head.height
        bases = [self.base.head_id]
        for back in range(1, self.manifest.window.staleness + 1):
            link = self.chain.at(height - back) if height - back >= 0 else None
            if link is None:
                break
            bases.append(link.head_id)
        return tuple(bases)

    def aggregate_of(self, head_id: str) -> Blob | None:
        """The encoded aggregate of ``head_id``, if this role holds it (to serve peers)."""
        return self.base.aggregate if head_id == self.base.head_id else None

    def receive_state(
        self, now: float, head_id: str, weights_blob: bytes, optimizer_blob: bytes | None
    ) -> list[Action]:
        """The weights (and optimizer state) of a certified head above our base (the
        chain's tip, or a head a provider still held on the way to it), fetched from a
        peer: adopted, and on towards the tip."""
        link = self._link_above_base(head_id)
        if link is None:
            return []
        state = self._decode_state(link.head, head_id, weights_blob, optimizer_blob)
        if isinstance(state, str):
            return [Reported("state", state)]
        actions = self._adopt(now, state, f"adopted height {link.head.height}")
        return actions + self._toward_tip(None, frozenset())

    def receive_links(self, now: float, page: ChainPage) -> list[Action]:
        """A page of a catch-up answer: its links above our chain verified and adopted
        (without states), then the next page while the provider's chain goes on, then a
        state the provider holds."""
        sender = page.sender
        above = [(h, c) for h, c in page.links if h.height > self.chain.height]
        if above:
            verdict = self.chain.extend_links(above)
            if not verdict:
                return [Reported(peer_id_of(sender), verdict.reason)]
            self._tip_seen = max(self._tip_seen, page.tip)
            if self.chain.height < page.tip:
                self.last_reason = self.catching_up
                return [FetchChain(sender, self.chain.height)]  # the next page
        return self._toward_tip(sender, page.held)

    def state_unavailable(self, head: Head, head_id: str) -> list[Action]:
        """Nobody served the state of ``head`` (every try failed in transit): say so once;
        the driver asks again later (a newer head, another provider)."""
        self._stalled = (
            f"no provider holds the state of head {head_id[:12]} at height {head.height}; "
            "asking other peers as the chain moves"
        )
        self.last_reason = self.catching_up
        return [Notice(self.last_reason)]

    def resume_catch_up(self) -> list[Action]:
        """Ask again for the state the base needs (the driver's back-off passed, or the next
        page did not come: the tip a provider named is no longer counted on)."""
        self._tip_seen = self.chain.height
        return self._toward_tip(None, frozenset())

    def _toward_tip(self, provider: bytes | None, held: frozenset[int]) -> list[Action]:
        """What brings the base to the chain's tip: the aggregate of the next head while
        the tip is near (and the provider holds it, when it said what it holds), else the
        full state of the newest head the provider holds (of the tip, from anyone, when
        it holds none above our base)."""
        base = self.base.head.height
        if self.chain.height <= base:
            return []
        following = self._next_link()
        if following is not None and (not held or following.head.height in held):
            return [FetchAggregate(provider, following.head, following.head_id)]
        heights = [h for h in held if base < h <= self.chain.height]
        target = self.chain.at(max(heights)) if heights else None
        if target is None:
            target, provider = self.chain.tip, None
        if self.chain.height - base > 1:
            self.last_reason = self.catching_up
        return [FetchState(provider, target.head, target.head_id)]

    def _link_above_base(self, head_id: str) -> CertifiedHead | None:
        """The certified head ``head_id`` of our chain above the base, if it is one."""
        for height in range(self.chain.height, self.base.head.height, -1):
            link = self.chain.at(height)
            if link is not None and link.head_id == head_id:
                return link
        return None

    def receive_chain(
        self,
        now: float,
        links: Sequence[tuple[Head, QuorumCertificate]],
        weights_blob: bytes,
        optimizer_blob: bytes | None,
        sender: bytes,
    ) -> list[Action]:
        """A catch-up answer: the certified heads above ours and the last one's state."""
        if all(head.height <= self.chain.height for head, _ in links):
            return []  # we caught up meanwhile
        verdict = self.chain.catch_up(
            links, weights_ok=lambda head: sha256_hex(weights_blob) == head.weights_blob
        )
        if not verdict:
            return [Reported(peer_id_of(sender), verdict.reason)]
        tip = self.chain.tip
        state = self._decode_state(tip.head, tip.head_id, weights_blob, optimizer_blob)
        if isinstance(state, str):
            return [Reported(peer_id_of(sender), state)]
        return self._adopt(now, state, verdict.reason)

    def state_of(self, head_id: str) -> tuple[bytes | bytearray, bytes | bytearray | None] | None:
        """The encoded weights and optimizer state of ``head_id``, if held (to serve a
        peer's :class:`FetchState`); only the current base is kept."""
        if head_id != self.base.head_id:
            return None
        if self._served is None or self._served[0] != head_id:
            optimizer = self.base.optimizer_state
            encoded = (
                _encoded(self.base.weights),
                None if optimizer is None else _encoded(optimizer),
            )
            self._served = (head_id, encoded)
        return self._served[1]

    # --- internals -----------------------------------------------------------------------

    def _decode_state(
        self, head: Head, head_id: str, weights_blob: bytes, optimizer_blob: bytes | None
    ) -> BaseState | str:
        if sha256_hex(weights_blob) != head.weights_blob:
            return "weights do not match the certified head's weights hash"
        if (optimizer_blob is None) != (head.optimizer_blob is None) or (
            optimizer_blob is not None and sha256_hex(optimizer_blob) != head.optimizer_blob
        ):
            return "optimizer state does not match the certified head"
        try:
            weights = decode_state_dict(
                weights_blob, expected_schema=self._schema_hash, max_bytes=MAX_STATE_BYTES
            )
            optimizer = (
                None
                if optimizer_blob is None
                else decode_state_dict(optimizer_blob, max_bytes=MAX_STATE_BYTES)
            )
        except ProtocolViolation as error:
            return f"undecodable state: {error}"
        return BaseState(head, head_id, weights, optimizer)

    def _adopt(self, now: float, state: BaseState, reason: str) -> list[Action]:
        self.base = state
        self._stalled = None
        if state.head.height >= self.chain.height:
            self._tip_seen = 0  # at the tip of what was verified: a tip only named is dropped
        self.last_reason = f"adopted height {state.head.height}: {reason}"
        return [Adopted(state.head, state.head_id, reason)]


class ChainRole:
    """A role's window logic over a node's :class:`Follower` (composition: the roles of one
    node share it). The chain inputs pass to the follower; when one moved the base, the
    role that handed it on reacts (:meth:`on_base`); the node tells its other roles."""

    #: What the role did last, or why the open window has no head yet.
    last_reason = "following the certified chain"

    def __init__(self, follower: Follower) -> None:
        self.follower = follower
        self.manifest = follower.manifest
        self.identity = follower.identity
        self.key = follower.key
        self.experiment_id = follower.experiment_id

    @staticmethod
    def follower_of(
        manifest: ExperimentManifest,
        identity: Identity,
        follow: Mapping[str, torch.Tensor] | Follower,
    ) -> Follower:
        """The follower a role is built over: the node's (shared), or a new one from the
        genesis weights (a role alone)."""
        if not isinstance(follow, Follower):
            return Follower(manifest, identity, follow)
        if follow.manifest != manifest or follow.key != identity.public_key:
            raise ValueError("a role shares the follower of its own node and experiment")
        return follow

    @property
    def chain(self) -> HeadChain:
        return self.follower.chain

    @property
    def base(self) -> BaseState:
        return self.follower.base

    @property
    def outer_steps(self) -> int:
        return self.follower.outer_steps

    @property
    def catching_up(self) -> str:
        return self.follower.catching_up

    def on_base(self, now: float) -> list[Action]:
        """The follower's base moved to a new canonical head (through this role, or
        another role of the node)."""
        return []

    def _moved(self, now: float, actions: list[Action]) -> list[Action]:
        if any(isinstance(a, Adopted) for a in actions):
            return [*actions, *self.on_base(now)]
        return actions

    def _chain_statistics(self) -> dict[str, Any]:
        return {**self.follower._chain_statistics(), "last_reason": self.last_reason}

    # --- the chain's inputs, through the follower ----------------------------------------

    def receive_certificate(
        self, now: float, head: Head, certificate: QuorumCertificate, sender: bytes
    ) -> list[Action]:
        return self._moved(now, self.follower.receive_certificate(now, head, certificate, sender))

    def receive_aggregate(self, now: float, head_id: str, aggregate_blob: bytes) -> list[Action]:
        return self._moved(now, self.follower.receive_aggregate(now, head_id, aggregate_blob))

    def receive_state(
        self, now: float, head_id: str, weights_blob: bytes, optimizer_blob: bytes | None
    ) -> list[Action]:
        return self._moved(
            now, self.follower.receive_state(now, head_id, weights_blob, optimizer_blob)
        )

    def receive_links(self, now: float, page: ChainPage) -> list[Action]:
        return self._moved(now, self.follower.receive_links(now, page))

    def receive_chain(
        self,
        now: float,
        links: Sequence[tuple[Head, QuorumCertificate]],
        weights_blob: bytes,
        optimizer_blob: bytes | None,
        sender: bytes,
    ) -> list[Action]:
        return self._moved(
            now,
            self.follower.receive_chain(now, links, weights_blob, optimizer_blob, sender),
        )

    def state_unavailable(self, head: Head, head_id: str) -> list[Action]:
        return self.follower.state_unavailable(head, head_id)

    def resume_catch_up(self) -> list[Action]:
        return self.follower.resume_catch_up()

    def window_bases(self) -> tuple[str, ...]:
        return self.follower.window_bases()

    def state_of(self, head_id: str) -> tuple[bytes | bytearray, bytes | bytearray | None] | None:
        return self.follower.state_of(head_id)

    def aggregate_of(self, head_id: str) -> Blob | None:
        return self.follower.aggregate_of(head_id)


def _encoded(tensors: Mapping[str, torch.Tensor]) -> bytearray:
    return encode_state_dict(tensors)
