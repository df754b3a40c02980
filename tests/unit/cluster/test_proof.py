"""The cluster secret's proof: it holds for the same secret, key, nonces, direction and
body, and for nothing else."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2ptrain.cluster.proof import SECRET_DIFFERS, Proof, check_proof, prove, transcript
from p2ptrain.core.identity import Identity

SECRET = bytes(range(32))
CLIENT = Identity.from_seed(b"\x01" * 32)
SERVER = Identity.from_seed(b"\x02" * 32)
FIELDS: dict[str, Any] = {
    "cluster_id": "c" * 64,
    "client_key": CLIENT.public_key,
    "server_key": SERVER.public_key,
    "client_nonce": b"\x03" * 32,
    "server_nonce": b"\x04" * 32,
    "body": b"a join request",
}


def signed(direction: str = "client", **changes: Any) -> bytes:
    return transcript(direction, **(FIELDS | changes))  # type: ignore[arg-type]


def test_a_proof_holds_for_the_same_secret_key_and_transcript() -> None:
    proof = prove(CLIENT, SECRET, signed())
    assert check_proof(SECRET, CLIENT.public_key, signed(), proof, peer="b") is None
    answer = prove(SERVER, SECRET, signed("server"))
    assert check_proof(SECRET, SERVER.public_key, signed("server"), answer, peer="a") is None


def test_another_secret_is_told_as_the_secret_differing() -> None:
    proof = prove(CLIENT, b"another secret of 32 bytes......", signed())
    reason = check_proof(SECRET, CLIENT.public_key, signed(), proof, peer="the member at X")
    assert reason == SECRET_DIFFERS.format(peer="the member at X")
    assert reason.startswith("the cluster secret differs: this member and the member at X")
    assert "--secret-file" in reason


def test_a_proof_signed_by_another_key_fails() -> None:
    proof = prove(SERVER, SECRET, signed())  # right secret, but not the client's key
    reason = check_proof(SECRET, CLIENT.public_key, signed(), proof, peer="b")
    assert reason == "b signed its proof with another key than the one it named"
    forged = dataclasses.replace(prove(CLIENT, SECRET, signed()), signature=b"\x00" * 64)
    assert check_proof(SECRET, CLIENT.public_key, signed(), forged, peer="b") is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cluster_id", "d" * 64),
        ("client_key", SERVER.public_key),
        ("server_key", CLIENT.public_key),
        ("client_nonce", b"\x05" * 32),
        ("server_nonce", b"\x05" * 32),
        ("body", b"another body"),
    ],
)
def test_a_proof_answers_one_transcript_only(field: str, value: Any) -> None:
    proof = prove(CLIENT, SECRET, signed())
    assert check_proof(SECRET, CLIENT.public_key, signed(**{field: value}), proof, peer="b")


def test_a_proof_cannot_be_reflected_to_the_other_direction() -> None:
    client_proof = prove(SERVER, SECRET, signed("client", client_key=SERVER.public_key))
    # The same keys and nonces, but read as the server's answer: the label differs.
    as_server = signed("server", client_key=SERVER.public_key)
    assert check_proof(SECRET, SERVER.public_key, as_server, client_proof, peer="a")


def test_fields_are_length_prefixed_so_they_cannot_slide() -> None:
    assert signed(cluster_id="ab", body=b"") != signed(cluster_id="a", body=b"")
    shifted = transcript(
        "client",
        **(FIELDS | {"client_nonce": b"\x03" * 31, "server_nonce": b"\x03" + b"\x04" * 32}),
    )
    assert shifted != signed()


@given(st.binary(min_size=16, max_size=64), st.binary(max_size=200), st.binary(max_size=200))
def test_only_the_same_secret_and_body_verify(secret: bytes, body: bytes, other: bytes) -> None:
    proof: Proof = prove(CLIENT, secret, signed(body=body))
    assert check_proof(secret, CLIENT.public_key, signed(body=body), proof, peer="b") is None
    if other != body:
        assert check_proof(secret, CLIENT.public_key, signed(body=other), proof, peer="b")
    if secret != SECRET:
        assert check_proof(SECRET, CLIENT.public_key, signed(body=body), proof, peer="b")
