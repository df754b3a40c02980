"""Admission at the door: nonces, client credentials, network secrets, admission
certificates and the server's proof, with an injected clock and deterministic randomness."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.core.encoding import encode
from p2ptrain.core.envelope import Envelope, Signed, seal
from p2ptrain.core.identity import Identity, peer_id_of
from p2ptrain.core.manifests import NetworkManifest, secret_check
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.net.auth import (
    AUTH_SCHEME,
    NONCE_TTL_MS,
    Admitted,
    ClientCredentials,
    Credentials,
    Gatekeeper,
    Refusal,
    nonce_from_challenge,
)
from tests.support.builders import identity

#: Seeds of the deterministic byte sources; print them so a failure can be replayed.
SERVER_SEED = 7101
CLIENT_SEED = 7202
START_MS = 1_700_000_000_000
SECRET = b"correct horse battery staple"

SERVER = identity(1)
CLIENT = identity(2)
ISSUER = identity(3)
STRANGER = identity(4)
AUTHORITY = identity(900)

OPEN = NetworkManifest(name="open-net", authority=AUTHORITY.public_key)
PRIVATE = NetworkManifest(
    name="private-net", authority=AUTHORITY.public_key, secret_check=secret_check(SECRET)
)
CERTIFIED = NetworkManifest(
    name="certified-net",
    authority=AUTHORITY.public_key,
    admission="certificate",
    issuer_keys=(ISSUER.public_key,),
)


class Clock:
    """Milliseconds since the epoch, moved by hand."""

    def __init__(self, ms: int = START_MS) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def byte_source(seed: int) -> Callable[[int], bytes]:
    print(f"byte source seed {seed}")
    rng = random.Random(seed)
    return rng.randbytes


def gatekeeper(
    network: NetworkManifest = OPEN,
    *,
    secret: bytes | None = None,
    clock: Clock | None = None,
    seed: int = SERVER_SEED,
    server: Identity = SERVER,
) -> Gatekeeper:
    return Gatekeeper(
        network,
        server,
        secret=secret,
        now_ms=clock or Clock(),
        random_bytes=byte_source(seed),
    )


def client(
    network: NetworkManifest = OPEN,
    *,
    secret: bytes | None = None,
    admission: Signed[AdmissionCertificate] | None = None,
    who: Identity = CLIENT,
) -> ClientCredentials:
    return ClientCredentials(
        network, who, secret=secret, admission=admission, random_bytes=byte_source(CLIENT_SEED)
    )


def admission_for(
    subject: Identity,
    *,
    issuer: Identity = ISSUER,
    network: NetworkManifest = CERTIFIED,
    not_after_ms: int = 0,
) -> Signed[AdmissionCertificate]:
    return seal(
        issuer,
        AdmissionCertificate(
            network_id=network.id,
            subject=subject.public_key,
            issuer=issuer.public_key,
            not_after_ms=not_after_ms,
        ),
    )


def refusal(gate: Gatekeeper, header: str | None, method: str = "GET", path: str = "/") -> Refusal:
    with pytest.raises(Refusal) as caught:
        gate.admit(header, method, path)
    return caught.value


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# -- nonces and challenges ------------------------------------------------------------------


def test_a_request_without_credentials_is_challenged_with_a_fresh_nonce() -> None:
    gate = gatekeeper()
    for header in (None, "", "Basic dXNlcjpwYXNz", "P2PTrain", "p2ptrain abc"):
        refused = refusal(gate, header)
        assert refused.status == 401
        assert refused.reason == "no credentials"
        assert refused.nonce is not None
        # 8-byte timestamp + 8 random bytes + 16-byte tag, url-safe base64 without padding.
        assert len(unb64(refused.nonce)) == 32
        assert "=" not in refused.nonce


def test_a_nonce_carries_the_clock_reading_it_was_minted_at() -> None:
    clock = Clock(0x0102030405060708)
    nonce = gatekeeper(clock=clock).new_nonce()
    assert unb64(nonce)[:8] == bytes([1, 2, 3, 4, 5, 6, 7, 8])


def test_the_challenge_header_round_trips_its_nonce() -> None:
    gate = gatekeeper()
    header = gate.challenge_header()
    assert header.startswith(f'{AUTH_SCHEME} nonce="')
    nonce = nonce_from_challenge(header)
    assert nonce is not None
    assert len(unb64(nonce)) == 32
    assert gate.challenge_header(nonce) == header
    assert nonce_from_challenge(gate.challenge_header("abc")) == "abc"


@pytest.mark.parametrize(
    ("header", "nonce"),
    [
        (None, None),
        ("", None),
        ('Basic nonce="x"', None),
        ('P2PTrain realm="r"', None),
        ('P2PTrain realm="r", nonce="xyz"', "xyz"),
        ("P2PTrain nonce=bare", "bare"),
        ('P2PTrain nonce="' + "n" * 500 + '"', "n" * 128),
    ],
)
def test_nonce_from_challenge_reads_only_our_scheme(header: str | None, nonce: str | None) -> None:
    assert nonce_from_challenge(header) == nonce


def test_two_nonces_differ_even_at_the_same_instant() -> None:
    gate = gatekeeper()
    assert gate.new_nonce() != gate.new_nonce()


# -- open network ---------------------------------------------------------------------------


def test_valid_credentials_are_admitted_as_the_signing_peer() -> None:
    gate = gatekeeper()
    creds = client()
    nonce = gate.new_nonce()
    header, cnonce = creds.header(nonce, "GET", "/v1/peers")
    assert header.startswith(AUTH_SCHEME + " ")
    assert len(cnonce) == 32
    admitted = gate.admit(header, "GET", "/v1/peers")
    assert admitted == Admitted(CLIENT.public_key, peer_id_of(CLIENT.public_key), cnonce)
    assert admitted.peer_id == CLIENT.peer_id
    assert admitted.peer_id != SERVER.peer_id


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/peers"), ("GET", "/v1/peers?after=1"), ("GET", "/v1/blobs"), ("get", "/")],
)
def test_the_signature_binds_method_and_path(method: str, path: str) -> None:
    gate = gatekeeper()
    header, _ = client().header(gate.new_nonce(), "GET", "/v1/peers")
    refused = refusal(gate, header, method, path)
    assert refused.status == 403
    assert "invalid signature" in refused.reason


def test_a_nonce_is_fresh_for_exactly_its_time_to_live() -> None:
    clock = Clock()
    gate = gatekeeper(clock=clock)
    nonce = gate.new_nonce()
    credentials = client()
    header, _ = credentials.header(nonce, "GET", "/")
    clock.ms += NONCE_TTL_MS
    assert gate.admit(header, "GET", "/").peer_id == CLIENT.peer_id
    clock.ms += 1
    later, _ = credentials.header(nonce, "GET", "/")  # a new client nonce, the old server one
    refused = refusal(gate, later)
    assert refused.status == 401
    assert "stale" in refused.reason
    assert refused.nonce is not None
    # The fresh nonce in the refusal works.
    again, _ = credentials.header(refused.nonce, "GET", "/")
    assert gate.admit(again, "GET", "/").peer_id == CLIENT.peer_id


def test_replayed_credentials_are_refused() -> None:
    gate = gatekeeper()
    header, _ = client().header(gate.new_nonce(), "POST", "/v1/blobs")
    assert gate.admit(header, "POST", "/v1/blobs").peer_id == CLIENT.peer_id
    refused = refusal(gate, header, "POST", "/v1/blobs")
    assert (refused.status, refused.reason) == (401, "replayed credentials")


def test_a_nonce_from_the_future_beyond_the_skew_allowance_is_stale() -> None:
    clock = Clock()
    gate = gatekeeper(clock=clock)
    nonce = gate.new_nonce()
    credentials = client()
    header, _ = credentials.header(nonce, "GET", "/")
    clock.ms -= 60_000
    assert gate.admit(header, "GET", "/").peer_id == CLIENT.peer_id
    clock.ms -= 1
    assert refusal(gate, credentials.header(nonce, "GET", "/")[0]).status == 401


def test_a_nonce_minted_by_another_gatekeeper_is_stale() -> None:
    ours = gatekeeper(seed=SERVER_SEED)
    theirs = gatekeeper(seed=SERVER_SEED + 1)  # another process: another nonce key
    header, _ = client().header(theirs.new_nonce(), "GET", "/")
    assert theirs.admit(header, "GET", "/").peer_id == CLIENT.peer_id
    refused = refusal(ours, header)
    assert refused.status == 401
    assert refused.reason == "stale or unknown nonce"


@pytest.mark.parametrize("nonce", ["", "not base64 at all!", "AAAA", "é", "A" * 43])
def test_a_forged_or_malformed_nonce_is_stale(nonce: str) -> None:
    gate = gatekeeper()
    header, _ = client().header(nonce, "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 401
    assert refused.reason == "stale or unknown nonce"


def test_a_tampered_nonce_timestamp_is_stale() -> None:
    clock = Clock()
    gate = gatekeeper(clock=clock)
    raw = bytearray(unb64(gate.new_nonce()))
    raw[7] ^= 1  # one millisecond later, same tag
    header, _ = client().header(b64(bytes(raw)), "GET", "/")
    assert refusal(gate, header).status == 401


def test_credentials_for_another_network_are_forbidden() -> None:
    gate = gatekeeper(OPEN)
    other = NetworkManifest(name="other-net", authority=AUTHORITY.public_key)
    header, _ = client(other).header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "another network" in refused.reason
    assert other.id[:12] in refused.reason


def test_a_client_nonce_of_the_wrong_length_is_a_bad_request() -> None:
    gate = gatekeeper()
    creds = ClientCredentials(OPEN, CLIENT, secret=None, random_bytes=lambda n: b"\x01" * (n - 1))
    header, cnonce = creds.header(gate.new_nonce(), "GET", "/")
    assert len(cnonce) == 31
    assert refusal(gate, header).status == 400


def test_a_public_key_of_the_wrong_length_is_an_invalid_signature() -> None:
    gate = gatekeeper()
    header, _ = client().header(gate.new_nonce(), "GET", "/")
    creds = msgspec.msgpack.decode(unb64(header.split(" ", 1)[1]), type=Credentials)
    forged = msgspec.structs.replace(creds, public_key=creds.public_key[:31])
    refused = refusal(gate, f"{AUTH_SCHEME} {b64(encode(forged))}")
    assert refused.status == 403
    assert "invalid signature" in refused.reason


def test_someone_else_s_key_with_our_signature_is_refused() -> None:
    gate = gatekeeper()
    header, _ = client().header(gate.new_nonce(), "GET", "/")
    creds = msgspec.msgpack.decode(unb64(header.split(" ", 1)[1]), type=Credentials)
    forged = msgspec.structs.replace(creds, public_key=STRANGER.public_key)
    assert refusal(gate, f"{AUTH_SCHEME} {b64(encode(forged))}").status == 403


def test_a_secret_proof_on_an_open_network_is_ignored() -> None:
    gate = gatekeeper(OPEN)
    creds = client(OPEN)
    creds._secret = b"whatever"
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    assert gate.admit(header, "GET", "/").peer_id == CLIENT.peer_id


# -- private network ------------------------------------------------------------------------


def test_the_right_network_secret_is_admitted() -> None:
    gate = gatekeeper(PRIVATE, secret=SECRET)
    header, _ = client(PRIVATE, secret=SECRET).header(gate.new_nonce(), "GET", "/v1/peers")
    assert gate.admit(header, "GET", "/v1/peers").peer_id == CLIENT.peer_id


def test_the_secret_never_travels_in_the_credentials() -> None:
    gate = gatekeeper(PRIVATE, secret=SECRET)
    header, _ = client(PRIVATE, secret=SECRET).header(gate.new_nonce(), "GET", "/")
    assert SECRET not in unb64(header.split(" ", 1)[1])


def test_an_attacker_who_knows_only_the_manifest_is_refused() -> None:
    gate = gatekeeper(PRIVATE, secret=SECRET)
    creds = client(PRIVATE, secret=SECRET)
    creds._secret = b"a guess at the secret"
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "wrong network secret" in refused.reason


def test_credentials_without_a_secret_proof_are_refused_on_a_private_network() -> None:
    gate = gatekeeper(PRIVATE, secret=SECRET)
    creds = client(PRIVATE, secret=SECRET)
    creds._secret = None
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "wrong network secret" in refused.reason


@pytest.mark.parametrize("side", ["client", "gatekeeper"])
def test_a_secret_that_does_not_match_the_manifest_is_a_local_error(side: str) -> None:
    with pytest.raises(LocalError, match="does not match"):
        if side == "client":
            client(PRIVATE, secret=b"wrong")
        else:
            gatekeeper(PRIVATE, secret=b"wrong")


@pytest.mark.parametrize("side", ["client", "gatekeeper"])
def test_a_missing_secret_on_a_private_network_is_a_local_error(side: str) -> None:
    with pytest.raises(LocalError, match="private"):
        if side == "client":
            client(PRIVATE, secret=None)
        else:
            gatekeeper(PRIVATE, secret=None)


# -- certificate network --------------------------------------------------------------------


def test_a_certified_peer_is_admitted() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT))
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    assert gate.admit(header, "GET", "/").peer_id == CLIENT.peer_id
    # A second request hits the certificate cache and is admitted the same way.
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    assert gate.admit(header, "GET", "/").peer_id == CLIENT.peer_id


def test_a_revoked_key_is_refused_even_with_a_valid_certificate() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT))
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    admitted = gate.admit(header, "GET", "/")
    assert admitted.certificate is not None and gate.certificate_of(CLIENT.public_key)
    gate.revoked.add(CLIENT.public_key)
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "revoked" in refused.reason


def test_a_certificate_allows_the_roles_it_names_or_any() -> None:
    anyone = admission_for(CLIENT).record
    assert anyone.allows(("trainer", "validator"))
    trainer = AdmissionCertificate(
        network_id=CERTIFIED.id,
        subject=CLIENT.public_key,
        issuer=ISSUER.public_key,
        roles=("trainer",),
    )
    assert trainer.allows(("trainer",))
    assert not trainer.allows(("trainer", "validator"))


def test_a_client_without_a_certificate_is_a_local_error_on_a_certificate_network() -> None:
    with pytest.raises(LocalError, match="admission"):
        client(CERTIFIED)


def test_credentials_without_an_admission_are_forbidden() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT))
    creds._admission = None
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "admission certificate" in refused.reason


def test_an_admission_signed_by_a_non_issuer_is_forbidden() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT, issuer=STRANGER))
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "not an issuer" in refused.reason


def test_an_admission_for_another_network_is_forbidden() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT, network=OPEN))
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "another network" in refused.reason


def test_an_admission_naming_another_key_is_a_local_error_for_the_client() -> None:
    with pytest.raises(LocalError, match="another key"):
        client(CERTIFIED, admission=admission_for(STRANGER))


def test_a_borrowed_admission_is_refused_by_the_gatekeeper() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT))
    creds._admission = admission_for(STRANGER).envelope
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "names another peer key" in refused.reason


def test_an_admission_with_a_broken_signature_is_forbidden() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT))
    envelope = admission_for(CLIENT).envelope
    broken = bytes([envelope.signature[0] ^ 1]) + envelope.signature[1:]
    creds._admission = msgspec.structs.replace(envelope, signature=broken)
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "invalid" in refused.reason


def test_an_admission_expires_after_its_not_after_time() -> None:
    clock = Clock()
    gate = gatekeeper(CERTIFIED, clock=clock)
    creds = client(CERTIFIED, admission=admission_for(CLIENT, not_after_ms=START_MS + 5))
    clock.ms = START_MS + 5
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    assert gate.admit(header, "GET", "/").peer_id == CLIENT.peer_id
    clock.ms += 1
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    refused = refusal(gate, header)
    assert refused.status == 403
    assert "expired" in refused.reason


def test_an_admission_already_expired_is_forbidden() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT, not_after_ms=START_MS - 1))
    header, _ = creds.header(gate.new_nonce(), "GET", "/")
    assert "expired" in refusal(gate, header).reason


def test_an_admission_is_checked_only_after_the_signature() -> None:
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT, issuer=STRANGER))
    header, _ = creds.header(gate.new_nonce(), "GET", "/a")
    assert "invalid signature" in refusal(gate, header, "GET", "/b").reason


# -- the server's proof ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("network", "secret"), [(OPEN, None), (PRIVATE, SECRET), (CERTIFIED, None)]
)
def test_the_server_proof_names_the_server(network: NetworkManifest, secret: bytes | None) -> None:
    gate = gatekeeper(network, secret=secret)
    admission = admission_for(CLIENT) if network is CERTIFIED else None
    creds = client(network, secret=secret, admission=admission)
    header, cnonce = creds.header(gate.new_nonce(), "GET", "/v1/ws")
    admitted = gate.admit(header, "GET", "/v1/ws")
    proof = gate.server_proof(admitted.cnonce)
    assert creds.check_server(proof, cnonce) == SERVER.peer_id


def test_a_proof_for_another_client_nonce_is_refused() -> None:
    gate = gatekeeper()
    proof = gate.server_proof(b"\x01" * 32)
    with pytest.raises(ProtocolViolation, match="invalid signature"):
        client().check_server(proof, b"\x02" * 32)


def test_a_proof_from_a_server_on_another_network_is_refused() -> None:
    other = NetworkManifest(name="other-net", authority=AUTHORITY.public_key)
    proof = gatekeeper(other).server_proof(b"\x01" * 32)
    with pytest.raises(ProtocolViolation, match="invalid signature"):
        client(OPEN).check_server(proof, b"\x01" * 32)


@pytest.mark.parametrize("server_secret", [b"not the secret", None])
def test_a_server_that_does_not_know_the_secret_is_an_impostor(
    server_secret: bytes | None,
) -> None:
    gate = gatekeeper(PRIVATE, secret=SECRET)
    gate._secret = server_secret
    cnonce = b"\x05" * 32
    with pytest.raises(ProtocolViolation, match="secret"):
        client(PRIVATE, secret=SECRET).check_server(gate.server_proof(cnonce), cnonce)


@pytest.mark.parametrize("header", [None, "", "!!!!", "AAAA", b64(b"\x81\xa1x\x01")])
def test_a_missing_or_garbled_server_proof_is_refused(header: str | None) -> None:
    with pytest.raises(ProtocolViolation):
        client().check_server(header, b"\x00" * 32)


# -- garbage at the door --------------------------------------------------------------------


@settings(max_examples=500)
@given(st.text(max_size=300), st.text(max_size=20), st.text(max_size=60))
def test_any_authorization_header_is_admitted_or_refused_as_a_protocol_violation(
    garbage: str, method: str, path: str
) -> None:
    gate = gatekeeper(CERTIFIED)
    for header in (garbage, f"{AUTH_SCHEME} {garbage}"):
        try:
            gate.admit(header, method, path)
        except ProtocolViolation:
            pass
        else:  # pragma: no cover - a random string cannot carry a valid signature
            pytest.fail(f"garbage {header!r} was admitted")


@settings(max_examples=500)
@given(st.binary(max_size=600))
def test_any_base64_payload_is_refused_as_a_protocol_violation(payload: bytes) -> None:
    gate = gatekeeper(CERTIFIED)
    with pytest.raises(ProtocolViolation):
        gate.admit(f"{AUTH_SCHEME} {b64(payload)}", "GET", "/")


_ENVELOPE_FIELDS = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["admission", "peer", "network", ""]),
        "payload": st.binary(max_size=200),
        "signer": st.binary(max_size=40),
        "signature": st.binary(max_size=80),
    }
)


@settings(max_examples=300)
@given(
    _ENVELOPE_FIELDS,
    st.sampled_from(["GET", "POST", "HEAD"]),
    st.text(max_size=40),
    st.binary(max_size=40),
)
def test_a_validly_signed_request_with_any_admission_envelope_is_admitted_or_refused(
    fields: dict[str, object], method: str, path: str, cnonce: bytes
) -> None:
    """Credentials that pass every check up to the admission certificate, carrying an
    arbitrary envelope: the gatekeeper either admits them or raises a Refusal."""
    gate = gatekeeper(CERTIFIED)
    creds = client(CERTIFIED, admission=admission_for(CLIENT))
    creds._admission = Envelope(**fields)  # type: ignore[arg-type]
    creds._random = lambda n: cnonce
    try:
        path.encode()
    except UnicodeEncodeError:
        return  # a lone surrogate is not a request path an HTTP server can hand us
    header, _ = creds.header(gate.new_nonce(), method, path)
    with pytest.raises(ProtocolViolation):
        gate.admit(header, method, path)


@settings(max_examples=200)
@given(st.text(max_size=200))
def test_any_server_proof_header_is_accepted_or_refused_as_a_protocol_violation(
    garbage: str,
) -> None:
    creds = client(PRIVATE, secret=SECRET)
    with pytest.raises(ProtocolViolation):
        creds.check_server(garbage, b"\x00" * 32)
