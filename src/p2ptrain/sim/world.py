"""A simulated network: real protocol machines and the node's own policy on a virtual
network, with faults and adversaries.

Every node runs the real state machines of :mod:`p2ptrain.protocol` (and through them the
real aggregation, codecs and signatures) behind the same intake rules
(:mod:`p2ptrain.protocol.intake`) and effect policy (:mod:`p2ptrain.protocol.policy`) as a
real node. The world is only their transport: it carries out each effect -- a record sent
through the :class:`~.outbox.Outbox`, bytes kept in the node's in-memory store, one try of
a fetch answered from another node's store (or lost, and timed out), a wait, a training
run -- and hands what comes back to the policy. Records travel as signed envelope bytes and
are opened with :func:`open_envelope`, so a forged signature is caught exactly as in a node.
A global observer checks the safety invariants (:mod:`.invariants`) from everything the
nodes certify and adopt.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.aggregate.codecs import make_encoder, max_update_bytes
from p2ptrain.core.certificate import CertifiedLink
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import KINDS, Signed, open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    AggregationSpec,
    CodecSpec,
    ExperimentManifest,
    WindowSpec,
    WorkloadSpec,
)
from p2ptrain.core.records import Head, Update
from p2ptrain.core.tensors import encode_state_dict, schema_hash, schema_of
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.chain import MAX_LINKS_PER_PAGE, ChainPage
from p2ptrain.protocol.effects import (
    AggregateFetch,
    BlobFetch,
    ChainFetch,
    Effect,
    Fetch,
    KeepState,
    Publish,
    RecordFetch,
    Request,
    StateFetch,
    StoreBlob,
    StoreRecord,
    StoreVote,
    TrainLater,
    WindowSync,
)
from p2ptrain.protocol.intake import IntakeRules
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.policy import RolePolicy, TrainerPolicy, policy_for
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.adversaries import trained_update
from p2ptrain.sim.engine import LinkSpec, Network, Partition, Simulator
from p2ptrain.sim.invariants import Observer
from p2ptrain.sim.outbox import GOSSIP, Outbox, Sender
from p2ptrain.sim.scenario import Scenario
from p2ptrain.sim.workloads import make_workload

__all__ = ["World"]

MAX_ENVELOPE = 1 << 20
#: A fetch nobody answered in this long failed in transit (its request or answer was lost).
FETCH_TIMEOUT_S = 10.0


def _identity(seed: int, name: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(f"sim/{seed}/{name}".encode()).digest())


@dataclass
class _Node:
    name: str
    identity: Identity
    machine: RoleMachine
    role: str  # trainer | validator | reducer
    behaviour: str = "honest"
    up: bool = True
    stopped: bool = False
    timer: Any = None
    trainer_index: int = -1
    encoder: Any = None
    policy: RolePolicy = field(init=False)
    #: What the node keeps: blobs by hash, signed records by id (lost in a crash are
    #: neither: a node's store is on disk).
    blobs: dict[str, bytes] = field(default_factory=dict)
    records: dict[str, bytes] = field(default_factory=dict)
    #: The kind and id of each record kept, by window (what a window sync is answered).
    by_window: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    #: Fetches in flight: token -> request.
    pending: dict[int, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.policy = policy_for(self.machine)

    @property
    def sender(self) -> Sender:
        return Sender(self.name, self.identity, self.behaviour, self.machine)


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
        self._handlers = self._effect_handlers()
        self.by_peer: dict[str, str] = {}
        self._tokens = 0
        names = self._names()
        validator_ids = {n: _identity(scenario.seed, n) for n in names["validator"]}
        reducer_ids = {n: _identity(scenario.seed, n) for n in names["reducer"]}
        self.manifest = self._manifest(list(validator_ids.values()), list(reducer_ids.values()))
        self.observer = Observer(self.manifest)
        self.observer.now = lambda: self.sim.now
        reducers = [i.public_key for i in reducer_ids.values()]
        self.participants: list[str] = [*reducer_ids, *validator_ids]
        self.intake = IntakeRules(
            self.manifest,
            self.manifest.id,
            max_update_bytes=max_update_bytes(self.manifest.codec, schema_of(self.genesis)),
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

    def _manifest(self, validators: list[Identity], reducers: list[Identity]) -> ExperimentManifest:
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
            reducers=tuple(sorted(r.public_key for r in reducers)),
            quorum=s.quorum,
            lease_size=min(64, sum(x.samples for x in self.workload.dataset().shards)),
            genesis_weights=sha256_hex(bytes(encode_state_dict(self.genesis))),
        )

    def _add(self, node: _Node) -> None:
        self.nodes[node.name] = node
        self.by_peer[node.identity.peer_id] = node.name
        node.blobs[sha256_hex(self._genesis_blob)] = self._genesis_blob
        self.net.add_node(node.name, functools.partial(self._deliver, node))

    def _node(self, name: str) -> _Node:
        if name not in self.nodes:
            raise LocalError(f"no simulated node named {name!r} (names: t0.., v0.., r0..)")
        return self.nodes[name]

    # --- running -------------------------------------------------------------------------

    def run(self) -> None:
        s = self.scenario
        for node in self.nodes.values():
            self._carry(node, node.policy.start(0.0))
            if node.role != "trainer":
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
                self.outbox.send_certificate(node.sender, tip.head, tip.certificate)

    def _schedule_tick(self, node: _Node) -> None:
        """Wake the participant at its next slot boundary (moved only when it changed: a
        new window opened)."""
        when = node.machine.next_wakeup(self.sim.now)
        if when is None:
            return
        if node.timer is not None:
            if node.timer.when == when:
                return
            node.timer.cancel()
        node.timer = self.sim.call_at(when, functools.partial(self._tick, node))

    def _tick(self, node: _Node) -> None:
        node.timer = None
        if not node.up:
            return
        self._carry(node, node.policy.tick(self.sim.now))
        self._schedule_tick(node)

    def _crash(self, node: _Node) -> None:
        node.up = False
        self.net.set_up(node.name, False)
        node.pending.clear()
        if node.timer is not None:
            node.timer.cancel()
            node.timer = None

    def _restart(self, node: _Node) -> None:
        """Back from a crash: what a node persists (chain, votes, weights, its store)
        survives; the window's in-memory updates and proposals, and its policy's buffers,
        do not."""
        node.up = True
        self.net.set_up(node.name, True)
        machine = node.machine
        node.policy = policy_for(machine)
        if isinstance(machine, Participant):
            machine.restart(self.sim.now)
            self._schedule_tick(node)
        elif isinstance(machine, TrainerMachine):
            self._carry(node, node.policy.carry(self.sim.now, machine.start(self.sim.now)))

    # --- what arrives --------------------------------------------------------------------

    def _deliver(self, node: _Node, sender: str, message: object) -> None:
        if not node.up:
            return
        assert isinstance(message, tuple)
        kind = message[0]
        if kind == GOSSIP:
            self._gossip(node, sender, *message[1:])
        elif kind == _ASK:
            self._answer(node, sender, *message[1:])
        elif kind == _ANSWER:
            self._answered(node, *message[1:])
        if node.timer is not None:
            self._schedule_tick(node)

    def _gossip(
        self, node: _Node, sender: str, kind: str, payload: Any, blob: bytes | None
    ) -> None:
        """A record on the wire: verified and judged by the intake rules before the node's
        policy sees it (the same order as a node's topic validator)."""
        now = self.sim.now
        if isinstance(payload, CertifiedLink):
            # verified by the chain it extends (a node's topic validator checks it first
            # only because it forwards it; nobody forwards here)
            self.observer.saw_certificate(payload.head, payload.certificate, node.name)
            key = self.nodes[sender].identity.public_key
            self._carry(node, node.policy.certificate(now, payload.head, payload.certificate, key))
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
        if blob is not None and isinstance(signed.record, Update):
            self._hold_blob(node, signed.record.delta_blob, blob)
        self._carry(node, node.policy.record(now, signed, len(payload)))

    @staticmethod
    def _hold_blob(node: _Node, blob_id: str, blob: bytes) -> None:
        """A blob that came with its update (a node would fetch it from the trainer at
        once): kept if it is what the update names."""
        if sha256_hex(blob) == blob_id:
            node.blobs[blob_id] = blob

    # --- effects -------------------------------------------------------------------------

    def _carry(self, node: _Node, effects: list[Effect]) -> None:
        """Carry out a node's effects in order: the simulator is only their transport (how,
        for each kind of effect: :meth:`_effect_handlers`)."""
        for effect in effects:
            self._handlers[type(effect)](node, effect)

    def _effect_handlers(self) -> dict[type[Any], Callable[[_Node, Any], None]]:
        return {
            Publish: lambda node, e: self.outbox.publish(node.sender, e),
            StoreBlob: lambda node, e: node.blobs.__setitem__(
                e.blob_id or sha256_hex(e.data), e.data
            ),
            KeepState: self._keep_state,
            StoreRecord: self._store_record,
            StoreVote: lambda node, e: None,  # the machine's votes outlive a simulated crash
            Fetch: lambda node, e: self.sim.call_later(
                e.delay_s, functools.partial(self._try, node, e)
            ),
            TrainLater: lambda node, e: self.sim.call_later(
                e.delay_s, functools.partial(self._due, node, e.train)
            ),
            act.Train: self._train,
            act.Reported: lambda node, e: self.observer.reported(node.name, e.peer_id, e.reason),
            act.Adopted: lambda node, e: self.observer.adopted(
                node.name, e.head, e.head_id, self.sim.now
            ),
            act.Notice: lambda node, e: None,  # said once to a person: nobody reads it here
        }

    @staticmethod
    def _store_record(node: _Node, effect: StoreRecord) -> None:
        record_id = effect.signed.record_id
        if record_id not in node.records:
            node.by_window.setdefault(effect.window, []).append((effect.kind, record_id))
        node.records[record_id] = bytes(effect.signed.envelope.encode())

    @staticmethod
    def _keep_state(node: _Node, effect: KeepState) -> None:
        """The adopted head's state is kept (peers fetch it from here)."""
        if effect.head.weights_blob not in node.blobs:
            for blob in effect.blobs() or ():
                if blob is not None:
                    node.blobs[sha256_hex(blob)] = blob

    def _due(self, node: _Node, train: act.Train) -> None:
        if node.up and isinstance(node.policy, TrainerPolicy):
            self._carry(node, node.policy.train_due(self.sim.now, train))

    def _train(self, node: _Node, action: act.Train) -> None:
        if node.stopped:
            return
        delay = self.workload.train_seconds * (0.8 + 0.4 * self.rng.random())
        self.sim.call_later(delay, lambda: self._trained(node, action))

    def _trained(self, node: _Node, action: act.Train) -> None:
        machine, policy = node.machine, node.policy
        assert isinstance(machine, TrainerMachine) and isinstance(policy, TrainerPolicy)
        if not node.up or node.stopped:
            return
        result = trained_update(
            self.outbox,
            node.sender,
            machine,
            action,
            workload=self.workload,
            trainer_index=node.trainer_index,
            encoder=node.encoder,
        )
        if result is not None:
            self._carry(node, policy.trained(self.sim.now, action, *result))

    # --- fetching: one try per Fetch effect ----------------------------------------------

    def _try(self, node: _Node, fetch: Fetch) -> None:
        """One try: from the node's own store if it holds the answer, else ask one peer
        (whom the policy named, or any participant) and time out if nobody answers."""
        if not node.up:
            return
        request = fetch.request
        local = self._lookup(node, request)
        if local is not None:
            self._carry(node, node.policy.fetched(self.sim.now, request, local))
            return
        target = self._target(node, request)
        if target is None:
            self._carry(node, node.policy.fetch_failed(self.sim.now, request, proven_bad=False))
            return
        self._tokens += 1
        token = self._tokens
        node.pending[token] = request
        self.net.send(node.name, target, (_ASK, token, request), 128)
        self.sim.call_later(FETCH_TIMEOUT_S, lambda: self._answered(node, token, None))

    def _target(self, node: _Node, request: Request) -> str | None:
        named: tuple[str | None, ...]
        if isinstance(request, BlobFetch | StateFetch | AggregateFetch):
            named = request.first
        elif isinstance(request, RecordFetch):
            named = (request.proposer,)
        elif isinstance(request, WindowSync):
            named = ()
        else:
            named = (request.peer,)
        for peer_id in named:
            name = self.by_peer.get(peer_id or "")
            if name is not None and name != node.name:
                return name
        others = [p for p in self.participants if p != node.name]
        return self.rng.choice(others) if others else None

    def _lookup(self, node: _Node, request: Request) -> Any:
        """What ``node`` holds to answer ``request``, or None."""
        if isinstance(request, BlobFetch):
            return node.blobs.get(request.update.record.delta_blob)
        if isinstance(request, RecordFetch):
            raw = node.records.get(request.update_id)
            return None if raw is None else open_envelope(raw, Update)
        if isinstance(request, StateFetch):
            return self._state(node, request.head)
        if isinstance(request, AggregateFetch):
            return node.blobs.get(request.head.aggregate_blob or "")
        return None  # a catch-up always asks a peer

    def _state(self, node: _Node, head: Head) -> tuple[bytes, bytes | None] | None:
        weights = node.blobs.get(head.weights_blob)
        optimizer = None if head.optimizer_blob is None else node.blobs.get(head.optimizer_blob)
        if weights is None or (head.optimizer_blob is not None and optimizer is None):
            return None
        return weights, optimizer

    def _answer(self, node: _Node, asker: str, token: int, request: Request) -> None:
        """Serve a peer's fetch from what this node keeps (None: it holds nothing)."""
        answer: Any = None
        size = 64
        if isinstance(request, ChainFetch):
            chain = node.machine.chain
            links = chain.links_after(request.after_height)[:MAX_LINKS_PER_PAGE]
            if links:
                holds = chain.held_heights(lambda head: self._state(node, head) is not None)
                answer = ChainPage(tuple(links), chain.height, holds, node.identity.public_key)
                size = 1024 * len(links) + 8 * len(holds)
        elif isinstance(request, WindowSync):
            held = node.by_window.get(request.window, [])
            answer = [(k, node.records[i]) for k, i in held if i not in request.held]
            size += 80 * len(held) + sum(len(raw) for _, raw in answer)
        else:
            answer = self._lookup(node, request)
            if isinstance(answer, bytes):
                size += len(answer)
            elif isinstance(answer, tuple):
                size += len(answer[0]) + len(answer[1] or b"")
            elif answer is not None:
                answer = bytes(answer.envelope.encode())
                size += len(answer)
        self.net.send(node.name, asker, (_ANSWER, token, answer), size)

    def _answered(self, node: _Node, token: int, answer: Any) -> None:
        """An answer (None: the peer held nothing, or nobody answered in time): checked
        against what was asked, then handed to the policy."""
        request = node.pending.pop(token, None)
        if request is None or not node.up:
            return  # answered already, or timed out
        now = self.sim.now
        if answer is None:
            self._carry(node, node.policy.fetch_failed(now, request, proven_bad=False))
            return
        if isinstance(request, BlobFetch):
            if sha256_hex(answer) != request.update.record.delta_blob:
                self._carry(node, node.policy.fetch_failed(now, request, proven_bad=True))
                return
            node.blobs[request.update.record.delta_blob] = answer
        elif isinstance(request, RecordFetch):
            answer = open_envelope(answer, Update, max_bytes=MAX_ENVELOPE)
            if answer.record_id != request.update_id:
                self._carry(node, node.policy.fetch_failed(now, request, proven_bad=True))
                return
        elif isinstance(request, AggregateFetch):
            if sha256_hex(answer) != request.head.aggregate_blob:
                self._carry(node, node.policy.fetch_failed(now, request, proven_bad=True))
                return
            node.blobs[sha256_hex(answer)] = answer
        elif isinstance(request, WindowSync):
            answer = self._admitted(node, answer)
        elif isinstance(request, StateFetch):
            head = request.head
            weights, optimizer = answer
            if sha256_hex(weights) != head.weights_blob:
                self._carry(node, node.policy.fetch_failed(now, request, proven_bad=True))
                return
            node.blobs[head.weights_blob] = weights
            if optimizer is not None:
                node.blobs[sha256_hex(optimizer)] = optimizer
        self._carry(node, node.policy.fetched(now, request, answer))

    def _admitted(self, node: _Node, answer: list[tuple[str, bytes]]) -> list[Signed[Any]]:
        """A window sync's records, verified and through intake (as if gossip brought
        them); those that fail are dropped (a node blames their signer or the peer that
        served them; nodes here serve only what they kept)."""
        admitted = []
        for kind, raw in answer:
            try:
                signed = open_envelope(raw, KINDS[kind].type, max_bytes=MAX_ENVELOPE)
            except ProtocolViolation:
                continue
            if self.intake.judge(signed, node.machine.chain.height + 1).accepted:
                admitted.append(signed)
        return admitted

    # --- results -------------------------------------------------------------------------

    def honest_nodes(self) -> list[_Node]:
        return [n for n in self.nodes.values() if n.behaviour == "honest" and n.up]


_ASK = "ask"
_ANSWER = "answer"
