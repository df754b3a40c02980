"""Where every simulated node's records leave it, honest or not.

The world carries out each :class:`~p2ptrain.protocol.effects.Publish` effect of a node's
policy through :meth:`Outbox.publish`; the adversaries (:mod:`.adversaries`) send their
replays, forgeries, lies and equivocations through the same public methods. Control-plane
fan-out is modelled as direct sends to the nodes that act on a message (updates and
attestations to the reducers and validators, proposals to the validators, certificates to
everyone); the gossip overlay itself is the network layer's job. An update travels with its
blob (what a node would fetch from its trainer at once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from p2ptrain.core.certificate import CertifiedLink, QuorumCertificate
from p2ptrain.core.envelope import Signed
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import Head
from p2ptrain.protocol.effects import Publish
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.sim.engine import Network
from p2ptrain.sim.invariants import Observer
from p2ptrain.sim.scenario import Scenario

__all__ = ["GOSSIP", "Outbox", "Sender"]

#: The kind of network message that carries a record: ("gossip", kind, payload, blob).
GOSSIP = "gossip"


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sends: a node's name, identity, behaviour (``honest`` or an adversary's) and
    role machine (its own state, e.g. the head it builds on)."""

    name: str
    identity: Identity
    behaviour: str
    machine: RoleMachine


class Outbox:
    """The one way out of a simulated node (see the module docstring)."""

    def __init__(
        self,
        net: Network,
        observer: Observer,
        manifest: ExperimentManifest,
        scenario: Scenario,
        *,
        participants: Sequence[str],
        validators: Sequence[str],
        everyone: Callable[[], Sequence[str]],
    ) -> None:
        self.net = net
        self.observer = observer
        self.manifest = manifest
        self.scenario = scenario
        self.participants = tuple(participants)
        self.validators = tuple(validators)
        self._everyone = everyone
        #: update id -> (signed envelope, blob) of every update sent (replayers read it).
        self.published: dict[str, tuple[bytes, bytes]] = {}

    def publish(self, sender: Sender, effect: Publish) -> None:
        """Carry out a policy's Publish effect (a dishonest sender bends it first)."""
        from p2ptrain.sim.adversaries import equivocate, proposal_to_send

        record = effect.record
        if isinstance(record, CertifiedLink):
            self.send_certificate(sender, record.head, record.certificate)
        elif effect.kind == "update":
            assert effect.blob is not None
            self.observer.saw_update(record, sender.behaviour)
            envelope = bytes(record.envelope.encode())
            self.send_update(sender, envelope, effect.blob, record.record_id)
        elif effect.kind == "proposal":
            signed = proposal_to_send(self, sender, record)
            if signed is not None:
                self.observer.saw_proposal(signed.record)
                self.send(sender, self.validators, "proposal", signed)
        elif effect.kind == "attestation":
            for signed in [record, *equivocate(self, sender, record)]:
                self.send(sender, self.participants, "attestation", signed)

    def send(self, sender: Sender, to: Sequence[str], kind: str, signed: Signed[Any]) -> None:
        envelope = bytes(signed.envelope.encode())
        self.net.broadcast(sender.name, to, (GOSSIP, kind, envelope, None), len(envelope))

    def send_update(
        self, sender: Sender, envelope: bytes, blob: bytes, update_id: str | None = None
    ) -> None:
        """An update's signed envelope and its blob, to the reducers and validators
        (``update_id``: remembered as published, for replayers)."""
        if update_id is not None:
            self.published.setdefault(update_id, (envelope, blob))
        message = (GOSSIP, "update", envelope, blob)
        self.net.broadcast(sender.name, self.participants, message, len(envelope) + len(blob))

    def send_certificate(self, sender: Sender, head: Head, certificate: QuorumCertificate) -> None:
        self.observer.saw_certificate(head, certificate, sender.name)
        link = CertifiedLink(head=head, certificate=certificate)
        size = 512 + 96 * len(certificate.signatures) + 64 * len(head.accepted)
        self.net.broadcast(sender.name, self._everyone(), (GOSSIP, "certificate", link, None), size)
