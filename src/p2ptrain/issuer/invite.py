"""Invites: everything a newcomer needs to join a certificate network, in one line.

``p2ptrain invite`` (an issuer) prints one; ``p2ptrain join INVITE`` (the newcomer) reads it.
An invite names the network and experiment, the bootstrap addresses, the roles it admits,
its expiry, the issuing service's address, and how the newcomer gets a certificate:

* ``grant``: the invite itself admits, up to ``uses`` keys; the issuing service counts the
  keys it certified on it (``POST /redeem``) and refuses one more;
* ``sign-in``: the newcomer signs in at the issuing service (``p2ptrain sign-in``).

It is text: ``p2ptrain-invite-1.`` then the JSON fields and the issuer's Ed25519 signature
over them, each base64url. The joiner checks the signature against the issuer key it names,
and that key against the network manifest the bootstraps serve (which lists the network's
issuers), so a forged invite cannot lead anyone into another network.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import secrets
from collections.abc import Sequence
from typing import Any, Final, Literal

from p2ptrain.core.admission import when_text
from p2ptrain.core.identity import Identity, verify_signature
from p2ptrain.errors import LocalError

__all__ = ["INVITE_SUBJECT", "PREFIX", "Invite", "make_invite", "read_invite"]

PREFIX: Final = "p2ptrain-invite-1."
#: How the certificates of keys an invite admitted name their holder: ``invite:NAME``.
INVITE_SUBJECT: Final = "invite:"
_CONTEXT: Final = b"p2ptrain invite v1\n"
#: The longest invite text read (a few bootstraps and ids).
MAX_CHARS: Final = 8192


@dataclasses.dataclass(frozen=True)
class Invite:
    id: str
    network_id: str
    experiment_id: str
    bootstrap: tuple[str, ...]
    roles: tuple[str, ...]
    issuer: bytes
    issuer_url: str
    mode: Literal["grant", "sign-in"]
    uses: int
    expires_ms: int
    name: str = ""
    #: The invite's text as it was read or made (what a redemption sends).
    text: str = dataclasses.field(default="", compare=False)

    def fields(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        del fields["text"]
        fields["issuer"] = self.issuer.hex()
        fields["bootstrap"], fields["roles"] = list(self.bootstrap), list(self.roles)
        return fields

    def expired_problem(self, at_ms: int) -> str | None:
        if self.expires_ms and self.expires_ms < at_ms:
            return f"this invite expired at {when_text(self.expires_ms)}; ask for a new one"
        return None

    def subject(self) -> str:
        """Who a key certified on this grant is (``invite:NAME`` or ``invite:ID``)."""
        return f"{INVITE_SUBJECT}{self.name or self.id}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def make_invite(
    issuer: Identity,
    *,
    network_id: str,
    experiment_id: str,
    bootstrap: Sequence[str],
    roles: Sequence[str],
    issuer_url: str,
    mode: Literal["grant", "sign-in"],
    uses: int,
    expires_ms: int,
    name: str = "",
) -> tuple[Invite, str]:
    """A new invite signed by ``issuer``, and its text."""
    invite = Invite(
        id=secrets.token_hex(8),
        network_id=network_id,
        experiment_id=experiment_id,
        bootstrap=tuple(bootstrap),
        roles=tuple(sorted(set(roles))),
        issuer=issuer.public_key,
        issuer_url=issuer_url.rstrip("/"),
        mode=mode,
        uses=uses,
        expires_ms=expires_ms,
        name=name,
    )
    body = json.dumps(invite.fields(), sort_keys=True).encode()
    text = f"{PREFIX}{_b64(body)}.{_b64(issuer.sign(_CONTEXT + body))}"
    return dataclasses.replace(invite, text=text), text


def read_invite(text: str) -> Invite:
    """The invite in ``text``, its signature checked (by the key it names)."""
    text = text.strip()
    if not text.startswith(PREFIX) or len(text) > MAX_CHARS:
        raise LocalError(
            f"that is not a p2ptrain invite (it starts {text[:24]!r}; an invite starts "
            f"{PREFIX!r}): copy the whole line `p2ptrain invite` printed"
        )
    try:
        body_text, signature_text = text[len(PREFIX) :].split(".")
        body, signature = _unb64(body_text), _unb64(signature_text)
        fields = json.loads(body)
        invite = Invite(
            id=str(fields["id"]),
            network_id=str(fields["network_id"]),
            experiment_id=str(fields["experiment_id"]),
            bootstrap=tuple(str(b) for b in fields["bootstrap"]),
            roles=tuple(str(r) for r in fields["roles"]),
            issuer=bytes.fromhex(fields["issuer"]),
            issuer_url=str(fields["issuer_url"]),
            mode=fields["mode"],
            uses=int(fields["uses"]),
            expires_ms=int(fields["expires_ms"]),
            name=str(fields.get("name", "")),
            text=text,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise LocalError(
            f"the invite is damaged ({exc.__class__.__name__}: {exc}): copy the whole line"
        ) from exc
    if invite.mode not in ("grant", "sign-in") or len(invite.issuer) != 32:
        raise LocalError("the invite is damaged (mode or issuer): copy the whole line")
    if not verify_signature(invite.issuer, _CONTEXT + body, signature):
        raise LocalError(
            "the invite's signature does not verify: it was changed; ask for a new one"
        )
    return invite
