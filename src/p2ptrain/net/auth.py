"""Admission: who may talk to a node, proven on every request without revealing secrets.

A request carries ``Authorization: P2PTrain <credentials>``: the caller's public key, a
server nonce, a client nonce, an Ed25519 signature over a transcript binding the network,
both nonces, the method and the path, and -- on a private network -- an HMAC of that
transcript keyed with the network secret (the secret itself never travels). A
``certificate`` network also wants an admission certificate signed by one of the manifest's
issuers for the caller's key.

Server nonces are stateless: a timestamp and random bytes authenticated with a per-process
key, so a server keeps no table of them; the client nonces it has accepted are remembered
for the server nonce's lifetime, so a captured request cannot be replayed. A request without
credentials, or with a stale nonce, gets ``401`` with a fresh nonce in ``WWW-Authenticate``
and the client retries once.

The server answers with ``P2PTrain-Server``: its own key, signature and secret proof over
the client nonce, so a client knows it reached a member of the network, not an impostor.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from p2ptrain.core.encoding import decode, encode
from p2ptrain.core.envelope import Envelope, Signed, verify_envelope
from p2ptrain.core.identity import Identity, peer_id_of, verify_signature
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.net.limits import SeenSet

__all__ = [
    "AUTH_SCHEME",
    "SERVER_HEADER",
    "Admitted",
    "ClientCredentials",
    "Gatekeeper",
    "Refusal",
    "nonce_from_challenge",
]

AUTH_SCHEME = "P2PTrain"
SERVER_HEADER = "P2PTrain-Server"
NONCE_TTL_MS = 10 * 60 * 1000
_CLOCK_SKEW_MS = 60 * 1000
_MAX_CREDENTIAL_BYTES = 4096
_CLIENT_LABEL = b"p2ptrain/v1/auth/client\x00"
_SERVER_LABEL = b"p2ptrain/v1/auth/server\x00"
_NONCE_BYTES = 32
_USED_CNONCES = 1 << 18
_KEPT_ADMISSIONS = 4096


class Credentials(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    network_id: str
    public_key: bytes
    nonce: str
    cnonce: bytes
    signature: bytes
    secret_proof: bytes | None = None
    admission: Envelope | None = None


class ServerProof(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    public_key: bytes
    signature: bytes
    secret_proof: bytes | None = None


class Refusal(ProtocolViolation):
    """A request was refused at the door. ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str, *, nonce: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.nonce = nonce


@dataclass(frozen=True, slots=True)
class Admitted:
    public_key: bytes
    peer_id: str
    cnonce: bytes
    #: The caller's admission certificate, on a ``certificate`` network.
    certificate: AdmissionCertificate | None = None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ProtocolViolation(f"bad base64 in credentials: {exc}") from None


def _transcript(label: bytes, network_id: str, nonce: str, cnonce: bytes, *parts: str) -> bytes:
    fields = [network_id.encode(), nonce.encode(), cnonce, *(p.encode() for p in parts)]
    return label + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _secret_proof(secret: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def _checked_secret(network: NetworkManifest, secret: bytes | None) -> bytes | None:
    if network.secret_check is None:
        return None
    if secret is None:
        raise LocalError(
            f"network {network.name!r} is private: give this node its network secret "
            "(--secret-file)"
        )
    if not network.accepts_secret(secret):
        raise LocalError(
            f"the network secret given does not match network {network.name!r}'s manifest; "
            "check the secret file"
        )
    return secret


def nonce_from_challenge(header: str | None) -> str | None:
    """The nonce in a ``WWW-Authenticate: P2PTrain nonce="..."`` header, if any."""
    if not header or not header.startswith(AUTH_SCHEME + " "):
        return None
    for part in header[len(AUTH_SCHEME) + 1 :].split(","):
        name, _, value = part.strip().partition("=")
        if name == "nonce":
            return value.strip('"')[:128]
    return None


class Gatekeeper:
    """The server side of admission: issues nonces and checks credentials."""

    def __init__(
        self,
        network: NetworkManifest,
        identity: Identity,
        *,
        secret: bytes | None,
        now_ms: Callable[[], int],
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.network = network
        self.network_id = network.id
        self._identity = identity
        self._secret = _checked_secret(network, secret)
        self._now_ms = now_ms
        self._random = random_bytes
        self._nonce_key = random_bytes(32)
        self._admissions: OrderedDict[bytes, AdmissionCertificate] = OrderedDict()
        #: The latest certificate each admitted key showed (bounded like the admissions).
        self._certified: OrderedDict[bytes, AdmissionCertificate] = OrderedDict()
        #: Keys whose admission an issuer revoked (each from a verified revocation).
        self.revoked: set[bytes] = set()
        # Client nonces already used: a captured request cannot be replayed while its
        # server nonce is fresh (beyond the capacity, the oldest are forgotten first).
        self._used = SeenSet(_USED_CNONCES, NONCE_TTL_MS + _CLOCK_SKEW_MS)

    @property
    def private(self) -> bool:
        """Whether only some may join: a network secret, or admission certificates."""
        return self.network.secret_check is not None or self.network.admission != "open"

    def new_nonce(self) -> str:
        stamp = struct.pack(">Q", self._now_ms()) + self._random(8)
        return _b64(stamp + hmac.new(self._nonce_key, stamp, hashlib.sha256).digest()[:16])

    def challenge_header(self, nonce: str | None = None) -> str:
        return f'{AUTH_SCHEME} nonce="{nonce or self.new_nonce()}"'

    def admit(self, header: str | None, method: str, path: str) -> Admitted:
        """Check the credentials of one request; raise :class:`Refusal` to turn it away."""
        if not header or not header.startswith(AUTH_SCHEME + " "):
            raise Refusal(401, "no credentials", nonce=self.new_nonce())
        raw = _unb64(header[len(AUTH_SCHEME) + 1 :].strip())
        creds = decode(Credentials, raw, max_bytes=_MAX_CREDENTIAL_BYTES)
        if creds.network_id != self.network_id:
            raise Refusal(403, f"credentials are for another network ({creds.network_id[:12]})")
        if not self._fresh(creds.nonce):
            raise Refusal(401, "stale or unknown nonce", nonce=self.new_nonce())
        if len(creds.cnonce) != _NONCE_BYTES:
            raise Refusal(400, "client nonce must be 32 bytes")
        transcript = _transcript(
            _CLIENT_LABEL, self.network_id, creds.nonce, creds.cnonce, method, path
        )
        if self._secret is not None and (
            creds.secret_proof is None
            or not hmac.compare_digest(creds.secret_proof, _secret_proof(self._secret, transcript))
        ):
            raise Refusal(403, "wrong network secret: the proof does not match this network")
        if len(creds.public_key) != 32 or not verify_signature(
            creds.public_key, transcript, creds.signature
        ):
            raise Refusal(403, "credentials carry an invalid signature")
        if creds.public_key in self.revoked:
            raise Refusal(403, "this peer's admission was revoked by an issuer of the network")
        certificate = None
        if self.network.admission == "certificate":
            certificate = self._check_admission(creds)
        if not self._used.add(creds.cnonce, self._now_ms()):
            raise Refusal(401, "replayed credentials", nonce=self.new_nonce())
        return Admitted(creds.public_key, peer_id_of(creds.public_key), creds.cnonce, certificate)

    def certificate_of(self, public_key: bytes) -> AdmissionCertificate | None:
        """The certificate ``public_key`` last showed at our door (None: none seen)."""
        return self._certified.get(public_key)

    def server_proof(self, cnonce: bytes) -> str:
        """The ``P2PTrain-Server`` header value answering a client nonce."""
        key = self._identity.public_key
        transcript = _transcript(_SERVER_LABEL, self.network_id, "", cnonce, key.hex())
        proof = ServerProof(
            public_key=key,
            signature=self._identity.sign(transcript),
            secret_proof=None if self._secret is None else _secret_proof(self._secret, transcript),
        )
        return _b64(encode(proof))

    def _fresh(self, nonce: str) -> bool:
        try:
            raw = _unb64(nonce)
        except ProtocolViolation:
            return False
        if len(raw) != 32:
            return False
        stamp, mac = raw[:16], raw[16:]
        expected = hmac.new(self._nonce_key, stamp, hashlib.sha256).digest()[:16]
        if not hmac.compare_digest(mac, expected):
            return False
        (issued,) = struct.unpack(">Q", stamp[:8])
        age = self._now_ms() - int(issued)
        return -_CLOCK_SKEW_MS <= age <= NONCE_TTL_MS

    def _check_admission(self, creds: Credentials) -> AdmissionCertificate:
        if creds.admission is None:
            raise Refusal(403, "this network admits only peers with an admission certificate")
        cached = self._admissions.get(creds.admission.signature)
        if cached is None:
            try:
                cached = verify_envelope(creds.admission, AdmissionCertificate).record
            except ProtocolViolation as exc:
                raise Refusal(403, f"admission certificate is invalid: {exc}") from None
            self._admissions[creds.admission.signature] = cached
            if len(self._admissions) > _KEPT_ADMISSIONS:
                self._admissions.popitem(last=False)
        if cached.issuer not in self.network.issuer_keys:
            raise Refusal(403, "admission certificate is signed by a key that is not an issuer")
        if cached.network_id != self.network_id:
            raise Refusal(403, "admission certificate is for another network")
        if cached.subject != creds.public_key:
            raise Refusal(403, "admission certificate names another peer key")
        if cached.not_after_ms and cached.not_after_ms < self._now_ms():
            raise Refusal(403, "admission certificate has expired")
        self._certified[creds.public_key] = cached
        self._certified.move_to_end(creds.public_key)
        if len(self._certified) > _KEPT_ADMISSIONS:
            self._certified.popitem(last=False)
        return cached


class ClientCredentials:
    """The client side: builds credentials for requests and checks a server's proof."""

    def __init__(
        self,
        network: NetworkManifest,
        identity: Identity,
        *,
        secret: bytes | None,
        admission: Signed[AdmissionCertificate] | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.network = network
        self.network_id = network.id
        self.identity = identity
        self._secret = _checked_secret(network, secret)
        if network.admission == "certificate" and admission is None:
            raise LocalError(
                f"network {network.name!r} admits only certified peers: give this node its "
                "admission certificate (--certificate FILE; an issuer of the network makes it "
                "with p2ptrain admit)"
            )
        self._admission: Envelope | None = None
        if admission is not None:
            self.use_admission(admission)
        self._random = random_bytes

    def use_admission(self, admission: Signed[AdmissionCertificate]) -> None:
        """Show ``admission`` from the next request on (a renewed certificate)."""
        if admission.record.subject != self.identity.public_key:
            raise LocalError("the admission certificate names another key than this node's")
        self._admission = admission.envelope

    def header(self, nonce: str, method: str, path: str) -> tuple[str, bytes]:
        """The Authorization header for one request, and the client nonce it used."""
        cnonce = self._random(_NONCE_BYTES)
        transcript = _transcript(_CLIENT_LABEL, self.network_id, nonce, cnonce, method, path)
        creds = Credentials(
            network_id=self.network_id,
            public_key=self.identity.public_key,
            nonce=nonce,
            cnonce=cnonce,
            signature=self.identity.sign(transcript),
            secret_proof=None if self._secret is None else _secret_proof(self._secret, transcript),
            admission=self._admission,
        )
        return f"{AUTH_SCHEME} {_b64(encode(creds))}", cnonce

    def check_server(self, header: str | None, cnonce: bytes) -> str:
        """Verify a server's ``P2PTrain-Server`` answer; return its peer id."""
        if not header:
            raise ProtocolViolation("the server did not prove who it is (no P2PTrain-Server)")
        proof = decode(ServerProof, _unb64(header), max_bytes=_MAX_CREDENTIAL_BYTES)
        transcript = _transcript(_SERVER_LABEL, self.network_id, "", cnonce, proof.public_key.hex())
        if len(proof.public_key) != 32 or not verify_signature(
            proof.public_key, transcript, proof.signature
        ):
            raise ProtocolViolation("the server's proof carries an invalid signature")
        if self._secret is not None and (
            proof.secret_proof is None
            or not hmac.compare_digest(proof.secret_proof, _secret_proof(self._secret, transcript))
        ):
            raise ProtocolViolation("the server does not know this network's secret")
        return peer_id_of(proof.public_key)
