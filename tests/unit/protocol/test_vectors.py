"""The reduction test vectors (``tests/golden/reduction_vectors.json``) are what this
implementation computes: regenerate them with ``python -m tests.golden.make_vectors`` only
for a deliberate protocol change (and say so in the protocol version table)."""

from __future__ import annotations

import json

from p2ptrain.core.manifests import PROTOCOL_VERSION
from p2ptrain.core.reasons import Code
from tests.golden.make_vectors import FILE, vectors


def test_the_vectors_are_what_the_protocol_computes() -> None:
    stored = json.loads(FILE.read_text())
    assert stored["protocol"] == PROTOCOL_VERSION
    fresh = json.loads(json.dumps(vectors()))
    for name, case in fresh["cases"].items():
        assert case == stored["cases"][name], name
    assert fresh == stored


def test_the_vectors_cover_the_reasons_a_cohort_can_give() -> None:
    stored = json.loads(FILE.read_text())
    given = {r[1] for case in stored["cases"].values() for r in case["expect"]["rejected"]}
    assert given >= {
        Code.NORM_ABOVE.name,
        Code.COSINE_BELOW.name,
        Code.REPEATED.name,
        Code.LEASE_SAMPLES.name,
        Code.BLOB_MISMATCH.name,
        Code.UNDECODABLE.name,
        Code.WRONG_CODEC.name,
        Code.QUARANTINED.name,
    }
    quarantined = stored["cases"]["sent-twice"]["expect"]["quarantine"]
    assert quarantined and quarantined[0][4] == Code.REPEATED.name
