"""Property tests of records: round trips, and decoders that only ever raise
ProtocolViolation. Each runs at least 1000 examples (tamper evidence of signed envelopes:
``test_envelope_properties.py``)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.core.certificate import QuorumCertificate
from p2ptrain.core.encoding import decode, encode, record_id
from p2ptrain.core.envelope import KINDS, Envelope, open_envelope
from p2ptrain.core.manifests import ExperimentManifest, NetworkManifest
from p2ptrain.core.records import Attestation, Head, PeerRecord, Proposal, Update
from p2ptrain.errors import ProtocolViolation
from tests.support import strategies as s

EXAMPLES = settings(max_examples=1000)

ROUND_TRIPS: list[tuple[type[Any], Any]] = [
    (NetworkManifest, s.network_manifests()),
    (ExperimentManifest, s.experiment_manifests()),
    (PeerRecord, s.peer_records()),
    (Update, s.updates()),
    (Head, s.heads()),
    (Proposal, s.proposals()),
    (Attestation, s.attestations()),
    (QuorumCertificate, s.certificates()),
]

DECODABLE: list[type[Any]] = [record_type for record_type, _ in ROUND_TRIPS] + [Envelope]


@pytest.mark.parametrize(
    ("record_type", "strategy"), ROUND_TRIPS, ids=[t.__name__ for t, _ in ROUND_TRIPS]
)
def test_every_record_round_trips(record_type: type[Any], strategy: Any) -> None:
    @EXAMPLES
    @given(strategy)
    def check(record: Any) -> None:
        data = encode(record)
        again = decode(record_type, data, max_bytes=len(data))
        assert again == record
        assert encode(again) == data
        assert record_id(again) == record_id(record)

    check()


@pytest.mark.parametrize("record_type", DECODABLE, ids=[t.__name__ for t in DECODABLE])
def test_random_bytes_raise_only_protocol_violation(record_type: type[Any]) -> None:
    @EXAMPLES
    @given(st.binary(max_size=512))
    def check(data: bytes) -> None:
        with contextlib.suppress(ProtocolViolation):
            decode(record_type, data, max_bytes=4096)

    check()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_random_bytes_to_open_envelope_raise_only_protocol_violation(kind: str) -> None:
    record_type = KINDS[kind].type

    @EXAMPLES
    @given(st.binary(max_size=512))
    def check(data: bytes) -> None:
        with pytest.raises(ProtocolViolation):
            open_envelope(data, record_type)

    check()
