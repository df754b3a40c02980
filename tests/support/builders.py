"""Small valid records for tests, built from deterministic keys."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.envelope import Signed, seal
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    CodecSpec,
    DatasetManifest,
    ExperimentManifest,
    ShardInfo,
    WindowSpec,
    WorkloadSpec,
)
from p2ptrain.core.records import Attestation, Head, PeerRecord
from p2ptrain.core.tensors import encode_state_dict, schema_hash
from p2ptrain.protocol.chain import HeadChain, genesis_head
from p2ptrain.sim.workloads import SyntheticWorkload


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


def synthetic_experiment(
    workload: SyntheticWorkload, validator: bytes, *, max_updates: int, min_updates: int = 1
) -> ExperimentManifest:
    """An experiment of the simulator's synthetic workload with one validator (q = 1) and
    a deadline of 100 s, for driving the window machines by hand."""
    genesis = workload.genesis()
    return ExperimentManifest(
        network_id=h("network"),
        study="unit",
        name="synthetic",
        authority=identity(99).public_key,
        workload=WorkloadSpec(name="synthetic", schema_hash=schema_hash(genesis)),
        dataset=workload.dataset(),
        inner_steps=1,
        window=WindowSpec(
            deadline_s=100.0, proposal_s=5.0, min_updates=min_updates, max_updates=max_updates
        ),
        codec=CodecSpec(name="fp32"),
        validators=(validator,),
        quorum=1,
        lease_size=64,
        genesis_weights=sha256_hex(bytes(encode_state_dict(genesis))),
    )


def head(experiment_id: str, height: int = 1, label: str = "a") -> Head:
    return Head(
        experiment_id=experiment_id,
        height=height,
        parent=h(f"parent-{label}"),
        weights_blob=h(f"weights-{label}"),
        optimizer_blob=h(f"opt-{label}"),
        accepted=tuple(sorted([h(f"u1-{label}"), h(f"u2-{label}")])),
        aggregate_blob=h(f"aggregate-{label}"),
    )


def child_head(parent: Head, label: str = "a", height: int | None = None) -> Head:
    """A head extending ``parent`` (at ``height``, one above it unless given)."""
    height = parent.height + 1 if height is None else height
    return Head(
        experiment_id=parent.experiment_id,
        height=height,
        parent=parent.id,
        weights_blob=h(f"weights-{height}-{label}"),
        optimizer_blob=None,
        accepted=(h(f"update-{height}-{label}"),),
        aggregate_blob=h(f"aggregate-{height}-{label}"),
    )


def certify(head: Head, signers: Sequence[Identity]) -> QuorumCertificate:
    """A quorum certificate for ``head`` signed by ``signers``."""
    return QuorumCertificate.assemble(
        seal(
            v,
            Attestation(
                experiment_id=head.experiment_id,
                height=head.height,
                head_id=head.id,
                validator=v.public_key,
                round=0,
                stage="commit",
            ),
        )
        for v in signers
    )


def certified_chain(
    manifest: ExperimentManifest, signers: Sequence[Identity], length: int
) -> HeadChain:
    """A chain of ``length`` certified heads above the manifest's genesis."""
    chain = HeadChain(manifest)
    head = genesis_head(manifest)
    for _ in range(length):
        head = child_head(head)
        verdict = chain.extend(head, certify(head, signers))
        assert verdict.ok, verdict.reason
    return chain


def peer_record(
    who: Identity, seq: int, *, network_id: str, address: str = "http://127.0.0.1:7000"
) -> Signed[PeerRecord]:
    """``who``'s signed record number ``seq``: a public trainer at ``address``."""
    return seal(
        who,
        PeerRecord(
            network_id=network_id,
            public_key=who.public_key,
            seq=seq,
            roles=("trainer",),
            reachability="public",
            addresses=(address,),
        ),
    )
