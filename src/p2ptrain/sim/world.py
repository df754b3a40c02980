"""A simulated network: real protocol machines on a virtual network, faults and adversaries.

Every node runs the real state machines of :mod:`p2ptrain.protocol` (and through them the
real aggregation, codecs and signatures); records travel as signed envelope bytes and are
opened with :func:`open_envelope`, so a forged signature is caught exactly as in a node.
Control-plane fan-out is modelled as direct sends to the nodes that act on a message
(updates to reducers and validators, attestations to them, certificates to everyone); the
gossip overlay itself is the network layer's job. A global observer checks the safety
invariants (:mod:`.invariants`) from everything the nodes certify and adopt.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    AggregationSpec,
    CodecSpec,
    ExperimentManifest,
    WindowSpec,
    WorkloadSpec,
)
from p2ptrain.core.records import Attestation, Head, Proposal, Update
from p2ptrain.core.tensors import encode_state_dict, schema_hash, schema_of
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.adversaries import equivocate, proposal_to_send, trained_update
from p2ptrain.sim.engine import LinkSpec, Network, Partition, Simulator
from p2ptrain.sim.invariants import Observer
from p2ptrain.sim.scenario import Scenario
from p2ptrain.sim.workloads import make_workload

__all__ = ["World"]

MAX_ENVELOPE = 1 << 20


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def _identity(seed: int, name: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"sim/{seed}/{name}".encode()).digest())


@dataclass
class _Node:
    name: str
    identity: Identity
    machine: Follower
    role: str  # trainer | validator | reducer
    behaviour: str = "honest"
    up: bool = True
    stopped: bool = False
    timer: Any = None
    trainer_index: int = -1
    encoder: Any = None


class World:
    """Builds and runs one :class:`Scenario`."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.sim = Simulator(self.rng)
        default = LinkSpec(latency_s=scenario.latency_s, loss=scenario.loss)
        self.net = Network(self.sim, default)
        self.workload = make_workload(scenario.workload, scenario.seed)
        self.genesis = self.workload.genesis()
        self.nodes: dict[str, _Node] = {}
        #: update id -> (signed envelope, blob) of every update sent, to serve fetches
        self.published: dict[str, tuple[bytes, bytes]] = {}
        self.by_key: dict[bytes, str] = {}
        names = self._names()
        validator_ids = {n: _identity(scenario.seed, n) for n in names["validator"]}
        reducer_ids = {n: _identity(scenario.seed, n) for n in names["reducer"]}
        self.manifest = self._manifest(list(validator_ids.values()))
        self.observer = Observer(self.manifest)
        self.observer.now = lambda: self.sim.now
        reducers = [i.public_key for i in reducer_ids.values()]
        self.participants: list[str] = [*reducer_ids, *validator_ids]
        for name, identity in [*reducer_ids.items(), *validator_ids.items()]:
            role = "validator" if name in validator_ids else "reducer"
            machine = Participant(
                self.manifest, identity, self.genesis, validator=role == "validator",
                reducers=reducers,
            )  # fmt: skip
            self._add(_Node(name, identity, machine, role, names["behaviour"].get(name, "honest")))
        for index, name in enumerate(names["trainer"]):
            identity = _identity(scenario.seed, name)
            trainer = TrainerMachine(self.manifest, identity, self.genesis)
            behaviour = names["behaviour"].get(name, "honest")
            node = _Node(name, identity, trainer, "trainer", behaviour, trainer_index=index)
            node.encoder = make_encoder(self.manifest.codec, schema_of(self.genesis), seed=index)
            self._add(node)
        for slow in scenario.slow:
            self._node(slow.node)
            self.net.set_link(
                slow.node, LinkSpec(slow.latency_s, slow.bandwidth_bytes_s, scenario.loss)
            )
        for cut in scenario.partitions:
            inside = frozenset(self._node(n).name for n in cut.nodes)
            outside = frozenset(self.nodes) - inside
            self.net.add_partition(Partition(cut.start_s, cut.end_s, (inside, outside)))

    # --- set-up --------------------------------------------------------------------------

    def _names(self) -> dict[str, Any]:
        s = self.scenario
        trainers = [f"t{i}" for i in range(s.trainers)]
        behaviour: dict[str, str] = {f"t{i}": "byzantine" for i in range(s.byzantine)}
        validators = [f"v{i}" for i in range(s.validators)]
        reducers = [f"r{i}" for i in range(s.reducers)]
        for i in range(s.silent_validators):
            behaviour[validators[-1 - i]] = "silent"
        for adversary in s.adversaries:
            if adversary in ("replayer", "stale", "forger"):
                trainers.append(f"x-{adversary}")
                behaviour[f"x-{adversary}"] = adversary
            elif adversary in ("lying_reducer", "silent_reducer"):
                reducers.insert(0, f"x-{adversary}")
                behaviour[f"x-{adversary}"] = adversary
            elif adversary == "equivocating_validator":
                behaviour[validators[0]] = adversary
        return {"trainer": trainers, "validator": validators, "reducer": reducers,
                "behaviour": behaviour}  # fmt: skip

    def _manifest(self, validators: list[Identity]) -> ExperimentManifest:
        s = self.scenario
        authority = _identity(s.seed, "authority")
        train = self.workload.train_seconds
        return ExperimentManifest(
            network_id=sha256_hex(f"sim-network-{s.seed}".encode()),
            study="sim",
            name=s.workload,
            authority=authority.public_key,
            workload=WorkloadSpec(name=s.workload, schema_hash=schema_hash(self.genesis)),
            dataset=self.workload.dataset(),
            inner_steps=getattr(self.workload, "inner_steps", 1),
            window=WindowSpec(
                deadline_s=train * 2 + 5,
                min_updates=s.min_updates,
                max_updates=max(1000, s.trainers + 10),
                proposal_s=5.0,
            ),
            codec=CodecSpec(name=s.codec),
            aggregation=AggregationSpec(rule=s.rule),
            validators=tuple(sorted(v.public_key for v in validators)),
            quorum=s.quorum,
            lease_size=min(64, sum(x.samples for x in self.workload.dataset().shards)),
            genesis_weights=sha256_hex(bytes(encode_state_dict(self.genesis))),
        )

    def _add(self, node: _Node) -> None:
        self.nodes[node.name] = node
        self.by_key[node.identity.public_key] = node.name
        self.net.add_node(node.name, functools.partial(self._deliver, node))

    def _node(self, name: str) -> _Node:
        if name not in self.nodes:
            raise LocalError(f"no simulated node named {name!r} (names: t0.., v0.., r0..)")
        return self.nodes[name]

    # --- running -------------------------------------------------------------------------

    def run(self) -> None:
        s = self.scenario
        for node in self.nodes.values():
            if node.role == "trainer":
                self._carry_out(node, node.machine.start(0.0))  # type: ignore[attr-defined]
            else:
                self._schedule_tick(node)
        for node in self.nodes.values():
            if node.behaviour == "silent":
                self._crash(node)  # a silent validator takes no part at all
        for crash in s.crashes:
            node = self._node(crash.node)
            self.sim.call_at(crash.at_s, functools.partial(self._crash, node))
            if crash.restart_s is not None:
                self.sim.call_at(crash.restart_s, functools.partial(self._restart, node))
        spec = self.manifest.window
        per_window = spec.deadline_s + spec.proposal_s * (len(self.participants) + 2)
        limit = s.windows * per_window * s.max_windows_time_factor + 60
        self.observer.target = s.windows
        self.observer.on_target = self._settle
        self.sim.run(until=limit, max_events=50_000_000)

    def _settle(self) -> None:
        """The last window is certified: let the certificates spread, then stop."""
        for node in self.nodes.values():
            node.stopped = node.role == "trainer"
        self.sim.call_later(5.0, self._announce)
        self.sim.call_later(60.0, self.sim.stop)

    def _announce(self) -> None:
        """Every running participant announces its certified tip once (what gossip does
        periodically), so nodes that missed a certificate catch up."""
        for name in self.participants:
            node = self.nodes[name]
            tip = node.machine.chain.tip
            if node.up and tip.certificate is not None and node.behaviour == "honest":
                self._do_send_certificate(node, act.SendCertificate(tip.head, tip.certificate))

    def _schedule_tick(self, node: _Node) -> None:
        """Wake the participant at its next slot boundary (moved only when it changed: a
        new window opened)."""
        machine = node.machine
        assert isinstance(machine, Participant)
        when = machine.next_wakeup(self.sim.now)
        if node.timer is not None:
            if node.timer.when == when:
                return
            node.timer.cancel()
        node.timer = self.sim.call_at(when, functools.partial(self._tick, node))

    def _tick(self, node: _Node) -> None:
        node.timer = None
        if not node.up:
            return
        assert isinstance(node.machine, Participant)
        self._carry_out(node, node.machine.tick(self.sim.now))
        self._schedule_tick(node)

    def _crash(self, node: _Node) -> None:
        node.up = False
        self.net.set_up(node.name, False)
        if node.timer is not None:
            node.timer.cancel()
            node.timer = None

    def _restart(self, node: _Node) -> None:
        """Back from a crash: what a node persists (chain, votes, weights) survives, the
        window's in-memory updates and proposals do not."""
        node.up = True
        self.net.set_up(node.name, True)
        machine = node.machine
        if isinstance(machine, Participant):
            machine.restart(self.sim.now)
            self._schedule_tick(node)
        elif isinstance(machine, TrainerMachine):
            self._carry_out(node, machine.start(self.sim.now))

    # --- messages ------------------------------------------------------------------------

    def _send(self, node: _Node, to: list[str], message: tuple[Any, ...], size: int) -> None:
        self.net.broadcast(node.name, to, message, size)

    def _deliver(self, node: _Node, sender: str, message: object) -> None:
        if not node.up:
            return
        assert isinstance(message, tuple)
        kind = message[0]
        handler = getattr(self, f"_on_{kind}")
        try:
            actions: list[act.Action] = handler(node, sender, *message[1:])
        except ProtocolViolation as error:
            self.observer.rejected_from(sender, f"{kind}: {error}")
            return
        self._carry_out(node, actions)
        if isinstance(node.machine, Participant) and node.timer is not None:
            self._schedule_tick(node)

    @staticmethod
    def _participant(node: _Node) -> Participant | None:
        return node.machine if isinstance(node.machine, Participant) else None

    def _on_update(
        self, node: _Node, sender: str, envelope: bytes, blob: bytes
    ) -> list[act.Action]:
        machine = self._participant(node)
        if machine is None:
            return []
        signed = open_envelope(envelope, Update, max_bytes=MAX_ENVELOPE)
        return machine.receive_update(self.sim.now, signed, blob)

    def _on_updates(
        self, node: _Node, sender: str, updates: list[tuple[bytes, bytes]]
    ) -> list[act.Action]:
        actions: list[act.Action] = []
        for envelope, blob in updates:
            actions += self._on_update(node, sender, envelope, blob)
        return actions

    def _on_proposal(self, node: _Node, sender: str, envelope: bytes) -> list[act.Action]:
        machine = self._participant(node)
        if machine is None:
            return []
        proposal = open_envelope(envelope, Proposal, max_bytes=MAX_ENVELOPE)
        return machine.receive_proposal(self.sim.now, proposal)

    def _on_attestation(self, node: _Node, sender: str, envelope: bytes) -> list[act.Action]:
        machine = self._participant(node)
        if machine is None:
            return []
        attestation = open_envelope(envelope, Attestation, max_bytes=MAX_ENVELOPE)
        return machine.receive_attestation(self.sim.now, attestation)

    def _on_certificate(
        self, node: _Node, sender: str, head: Head, certificate: QuorumCertificate, key: bytes
    ) -> list[act.Action]:
        self.observer.saw_certificate(head, certificate, node.name)
        return node.machine.receive_certificate(self.sim.now, head, certificate, key)

    def _on_fetch_updates(
        self, node: _Node, sender: str, update_ids: tuple[str, ...]
    ) -> list[act.Action]:
        machine = self._participant(node)
        if machine is not None:
            found = machine.provide_updates(update_ids)
            updates = [self.published[s.update_id] for s in found]
            size = sum(len(e) + len(b) for e, b in updates) + 64
            self._send(node, [sender], ("updates", updates), size)
        return []

    def _on_fetch_state(self, node: _Node, sender: str, head_id: str) -> list[act.Action]:
        state = node.machine.state_of(head_id)
        if state is not None:
            size = len(state[0]) + len(state[1] or b"") + 64
            self._send(node, [sender], ("state", head_id, *state), size)
        return []

    def _on_state(
        self, node: _Node, sender: str, head_id: str, weights: bytes, optimizer: bytes | None
    ) -> list[act.Action]:
        return node.machine.receive_state(self.sim.now, head_id, weights, optimizer)

    def _on_fetch_chain(self, node: _Node, sender: str, after_height: int) -> list[act.Action]:
        chain = node.machine.chain
        links = chain.links_after(after_height)
        state = node.machine.state_of(chain.tip.head_id)
        if links and state is not None:
            size = 1024 * len(links) + len(state[0]) + len(state[1] or b"")
            self._send(node, [sender], ("chain", links, *state), size)
        return []

    def _on_chain(
        self,
        node: _Node,
        sender: str,
        links: list[tuple[Head, QuorumCertificate]],
        weights: bytes,
        optimizer: bytes | None,
    ) -> list[act.Action]:
        key = self.nodes[sender].identity.public_key
        return node.machine.receive_chain(self.sim.now, links, weights, optimizer, key)

    # --- actions -------------------------------------------------------------------------

    def _carry_out(self, node: _Node, actions: list[act.Action]) -> None:
        for action in actions:
            handler = getattr(self, "_do_" + _snake(type(action).__name__))
            handler(node, action)

    def _do_train(self, node: _Node, action: act.Train) -> None:
        if node.stopped:
            return
        delay = self.workload.train_seconds * (0.8 + 0.4 * self.rng.random())
        self.sim.call_later(delay, lambda: self._trained(node, action))

    def _trained(self, node: _Node, action: act.Train) -> None:
        machine = node.machine
        assert isinstance(machine, TrainerMachine)
        if not node.up or node.stopped:
            return
        trained_update(self, node, machine, action)

    def _do_send_update(self, node: _Node, action: act.SendUpdate) -> None:
        envelope = bytes(action.update.envelope.encode())
        self.published[action.update.record_id] = (envelope, action.blob)
        self.observer.saw_update(action.update, node.behaviour)
        size = len(envelope) + len(action.blob)
        self._send(node, self.participants, ("update", envelope, action.blob), size)

    def _do_send_proposal(self, node: _Node, action: act.SendProposal) -> None:
        signed = proposal_to_send(self, node, action.proposal)
        if signed is None:
            return
        envelope = bytes(signed.envelope.encode())
        self.observer.saw_proposal(signed.record)
        validators = [n for n in self.participants if self.nodes[n].role == "validator"]
        self._send(node, validators, ("proposal", envelope), len(envelope))

    def _do_send_attestation(self, node: _Node, action: act.SendAttestation) -> None:
        for signed in [action.attestation, *equivocate(self, node, action.attestation)]:
            envelope = bytes(signed.envelope.encode())
            self._send(node, self.participants, ("attestation", envelope), len(envelope))

    def _do_send_certificate(self, node: _Node, action: act.SendCertificate) -> None:
        self.observer.saw_certificate(action.head, action.certificate, node.name)
        message = ("certificate", action.head, action.certificate, node.identity.public_key)
        size = 512 + 96 * len(action.certificate.signatures) + 64 * len(action.head.accepted)
        self._send(node, list(self.nodes), message, size)

    def _do_fetch_updates(self, node: _Node, action: act.FetchUpdates) -> None:
        target = self.by_key.get(action.peer)
        if target is not None:
            self._send(
                node, [target], ("fetch_updates", action.update_ids), 64 * len(action.update_ids)
            )

    def _do_fetch_state(self, node: _Node, action: act.FetchState) -> None:
        target = self.by_key.get(action.peer) if action.peer else None
        if target is None or target == node.name:
            target = self.rng.choice(self.participants)
        self._send(node, [target], ("fetch_state", action.head_id), 128)
        # ask another participant too if the first has moved on by the time it answers
        self.sim.call_later(10.0, lambda: self._refetch(node, action.head_id))

    def _refetch(self, node: _Node, head_id: str) -> None:
        if (
            node.up
            and node.machine.chain.tip.head_id == head_id
            and node.machine.base.head_id != head_id
        ):
            self._send(node, [self.rng.choice(self.participants)], ("fetch_state", head_id), 128)
            self.sim.call_later(10.0, lambda: self._refetch(node, head_id))

    def _do_fetch_chain(self, node: _Node, action: act.FetchChain) -> None:
        target = self.by_key.get(action.peer) or self.rng.choice(self.participants)
        self._send(node, [target], ("fetch_chain", action.after_height), 128)

    def _do_adopted(self, node: _Node, action: act.Adopted) -> None:
        self.observer.adopted(node.name, action.head, action.head_id, self.sim.now)

    def _do_reported(self, node: _Node, action: act.Reported) -> None:
        self.observer.reported(node.name, action.peer_id, action.reason)

    # --- results -------------------------------------------------------------------------

    def honest_nodes(self) -> list[_Node]:
        return [n for n in self.nodes.values() if n.behaviour == "honest" and n.up]
