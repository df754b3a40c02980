"""Which runner holds which roles (DESIGN §2): the table a node is built from.

* ``trainer``: a :class:`~.trainer_runner.TrainerRunner` around a :class:`TrainerMachine`;
* ``reducer``, ``validator`` or both: a :class:`~.participant_runner.ParticipantRunner`
  around one :class:`Participant` (a validator that is also a reducer proposes in its slot);
* ``seed`` or ``viewer`` alone: a plain :class:`~.runner.RoleRunner` around a
  :class:`Follower`, which keeps each certified head's weights to serve and export.

A node of several roles holds several runners (a trainer that validates: two) over one
:class:`Follower`: one chain, one copy of the weights and outer-optimizer state, each
certificate verified once. The first runner (the participant's, when there is one: it
computes heads) takes the chain's inputs; the node tells the others when the base moved. A
seed or viewer beside a trainer or participant needs no runner of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from p2ptrain.driver.failures import FailureBook
from p2ptrain.driver.participant_runner import ParticipantRunner
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import Prepared
from p2ptrain.node.shard_cache import ShardCache
from p2ptrain.node.trainer_runner import TrainerRunner
from p2ptrain.observe.events import NodeEvent
from p2ptrain.protocol.follower import Follower
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.store.spool import FileSpool
from p2ptrain.torch.workload import Workload

__all__ = ["NodeRoles", "role_runners"]


class NodeRoles(NamedTuple):
    """A node's one follower and its runners (the first takes the chain's inputs)."""

    follower: Follower
    runners: list[RoleRunner]


def role_runners(
    roles: Iterable[str],
    prepared: Prepared,
    workload: Workload | None,
    *,
    services: PeerServices,
    failures: FailureBook,
    emit: Callable[[NodeEvent], None],
    store: NodeStore,
    shards: ShardCache | None = None,
    presence_timeout_s: float | None = None,
) -> NodeRoles:
    """The runners of a node holding ``roles`` (``store``: the node's, with a validator's
    stored votes and a trainer's saved state;
    ``presence_timeout_s``: how long a trainer not heard from is still expected to report)."""
    chosen = set(roles)
    manifest, identity, genesis = prepared.experiment.record, prepared.identity, prepared.genesis
    experiment = prepared.experiment.record_id[:16]
    key = identity.public_key
    follower = Follower(manifest, identity, genesis)
    runners: list[RoleRunner] = []
    if chosen & {"validator", "reducer"}:
        validator = "validator" in chosen
        if validator and key not in manifest.validators:
            raise LocalError(
                f"this node's key {key.hex()} is not a validator of experiment {experiment}; "
                "add it to the experiment's validators (a new revision) or run this node "
                "without --role validator"
            )
        if not validator and key not in manifest.reducers:
            raise LocalError(
                f"this node's key {key.hex()} is not a reducer of experiment {experiment}; "
                "add it to the experiment's reducers"
            )
        participant = Participant(
            manifest,
            identity,
            follower,
            validator=validator,
            reducers=manifest.reducers,
            now=time.monotonic(),
            presence_timeout_s=presence_timeout_s,
            timer=time.perf_counter,  # each reduction's wall seconds, for the status
            spool=FileSpool(store.blobs.spool_directory),  # heads' blobs: files, not memory
        )
        participant.restore_votes(store.votes(), time.monotonic())
        runners.append(ParticipantRunner(participant, services, failures, emit))
    if "trainer" in chosen:
        if workload is None:
            raise LocalError("a trainer needs a workload (the model and data to train)")
        machine = TrainerMachine(manifest, identity, follower)
        runners.append(
            TrainerRunner(machine, workload, services, failures, emit, store=store, shards=shards)
        )
    if not runners:  # a seed or viewer: follow the chain, keep the weights
        role = "seed" if "seed" in chosen else "viewer"
        runners.append(RoleRunner(role, follower, services, failures, emit))
    return NodeRoles(follower, runners)
