"""A simulated network: the node's own runner, peer services and policy on a virtual
network, with faults and adversaries.

Every node runs the real state machines of :mod:`p2ptrain.protocol` (and through them the
real aggregation, codecs and signatures) behind the same intake rules
(:mod:`p2ptrain.protocol.intake`), driven by the same code a real node runs: a
:class:`~p2ptrain.driver.runner.RoleRunner` carries out its policy's effects through the
node's :class:`~p2ptrain.driver.services.PeerServices` (provider order, hedged questions,
racing, blame, window syncs, catch-up pages). The world is only what lies below them: the
virtual network and clock (:mod:`.engine`, with :class:`~.aio.SimLoop` running the
driver's asyncio code on virtual time), each node's transport and in-memory keep
(:mod:`.transport`), the training of a simulated trainer, and the faults: crashes,
partitions, slow links, loss and adversaries. Records travel as signed envelope bytes and
are opened with :func:`open_envelope`, so a forged signature is caught exactly as in a
node. A global observer checks the safety invariants (:mod:`.invariants`) from everything
the nodes certify and adopt.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2ptrain.aggregate.codecs import WindowEncoders, max_update_bytes_any
from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import KINDS, open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import Update
from p2ptrain.core.tensors import encode_state_dict, schema_of
from p2ptrain.driver.failures import FailureBook, RoleFailed
from p2ptrain.driver.participant_runner import ParticipantRunner
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.observe.events import NodeEvent, PeerReported, RoleFailure
from p2ptrain.observe.telemetry import NodeTelemetry
from p2ptrain.protocol.intake import IntakeRules
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.aio import SimLoop
from p2ptrain.sim.cast import cast, experiment_manifest, identity_of
from p2ptrain.sim.engine import LinkSpec, Network, Partition, Simulator
from p2ptrain.sim.invariants import Observer
from p2ptrain.sim.outbox import GOSSIP, Outbox, Sender
from p2ptrain.sim.scenario import Scenario
from p2ptrain.sim.trainers import SimTrainerRunner
from p2ptrain.sim.transport import (
    ANSWER,
    ASK,
    LyingTransport,
    SimKeep,
    SimMessage,
    SimPeer,
    SimTransport,
)
from p2ptrain.sim.workloads import make_workload

__all__ = ["World"]

MAX_ENVELOPE = 1 << 20


@dataclass
class _Node:
    name: str
    identity: Identity
    machine: RoleMachine
    role: str  # trainer | validator | reducer
    keep: SimKeep
    behaviour: str = "honest"
    up: bool = True
    stopped: bool = False
    trainer_index: int = -1
    encoder: WindowEncoders | None = None
    transport: SimTransport | None = None
    #: The node's driver: built at start and again at each restart (memory is lost).
    runner: RoleRunner | None = None
    task: asyncio.Task[None] | None = None

    @property
    def sender(self) -> Sender:
        return Sender(self.name, self.identity, self.behaviour, self.machine)


class World:
    """Builds and runs one :class:`Scenario`."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.sim = Simulator(self.rng)
        self.loop = SimLoop(self.sim)
        default = LinkSpec(latency_s=scenario.latency_s, loss=scenario.loss)
        self.net = Network(self.sim, default)
        self.workload = make_workload(scenario.workload, scenario.seed)
        self.genesis = self.workload.genesis()
        self.nodes: dict[str, _Node] = {}
        #: Every node as its peers know it, by peer id.
        self.peers: dict[str, SimPeer] = {}
        #: What went wrong in a role (a step that raised): a bug, never a fault.
        self.role_failures: list[str] = []
        #: Counters of the driver's peer services, shared by the nodes (none is exported).
        self.telemetry = NodeTelemetry()
        names = cast(scenario)
        validator_ids = {n: identity_of(scenario.seed, n) for n in names["validator"]}
        reducer_ids = {n: identity_of(scenario.seed, n) for n in names["reducer"]}
        trainer_ids = {n: identity_of(scenario.seed, n) for n in names["trainer"]}
        self.manifest = experiment_manifest(
            scenario,
            self.workload,
            self.genesis,
            list(validator_ids.values()),
            list(reducer_ids.values()),
        )
        self.observer = Observer(self.manifest)
        self.observer.now = lambda: self.sim.now
        reducers = [i.public_key for i in reducer_ids.values()]
        self.participants: list[str] = [*reducer_ids, *validator_ids]
        self.intake = IntakeRules(
            self.manifest,
            self.manifest.id,
            max_update_bytes=max_update_bytes_any(self.manifest.codec, schema_of(self.genesis)),
        )
        self.outbox = Outbox(
            self.net,
            self.observer,
            self.manifest,
            scenario,
            participants=self.participants,
            validators=list(validator_ids),
            everyone=lambda: list(self.nodes),
        )
        self._genesis_blob = bytes(encode_state_dict(self.genesis))
        roles = {
            **dict.fromkeys(reducer_ids, "reducer"),
            **dict.fromkeys(validator_ids, "validator"),
        }
        for name, identity in {**reducer_ids, **validator_ids, **trainer_ids}.items():
            role = roles.get(name, "trainer")
            self.peers[identity.peer_id] = SimPeer(
                name, identity.peer_id, identity.public_key, (role,)
            )
        for name, identity in [*reducer_ids.items(), *validator_ids.items()]:
            role = roles[name]
            machine = Participant(
                self.manifest, identity, self.genesis, validator=role == "validator",
                reducers=reducers,
            )  # fmt: skip
            self._add(
                _Node(
                    name, identity, machine, role, SimKeep(), names["behaviour"].get(name, "honest")
                )
            )
        for index, (name, identity) in enumerate(trainer_ids.items()):
            trainer = TrainerMachine(self.manifest, identity, self.genesis)
            behaviour = names["behaviour"].get(name, "honest")
            node = _Node(
                name, identity, trainer, "trainer", SimKeep(), behaviour, trainer_index=index
            )
            node.encoder = WindowEncoders(self.manifest.codec, schema_of(self.genesis), seed=index)
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

    def _add(self, node: _Node) -> None:
        self.nodes[node.name] = node
        node.keep.blobs.put(self._genesis_blob)
        kind = LyingTransport if node.behaviour == "lying_provider" else SimTransport
        node.transport = kind(
            node.sender,
            net=self.net,
            outbox=self.outbox,
            keep=node.keep,
            chain=lambda: node.machine.chain,
            peers=self.peers,
            roles=(node.role,),
            now=lambda: self.sim.now,
        )
        self.net.add_node(node.name, functools.partial(self._deliver, node))

    def _node(self, name: str) -> _Node:
        if name not in self.nodes:
            raise LocalError(f"no simulated node named {name!r} (names: t0.., v0.., r0..)")
        return self.nodes[name]

    # --- the driver of each node ---------------------------------------------------------

    def _services(self, node: _Node) -> PeerServices:
        """The node's peer services over its transport and keep (fresh at each start: what
        they remember of providers is in memory)."""
        assert node.transport is not None
        seed = int.from_bytes(
            hashlib.sha256(f"{self.scenario.seed}/{node.name}".encode()).digest()[:8]
        )
        return PeerServices(
            net=node.transport,
            identity=node.identity,
            store=node.keep,
            storage=StorageHealth(f"the memory of simulated node {node.name}"),
            experiment_id=self.manifest.id,
            bootstrap=(),
            keeps_records=node.role != "trainer",
            emit=self.emit_for(node),
            # records fetched by a window sync pass the same intake as gossip
            admit=lambda signed: self.intake.judge(signed, node.machine.chain.height + 1),
            on_adopted=lambda machine, e: self.observer.adopted(
                node.name, e.head, e.head_id, self.sim.now
            ),
            telemetry=self.telemetry,
            seed=seed,
        )

    def _start(self, node: _Node, restart: bool = False) -> None:
        """Build the node's runner and run it as a task of the world's loop."""
        services = self._services(node)
        machine = node.machine
        runner: RoleRunner
        if isinstance(machine, Participant):
            if restart:
                machine.restart(self.sim.now)
            runner = ParticipantRunner(machine, services, FailureBook(), self.emit_for(node))
        else:
            assert isinstance(machine, TrainerMachine) and node.encoder is not None
            runner = SimTrainerRunner(
                machine,
                services,
                self.emit_for(node),
                sim=self.sim,
                outbox=self.outbox,
                workload=self.workload,
                sender=lambda: node.sender,
                trainer_index=node.trainer_index,
                encoder=node.encoder,
                training=lambda: node.up and not node.stopped,
            )
        node.runner = runner
        if restart and not isinstance(machine, Participant):
            runner.execute(runner.policy.carry(self.sim.now, machine.start(self.sim.now)))
        elif not restart:
            runner.start(self.sim.now)
        node.task = self.loop.create_task(self._run(node, runner), name=node.name)

    async def _run(self, node: _Node, runner: RoleRunner) -> None:
        try:
            await runner.run()
        except RoleFailed as failed:
            self.role_failures.append(f"{node.name}: {failed}")

    def emit_for(self, node: _Node) -> Callable[[NodeEvent], None]:
        """What a node's roles tell: reports go to the observer, role failures are kept."""

        def emit(event: NodeEvent) -> None:
            if isinstance(event, PeerReported):
                self.observer.reported(node.name, event.peer, event.reason)
            elif isinstance(event, RoleFailure):
                self.role_failures.append(f"{node.name}: {event.step}: {event.message}")

        return emit

    # --- running -------------------------------------------------------------------------

    def run(self) -> None:
        s = self.scenario
        with self.loop.running():
            for node in self.nodes.values():
                self._start(node)
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
            try:
                self.sim.run(until=limit, max_events=50_000_000)
            finally:
                self.loop.settle()
        if self.loop.errors:
            raise LocalError(f"seed {s.seed}: the simulation raised: {self.loop.errors[:3]}")

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
                self.outbox.send_certificate(node.sender, tip.head, tip.certificate)

    def _crash(self, node: _Node) -> None:
        node.up = False
        self.net.set_up(node.name, False)
        if node.task is not None:
            node.task.cancel()
            node.task = None

    def _restart(self, node: _Node) -> None:
        """Back from a crash: what a node persists (chain, votes, weights, its store)
        survives; the window's in-memory updates and proposals, its policy's buffers and
        what its services remembered of providers do not."""
        node.up = True
        self.net.set_up(node.name, True)
        self._start(node, restart=True)

    # --- what arrives --------------------------------------------------------------------

    def _deliver(self, node: _Node, sender: str, message: object) -> None:
        if not node.up:
            return
        assert isinstance(message, tuple) and node.transport is not None
        kind = message[0]
        if kind == GOSSIP:
            self._gossip(node, sender, *message[1:])
        elif kind == ASK:
            node.transport.answer(sender, *message[1:])
        elif kind == ANSWER:
            node.transport.answered(*message[1:])

    def _gossip(
        self, node: _Node, sender: str, kind: str, payload: Any, blob: bytes | None
    ) -> None:
        """A record on the wire: verified and judged by the intake rules before the node's
        runner sees it (the same order as a node's topic validator)."""
        assert node.runner is not None
        from_peer = self.nodes[sender].identity.peer_id
        if isinstance(payload, CertifiedLink):
            # verified by the chain it extends (a node's topic validator checks it first
            # only because it forwards it; nobody forwards here)
            self.observer.saw_certificate(payload.head, payload.certificate, node.name)
            node.runner.receive(SimMessage(kind, b"", payload, from_peer))
            return
        try:
            signed = open_envelope(payload, KINDS[kind].type, max_bytes=MAX_ENVELOPE)
        except ProtocolViolation as error:
            self.observer.rejected_from(sender, f"{kind}: {error}")
            return
        admission = self.intake.judge(signed, node.machine.chain.height + 1)
        if admission.rejected:
            self.observer.rejected_from(sender, f"{kind}: {admission.reason}")
            return
        if not admission.accepted:
            return
        update = signed.record
        if (
            blob is not None
            and isinstance(update, Update)
            and sha256_hex(blob) == update.delta_blob
        ):
            # a blob that came with its update (a node would fetch it from the trainer at
            # once): kept if it is what the update names
            node.keep.blobs.put(blob)
        node.runner.receive(SimMessage(kind, payload, signed, from_peer))

    # --- results -------------------------------------------------------------------------

    def honest_nodes(self) -> list[_Node]:
        return [n for n in self.nodes.values() if n.behaviour == "honest" and n.up]
