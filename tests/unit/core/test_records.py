"""Record validation rules, canonical encoding and envelope checks, case by case."""

from __future__ import annotations

import msgspec
import pytest

from p2ptrain.core.encoding import decode, encode, record_id
from p2ptrain.core.envelope import Envelope, open_envelope, seal, signing_message
from p2ptrain.core.manifests import (
    NetworkManifest,
    OuterOptimizerSpec,
    WindowSpec,
    secret_check,
)
from p2ptrain.core.reasons import Code, Reason
from p2ptrain.core.records import Head, PeerRecord, Proposal, Rejection, Update
from p2ptrain.errors import InvalidRecord, LocalError, ProtocolViolation
from tests.support.builders import experiment, h, head, identity

ALICE = identity(1)
BOB = identity(2)


def update(**changes: object) -> Update:
    fields: dict[str, object] = {
        "experiment_id": h("exp"),
        "window": 3,
        "base_head": h("base"),
        "trainer": ALICE.public_key,
        "lease_shards": ("shard-0", "shard-1"),
        "lease_samples": 64,
        "delta_blob": h("delta"),
        "delta_bytes": 1000,
        "codec": "int8",
        "loss_before": 2.5,
        "loss_after": 2.1,
    }
    fields.update(changes)
    return Update(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"experiment_id": "abc"}, "experiment_id"),
        ({"window": 0}, "window"),
        ({"trainer": b"short"}, "trainer"),
        ({"lease_shards": ("b", "a")}, "lease_shards"),
        ({"lease_shards": ("a", "a")}, "lease_shards"),
        ({"lease_shards": ()}, "lease_shards"),
        ({"lease_samples": 0}, "lease_samples"),
        ({"loss_after": float("nan")}, "loss_after"),
        ({"loss_before": float("inf")}, "loss_before"),
        ({"codec": "bad codec"}, "codec"),
    ],
)
def test_update_rejects_bad_fields(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRecord) as info:
        update(**changes)
    assert info.value.field == field


def test_head_rules() -> None:
    genesis = Head(
        experiment_id=h("e"), height=0, parent=None, weights_blob=h("w"), optimizer_blob=None
    )
    assert genesis.id == record_id(genesis)
    with pytest.raises(InvalidRecord, match="parent"):
        Head(experiment_id=h("e"), height=1, parent=None, weights_blob=h("w"), optimizer_blob=None)
    with pytest.raises(InvalidRecord, match="accepted"):
        Head(
            experiment_id=h("e"),
            height=2,
            parent=h("p"),
            weights_blob=h("w"),
            optimizer_blob=None,
            accepted=(h("b"), h("a")) if h("b") > h("a") else (h("a"), h("b")),
            aggregate_blob=h("g"),
        )
    with pytest.raises(InvalidRecord, match="aggregate_blob"):  # every later head names one
        Head(experiment_id=h("e"), height=2, parent=h("p"), weights_blob=h("w"),
             optimizer_blob=None)  # fmt: skip
    with pytest.raises(InvalidRecord, match="aggregate_blob"):  # the genesis has none
        Head(experiment_id=h("e"), height=0, parent=None, weights_blob=h("w"),
             optimizer_blob=None, aggregate_blob=h("g"))  # fmt: skip


def test_head_id_binds_parent_updates_and_weights() -> None:
    base = head(h("e"))
    ids = {
        base.id,
        msgspec.structs.replace(base, parent=h("x")).id,
        msgspec.structs.replace(base, weights_blob=h("x")).id,
        msgspec.structs.replace(base, accepted=(h("only"),)).id,
        msgspec.structs.replace(base, aggregate_blob=h("x")).id,
    }
    assert len(ids) == 5


def test_proposal_must_agree_with_its_head() -> None:
    new_head = head(h("e"), height=5)
    assert new_head.parent is not None
    fields: dict[str, object] = {
        "experiment_id": h("e"),
        "window": 5,
        "base_head": new_head.parent,
        "reducer": BOB.public_key,
        "accepted": new_head.accepted,
        "rejected": (Rejection(update_id=h("bad"), reason=Reason(Code.NORM_ABOVE, (40.0, 3.0))),),
        "aggregate_blob": new_head.aggregate_blob,
        "head": new_head,
    }
    Proposal(**fields)  # type: ignore[arg-type]
    for change, field in [
        ({"window": 6}, "head"),
        ({"base_head": h("elsewhere")}, "head"),
        ({"accepted": ()}, "head.accepted"),
        ({"aggregate_blob": h("another")}, "head.aggregate_blob"),
        (
            {
                "rejected": (
                    Rejection(update_id=new_head.accepted[0], reason=Reason(Code.REPEATED)),
                )
            },
            "rejected",
        ),
    ]:
        with pytest.raises(InvalidRecord) as info:
            Proposal(**{**fields, **change})  # type: ignore[arg-type]
        assert info.value.field == field


def test_peer_record_reachability_rules() -> None:
    common = {"network_id": h("n"), "public_key": ALICE.public_key, "seq": 1}
    PeerRecord(**common, roles=("trainer",), reachability="outbound")  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord, match="addresses"):
        PeerRecord(**common, roles=("seed",), reachability="public")  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord, match="relay"):
        PeerRecord(**common, roles=("validator",), reachability="relayed")  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord, match="roles"):
        PeerRecord(**common, roles=("king",), reachability="outbound")  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord, match="addresses"):
        PeerRecord(
            **common,  # type: ignore[arg-type]
            roles=("seed",),
            reachability="public",
            addresses=("ftp://x",),
        )


def test_manifest_rules() -> None:
    validators = [identity(i) for i in range(3)]
    manifest = experiment(validators, quorum=2)
    assert manifest.has_majority_quorum
    assert manifest.tolerated_equivocators == 0
    assert experiment([identity(i) for i in range(7)], quorum=5).tolerated_equivocators == 2
    assert not experiment(validators, quorum=1).has_majority_quorum
    with pytest.raises(InvalidRecord, match="quorum"):
        experiment(validators, quorum=4)
    with pytest.raises(InvalidRecord, match=r"window\.max_updates"):
        WindowSpec(min_updates=5, max_updates=4)
    with pytest.raises(InvalidRecord, match=r"outer_optimizer\.momentum"):
        OuterOptimizerSpec(name="sgd", lr=1.0, momentum=0.9)
    with pytest.raises(InvalidRecord, match="outer_optimizer"):
        msgspec.structs.replace(manifest, protocol="fedavg")
    with pytest.raises(InvalidRecord, match="issuer_keys"):
        NetworkManifest(name="net", authority=ALICE.public_key, admission="certificate")


def test_network_secret_is_checked_without_being_published() -> None:
    net = NetworkManifest(
        name="home", authority=ALICE.public_key, secret_check=secret_check(b"hunter2")
    )
    assert net.accepts_secret(b"hunter2")
    assert not net.accepts_secret(b"hunter3")
    assert b"hunter2" not in encode(net)
    assert not NetworkManifest(name="open", authority=ALICE.public_key).accepts_secret(b"")


def test_non_canonical_encodings_are_rejected() -> None:
    record = update()
    data = encode(record)
    # the same values with keys in another order
    builtins = msgspec.to_builtins(record, builtin_types=(bytes,))
    reordered = msgspec.msgpack.encode(dict(reversed(list(builtins.items()))))
    assert msgspec.msgpack.decode(reordered, type=Update) == record
    with pytest.raises(ProtocolViolation, match="not canonical"):
        decode(Update, reordered, max_bytes=4096)
    # an int written in a wider format than needed (window 3 as uint32)
    wide = data.replace(b"\xa6window\x03", b"\xa6window\xce\x00\x00\x00\x03")
    assert wide != data
    with pytest.raises(ProtocolViolation, match="not canonical"):
        decode(Update, wide, max_bytes=4096)
    with pytest.raises(ProtocolViolation, match="exceeds the limit"):
        decode(Update, data, max_bytes=len(data) - 1)
    with pytest.raises(ProtocolViolation, match="unknown field"):
        decode(Update, msgspec.msgpack.encode({**builtins, "zzz": 1}), max_bytes=4096)


def test_sealing_requires_the_author_key() -> None:
    with pytest.raises(LocalError, match="author"):
        seal(BOB, update())
    with pytest.raises(LocalError, match="not sent in envelopes"):
        seal(ALICE, head(h("e")))


def test_envelope_checks_each_part() -> None:
    signed = seal(ALICE, update())
    assert signed.record_id == update().id
    assert signed.signer_id == ALICE.peer_id
    env = signed.envelope
    # a valid signature by the wrong key: signer is not the author
    resigned = Envelope(
        kind=env.kind,
        payload=env.payload,
        signer=BOB.public_key,
        signature=BOB.sign(signing_message(env.kind, env.payload)),
    )
    with pytest.raises(ProtocolViolation, match="other than its author"):
        open_envelope(resigned.encode(), Update)
    # the right kind name is part of what is signed
    wrong_kind = msgspec.structs.replace(env, kind="attestation")
    with pytest.raises(ProtocolViolation, match="expected a 'update' envelope"):
        open_envelope(wrong_kind.encode(), Update)
    # a signature over the payload alone (no domain tag) does not verify
    bare = msgspec.structs.replace(env, signature=ALICE.sign(env.payload))
    with pytest.raises(ProtocolViolation, match="invalid signature"):
        open_envelope(bare.encode(), Update)
    # an envelope over the size ceiling is refused before decoding
    with pytest.raises(ProtocolViolation, match="exceeds the limit"):
        open_envelope(env.encode() + bytes(300 << 10), Update)
