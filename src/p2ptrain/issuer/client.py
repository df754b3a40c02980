"""A node's side of the issuing service: sign in for a certificate, renew it before expiry.

:func:`sign_in` opens a sign-in for the node's key (signed with it), tells the person what to
do (open a link, or enter a code at the provider's page) and waits for the outcome;
:func:`renew` trades a still-valid certificate for a new one. The certificate is kept in
the node's data directory beside the issuer's address (:data:`ISSUER_FILE`), which is how a
running node knows where to renew.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import aiohttp

from p2ptrain.core.admission import CERTIFICATE_FILE
from p2ptrain.core.envelope import Signed, open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.issuer.invite import Invite
from p2ptrain.issuer.signed_request import sign
from p2ptrain.store.atomic import write_atomically

__all__ = [
    "ISSUER_FILE",
    "IssuerUnreachable",
    "SignedIn",
    "kept_issuer",
    "redeem",
    "renew",
    "save",
    "sign_in",
]

#: The address of the issuer a node signed in at, in its data directory.
ISSUER_FILE: Final = "admission.issuer"
#: How long one result request waits at the issuer.
_WAIT_S: Final = 25.0
_TIMEOUT = aiohttp.ClientTimeout(total=_WAIT_S + 15)


class IssuerUnreachable(LocalError):
    """The issuer did not answer (a transport fault: try again later)."""


@dataclasses.dataclass(frozen=True)
class SignedIn:
    certificate: Signed[AdmissionCertificate]
    subject: str


def kept_issuer(data_dir: Path) -> str | None:
    """The issuer this node signed in at (None: it did not)."""
    path = data_dir / ISSUER_FILE
    return path.read_text().strip() or None if path.exists() else None


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, **options: Any
) -> tuple[int, dict[str, Any]]:
    try:
        async with http.request(method, url, **options) as answer:
            text = await answer.text()
            status = answer.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise IssuerUnreachable(
            f"the issuer did not answer {method} {url} "
            f"({exc.__class__.__name__}: {exc}); check the address, or try again later"
        ) from exc
    try:
        body = json.loads(text)
    except ValueError:
        body = {"error": text[:300]}
    return status, body if isinstance(body, dict) else {"error": str(body)[:300]}


def _certificate(
    hex_text: str, identity: Identity, issuer_url: str
) -> Signed[AdmissionCertificate]:
    try:
        signed = open_envelope(bytes.fromhex(hex_text), AdmissionCertificate)
    except (ValueError, ProtocolViolation) as exc:
        raise LocalError(f"the issuer at {issuer_url} sent no valid certificate ({exc})") from exc
    if signed.record.subject != identity.public_key:
        raise LocalError(f"the issuer at {issuer_url} sent a certificate for another key")
    return signed


async def sign_in(
    issuer_url: str,
    identity: Identity,
    *,
    connector: str | None = None,
    device: bool = False,
    say: Callable[[dict[str, Any]], None],
    timeout_s: float = 600.0,
) -> SignedIn:
    """Sign ``identity``'s key in at ``issuer_url``; ``say`` gets what the person must do
    (``{"event": "sign-in", "url": ...}`` or ``{"event": "device-code", "user_code": ...,
    "verification_uri": ...}``)."""
    base = issuer_url.rstrip("/")
    fields: dict[str, Any] = {"device": device}
    if connector is not None:
        fields["connector"] = connector
    body, headers = sign(identity, "/sign-in", fields)
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as http:
        status, opened = await _call(http, "POST", f"{base}/sign-in", data=body, headers=headers)
        if status != 200:
            raise LocalError(f"the issuer at {base} refused the sign-in: {opened.get('error')}")
        if device:
            say(
                {
                    "event": "device-code",
                    "connector": opened["connector"],
                    "user_code": opened["user_code"],
                    "verification_uri": opened["verification_uri"],
                    "verification_uri_complete": opened["verification_uri_complete"],
                }
            )
        else:
            say({"event": "sign-in", "connector": opened["connector"], "url": opened["url"]})
        deadline = time.monotonic() + timeout_s
        while True:
            url = f"{base}/sign-in/{opened['session']}/result?wait={_WAIT_S:g}"
            status, result = await _call(http, "GET", url)
            if status != 200:
                raise LocalError(f"the sign-in at {base} ended: {result.get('error')}")
            if result["status"] == "issued":
                return SignedIn(
                    _certificate(result["certificate"], identity, base), result["subject"]
                )
            if result["status"] == "refused":
                raise LocalError(
                    f"the issuer at {base} did not certify this key: {result['reason']}"
                )
            if time.monotonic() > deadline:
                raise LocalError(
                    f"nobody finished the sign-in at {base} within {timeout_s:.0f} s; run "
                    "p2ptrain sign-in again"
                )


async def renew(
    issuer_url: str, identity: Identity, certificate: Signed[AdmissionCertificate]
) -> Signed[AdmissionCertificate]:
    """A new certificate for ``identity`` from ``issuer_url``, for the still-valid
    ``certificate``; raises :class:`IssuerUnreachable` (try later) or LocalError (the
    issuer said no: sign in again)."""
    base = issuer_url.rstrip("/")
    body, headers = sign(
        identity, "/renew", {"certificate": bytes(certificate.envelope.encode()).hex()}
    )
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as http:
        status, answer = await _call(http, "POST", f"{base}/renew", data=body, headers=headers)
    if status != 200:
        raise LocalError(
            f"the issuer at {base} did not renew this node's certificate: {answer.get('error')}"
        )
    return _certificate(str(answer["certificate"]), identity, base)


async def redeem(
    issuer_url: str, identity: Identity, invite: Invite
) -> Signed[AdmissionCertificate]:
    """A certificate for ``identity`` on ``invite``'s grant, from the issuing service."""
    base = issuer_url.rstrip("/")
    body, headers = sign(identity, "/redeem", {"invite": invite.text})
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as http:
        status, answer = await _call(http, "POST", f"{base}/redeem", data=body, headers=headers)
    if status != 200:
        raise LocalError(f"the issuer at {base} did not admit this key: {answer.get('error')}")
    return _certificate(str(answer["certificate"]), identity, base)


def save(data_dir: Path, issuer_url: str, certificate: Signed[AdmissionCertificate]) -> None:
    """Keep ``certificate`` and where it came from in the node's data directory."""
    write_atomically(data_dir / CERTIFICATE_FILE, bytes(certificate.envelope.encode()))
    write_atomically(data_dir / ISSUER_FILE, issuer_url.rstrip("/").encode())
