"""Small valid records for tests, built from deterministic keys."""

from __future__ import annotations

import hashlib

from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest, ShardInfo, WorkloadSpec
from p2ptrain.core.records import Head


def h(label: str) -> str:
    """A deterministic hex id for a label."""
    return hashlib.sha256(label.encode()).hexdigest()


def identity(n: int) -> Identity:
    """The n-th deterministic test identity."""
    return Identity.from_seed(hashlib.sha256(f"test-identity-{n}".encode()).digest())


def experiment(
    validators: list[Identity], quorum: int, authority: Identity | None = None
) -> ExperimentManifest:
    return ExperimentManifest(
        network_id=h("network"),
        study="study",
        name="exp",
        authority=(authority or identity(1000)).public_key,
        workload=WorkloadSpec(name="mlp", schema_hash=h("schema")),
        dataset=DatasetManifest(
            name="digits", shards=(ShardInfo(name="shard-0", blob_id=h("shard"), samples=100),)
        ),
        validators=tuple(sorted(v.public_key for v in validators)),
        quorum=quorum,
        lease_size=10,
        genesis_weights=h("genesis"),
    )


def head(experiment_id: str, height: int = 1, label: str = "a") -> Head:
    return Head(
        experiment_id=experiment_id,
        height=height,
        parent=h(f"parent-{label}"),
        weights_blob=h(f"weights-{label}"),
        optimizer_blob=h(f"opt-{label}"),
        accepted=tuple(sorted([h(f"u1-{label}"), h(f"u2-{label}")])),
    )
