"""Hypothesis strategies producing valid p2ptrain records."""

from __future__ import annotations

import hashlib

from hypothesis import strategies as st

from p2ptrain.core.certificate import QuorumCertificate, ValidatorSignature
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    AGGREGATION_RULES,
    INNER_OPTIMIZERS,
    INNER_SCHEDULES,
    UPDATE_CODECS,
    AggregationSpec,
    CodecSpec,
    DatasetManifest,
    ExperimentManifest,
    InnerOptimizerSpec,
    NetworkManifest,
    OuterOptimizerSpec,
    ScreeningSpec,
    ShardInfo,
    WindowSpec,
    WorkloadSpec,
)
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import (
    REACHABILITY,
    ROLES,
    AdmissionCertificate,
    Attestation,
    Head,
    MetricsReport,
    PeerRecord,
    Proposal,
    QuarantineEntry,
    Rejection,
    Revocation,
    Update,
)

hex_ids = st.binary(min_size=0, max_size=16).map(lambda b: hashlib.sha256(b).hexdigest())
keys = st.binary(min_size=32, max_size=32)
#: Free text a record's check takes (printable, short).
printable = st.text(max_size=40).filter(str.isprintable)
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
#: ``[A-Za-z0-9][A-Za-z0-9._-]{0,30}``, drawn as two choices (a regex draws every character).
names = st.builds(
    str.__add__, st.sampled_from(_ALNUM), st.text(alphabet=_ALNUM + "._-", max_size=30)
)
texts = st.text(
    st.characters(codec="utf-8", categories=["L", "N", "P"], include_characters=" "), max_size=60
)
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)

#: The arguments each reason code takes (core/reasons.py).
_ARG = {"i": st.integers(0, 2**40), "f": finite, "s": names}
_REASON_ARGS = {
    Code.QUARANTINED: "i",
    Code.WRONG_CODEC: "ss",
    Code.LEASE_SHARDS: "i",
    Code.LEASE_SAMPLES: "ii",
    Code.NOT_FLOAT32: "s",
    Code.WRONG_SHAPE: "s",
    Code.NOT_FINITE: "s",
    Code.NORM_ABOVE: "ff",
    Code.NORM_BELOW: "ff",
    Code.COSINE_BELOW: "ff",
}
reasons = st.sampled_from(list(Code)).flatmap(
    lambda code: st.tuples(*(_ARG[kind] for kind in _REASON_ARGS.get(code, ""))).map(
        lambda args: Reason(code, args)
    )
)
addresses = st.builds(
    "{}://{}:{}".format,
    st.sampled_from(["http", "https"]),
    st.builds(
        str.__add__,
        st.sampled_from(_ALNUM[26:]),
        st.text(alphabet=_ALNUM[26:] + ".-", max_size=20),
    ),
    st.integers(1, 65535),
)
config_values = st.one_of(st.booleans(), st.integers(-(2**40), 2**40), finite, texts)
configs = st.dictionaries(names, config_values, max_size=4)
identities = st.binary(min_size=32, max_size=32).map(Identity.from_seed)


def sorted_unique(elements: st.SearchStrategy[str], max_size: int = 5, min_size: int = 0):  # type: ignore[no-untyped-def]
    return st.lists(elements, min_size=min_size, max_size=max_size, unique=True).map(
        lambda xs: tuple(sorted(xs))
    )


@st.composite
def network_manifests(draw: st.DrawFn, authority: bytes | None = None) -> NetworkManifest:
    admission = draw(st.sampled_from(["open", "certificate"]))
    issuers = (
        draw(st.lists(keys, min_size=1, max_size=3, unique=True)) if admission != "open" else []
    )
    return NetworkManifest(
        name=draw(names),
        authority=authority if authority is not None else draw(keys),
        bootstrap=tuple(draw(st.lists(addresses, max_size=3))),
        admission=admission,
        issuer_keys=tuple(sorted(issuers)),
        secret_check=draw(st.none() | st.binary(min_size=32, max_size=32)),
    )


@st.composite
def experiment_manifests(draw: st.DrawFn, authority: bytes | None = None) -> ExperimentManifest:
    shards = draw(sorted_unique(names, min_size=1, max_size=4))
    dataset = DatasetManifest(
        name=draw(names),
        shards=tuple(
            ShardInfo(name=n, blob_id=draw(hex_ids), samples=draw(st.integers(1, 10_000)))
            for n in shards
        ),
    )
    validators = tuple(sorted(draw(st.lists(keys, min_size=1, max_size=7, unique=True))))
    min_updates = draw(st.integers(1, 50))
    revision = draw(st.integers(1, 5))
    parent = draw(hex_ids) if revision > 1 and draw(st.booleans()) else None
    fedavg = draw(st.booleans())
    outer = (
        OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.0)
        if fedavg
        else OuterOptimizerSpec(
            name="nesterov",
            lr=draw(st.floats(0.01, 2.0)),
            momentum=draw(st.floats(0.0, 0.99)),
        )
    )
    return ExperimentManifest(
        network_id=draw(hex_ids),
        study=draw(names),
        name=draw(names),
        revision=revision,
        parent=parent,
        start_head=draw(hex_ids) if parent else None,
        authority=authority if authority is not None else draw(keys),
        workload=WorkloadSpec(name=draw(names), schema_hash=draw(hex_ids), config=draw(configs)),
        dataset=dataset,
        protocol="fedavg" if fedavg else "diloco",
        inner_optimizer=InnerOptimizerSpec(
            name=draw(st.sampled_from(INNER_OPTIMIZERS)),
            lr=draw(st.floats(1e-6, 1.0)),
            config=draw(configs),
            schedule=draw(st.sampled_from(INNER_SCHEDULES)),
            warmup_windows=draw(st.integers(0, 100)),
            decay_windows=draw(st.integers(1, 10_000)),
            min_lr_ratio=draw(st.floats(0.0, 1.0)),
        ),
        inner_steps=draw(st.integers(1, 1000)),
        outer_optimizer=outer,
        window=WindowSpec(
            deadline_s=draw(st.floats(0.5, 3600)),
            min_updates=min_updates,
            max_updates=draw(st.integers(min_updates, 5000)),
        ),
        codec=CodecSpec(name=draw(st.sampled_from(UPDATE_CODECS)), config=draw(configs)),
        aggregation=AggregationSpec(
            rule=draw(st.sampled_from(AGGREGATION_RULES)), config=draw(configs)
        ),
        screening=ScreeningSpec(
            max_norm_ratio=draw(st.floats(1.0, 100.0)),
            min_cosine=draw(st.floats(-1.0, 1.0)),
            quarantine_after=draw(st.integers(1, 10)),
            quarantine_windows=draw(st.integers(1, 100)),
        ),
        validators=validators,
        quorum=draw(st.integers(1, len(validators))),
        lease_size=draw(st.integers(1, dataset.total_samples)),
        genesis_weights=draw(hex_ids),
    )


@st.composite
def peer_records(draw: st.DrawFn, public_key: bytes | None = None) -> PeerRecord:
    reachability = draw(st.sampled_from(REACHABILITY))
    return PeerRecord(
        network_id=draw(hex_ids),
        public_key=public_key if public_key is not None else draw(keys),
        seq=draw(st.integers(0, 2**40)),
        roles=draw(sorted_unique(st.sampled_from(ROLES), min_size=1)),
        reachability=reachability,
        addresses=tuple(
            draw(st.lists(addresses, min_size=1 if reachability == "public" else 0, max_size=3))
        ),
        relay=draw(addresses) if reachability == "relayed" else None,
        tls_fingerprint=draw(st.none() | hex_ids),
        issued_at_ms=draw(st.integers(0, 2**45)),
    )


@st.composite
def updates(draw: st.DrawFn, trainer: bytes | None = None) -> Update:
    return Update(
        experiment_id=draw(hex_ids),
        window=draw(st.integers(1, 2**31)),
        base_head=draw(hex_ids),
        trainer=trainer if trainer is not None else draw(keys),
        lease_shards=draw(sorted_unique(names, min_size=1)),
        lease_samples=draw(st.integers(1, 10**6)),
        delta_blob=draw(hex_ids),
        delta_bytes=draw(st.integers(1, 2**34)),
        codec=draw(st.sampled_from(UPDATE_CODECS)),
        loss_before=draw(finite),
        loss_after=draw(finite),
    )


@st.composite
def heads(draw: st.DrawFn, experiment_id: str | None = None, height: int | None = None) -> Head:
    h = height if height is not None else draw(st.integers(0, 10_000))
    quarantined = draw(sorted_unique(hex_ids, max_size=3))
    return Head(
        experiment_id=experiment_id or draw(hex_ids),
        height=h,
        parent=None if h == 0 else draw(hex_ids),
        weights_blob=draw(hex_ids),
        optimizer_blob=draw(st.none() | hex_ids),
        accepted=() if h == 0 else draw(sorted_unique(hex_ids, max_size=6)),
        quarantine=tuple(
            QuarantineEntry(
                peer_id=p, until_window=draw(st.integers(1, 10**6)), reason=draw(reasons)
            )
            for p in quarantined
        ),
        aggregate_blob=None if h == 0 else draw(hex_ids),
    )


@st.composite
def proposals(draw: st.DrawFn, reducer: bytes | None = None) -> Proposal:
    head = draw(heads(height=draw(st.integers(1, 10_000))))
    rejected_ids = draw(sorted_unique(hex_ids, max_size=4))
    rejected = tuple(
        Rejection(update_id=u, reason=draw(reasons)) for u in rejected_ids if u not in head.accepted
    )
    assert head.parent is not None
    return Proposal(
        experiment_id=head.experiment_id,
        window=head.height,
        base_head=head.parent,
        reducer=reducer if reducer is not None else draw(keys),
        accepted=head.accepted,
        rejected=rejected,
        aggregate_blob=head.aggregate_blob,
        head=head,
    )


@st.composite
def attestations(draw: st.DrawFn, validator: bytes | None = None) -> Attestation:
    return Attestation(
        experiment_id=draw(hex_ids),
        height=draw(st.integers(1, 2**40)),
        head_id=draw(hex_ids),
        validator=validator if validator is not None else draw(keys),
        round=draw(st.integers(0, 1 << 20)),
        stage=draw(st.sampled_from(["prevote", "commit"])),
    )


@st.composite
def certificates(draw: st.DrawFn) -> QuorumCertificate:
    signers = sorted(draw(st.lists(keys, min_size=1, max_size=5)))
    return QuorumCertificate(
        experiment_id=draw(hex_ids),
        height=draw(st.integers(1, 2**40)),
        head_id=draw(hex_ids),
        round=draw(st.integers(0, 1 << 20)),
        signatures=tuple(
            ValidatorSignature(validator=k, signature=draw(st.binary(min_size=64, max_size=64)))
            for k in signers
        ),
    )


@st.composite
def admissions(draw: st.DrawFn, issuer: bytes | None = None) -> AdmissionCertificate:
    return AdmissionCertificate(
        network_id=draw(hex_ids),
        subject=draw(keys),
        issuer=issuer if issuer is not None else draw(keys),
        not_after_ms=draw(st.integers(0, 2**50)),
        roles=tuple(sorted(draw(st.sets(st.sampled_from(ROLES))))),
        issued_at_ms=draw(st.integers(0, 2**50)),
        name=draw(printable),
    )


@st.composite
def revocations(draw: st.DrawFn, issuer: bytes | None = None) -> Revocation:
    return Revocation(
        network_id=draw(hex_ids),
        subject=draw(keys),
        issuer=issuer if issuer is not None else draw(keys),
        issued_at_ms=draw(st.integers(0, 2**50)),
        reason=draw(printable),
    )


@st.composite
def metrics_reports(draw: st.DrawFn, evaluator: bytes | None = None) -> MetricsReport:
    return MetricsReport(
        experiment_id=draw(hex_ids),
        height=draw(st.integers(0, 2**40)),
        head_id=draw(hex_ids),
        evaluator=evaluator if evaluator is not None else draw(keys),
        loss=draw(finite),
        perplexity=draw(st.none() | st.floats(0.0, 1e300)),
        samples=draw(st.integers(0, 2**40)),
    )


#: Each signed kind with a strategy that takes the author key.
AUTHORED = {
    "network": network_manifests,
    "experiment": experiment_manifests,
    "peer": peer_records,
    "update": updates,
    "proposal": proposals,
    "attestation": attestations,
    "admission": admissions,
    "revocation": revocations,
    "metrics": metrics_reports,
}
