"""Who takes part in a simulated run, and the experiment they run: names, identities
(seeded), each adversary's behaviour and the manifest."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    AggregationSpec,
    CodecSpec,
    ExperimentManifest,
    OuterOptimizerSpec,
    WindowSpec,
    WorkloadSpec,
)
from p2ptrain.core.tensors import encode_state_dict, schema_hash
from p2ptrain.sim.scenario import Scenario
from p2ptrain.sim.workloads import SimWorkload

__all__ = ["cast", "experiment_manifest", "identity_of"]


def identity_of(seed: int, name: str) -> Identity:
    """The identity of simulated node ``name`` in the run seeded ``seed``."""
    return Identity.from_seed(hashlib.sha256(f"sim/{seed}/{name}".encode()).digest())


def cast(s: Scenario) -> dict[str, Any]:
    """Who takes part: the names of the trainers, validators and reducers, and each
    adversary's behaviour by name."""
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
        elif adversary in ("lying_reducer", "silent_reducer", "lying_provider"):
            reducers.insert(0, f"x-{adversary}")
            behaviour[f"x-{adversary}"] = adversary
        elif adversary == "equivocating_validator":
            behaviour[validators[0]] = adversary
    return {"trainer": trainers, "validator": validators, "reducer": reducers,
            "behaviour": behaviour}  # fmt: skip


def experiment_manifest(
    s: Scenario,
    workload: SimWorkload,
    genesis: dict[str, torch.Tensor],
    validators: list[Identity],
    reducers: list[Identity],
) -> ExperimentManifest:
    """The experiment every simulated node runs, from ``genesis`` (the workload's)."""
    authority = identity_of(s.seed, "authority")
    train = workload.train_seconds
    return ExperimentManifest(
        network_id=sha256_hex(f"sim-network-{s.seed}".encode()),
        study="sim",
        name=s.workload,
        authority=authority.public_key,
        workload=WorkloadSpec(name=s.workload, schema_hash=schema_hash(genesis)),
        dataset=workload.dataset(),
        inner_steps=getattr(workload, "inner_steps", 1),
        window=WindowSpec(
            deadline_s=train * 2 + 5,
            min_updates=s.min_updates,
            max_updates=max(1000, s.trainers + 10),
            proposal_s=5.0,
        ),
        codec=CodecSpec(name=s.codec, config=dict(s.codec_config)),
        aggregation=AggregationSpec(rule=s.rule, precision=s.precision),
        outer_optimizer=(
            OuterOptimizerSpec()
            if s.outer == "nesterov"
            else OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0)
        ),
        validators=tuple(sorted(v.public_key for v in validators)),
        reducers=tuple(sorted(r.public_key for r in reducers)),
        quorum=s.quorum,
        lease_size=min(64, sum(x.samples for x in workload.dataset().shards)),
        genesis_weights=sha256_hex(bytes(encode_state_dict(genesis))),
    )
