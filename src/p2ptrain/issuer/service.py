"""The issuing service (``p2ptrain issuer``): a person signs in, their node key gets a
certificate to the network carrying who they are.

An HTTP service with the issuer's key. What a node does (``p2ptrain sign-in``, or its
renewal before expiry; :mod:`p2ptrain.issuer.client`):

* ``GET /``: the network, the issuer's key and the connectors (JSON);
* ``POST /sign-in`` (signed by the node's key, :mod:`~p2ptrain.issuer.signed_request`;
  fields ``connector``, ``device``): opens a sign-in for that key. For a browser sign-in the
  answer holds ``url``, which the person opens: ``GET /sign-in/SESSION`` sends the browser to
  the provider (authorization code with PKCE, a state and a nonce), which sends it back to
  ``GET /callback``; behind a trusted-ingress proxy, the visit itself proves who the person
  is. For the device flow the answer holds the ``user_code`` and the ``verification_uri``
  to enter it at, and the service polls the provider;
* ``GET /sign-in/SESSION/result?wait=S``: waits up to S seconds for the outcome:
  ``pending``, ``issued`` (with the certificate's envelope, hex, and the subject) or
  ``refused`` (with the reason);
* ``POST /renew`` (signed; field ``certificate``): a new certificate for a key whose
  certificate from this issuer is still valid, when the policy renews without a sign-in,
  the key was not revoked and the subject is still allowed.

Every certificate is checked against the :class:`~p2ptrain.issuer.policy.Policy` (allow-
list, keys per subject) and recorded in the :class:`~p2ptrain.issuer.policy.Ledger`. Open
sign-ins are bounded (:data:`MAX_PENDING`, each for :data:`SESSION_TTL_S`), so strangers
cannot fill the service's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import html
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

from aiohttp import web

from p2ptrain.core.admission import issue_certificate, now_ms
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.identity import Identity, peer_id_of
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.issuer.connectors import Connector, DeviceGrant, Proven, SignInRefused
from p2ptrain.issuer.invite import INVITE_SUBJECT, Invite, read_invite
from p2ptrain.issuer.policy import Ledger, Policy
from p2ptrain.issuer.signed_request import SIGNATURE_HEADER, open_request

__all__ = ["MAX_PENDING", "SESSION_TTL_S", "IssuerService", "start_service"]

log = logging.getLogger(__name__)

#: Open sign-ins the service keeps at once (the oldest is dropped beyond).
MAX_PENDING: Final = 1000
#: How long a sign-in stays open.
SESSION_TTL_S: Final = 600.0
#: The longest ``wait`` a result request may ask for.
MAX_WAIT_S: Final = 30.0


@dataclasses.dataclass
class _SignIn:
    key: bytes
    connector: Connector
    state: str
    verifier: str
    nonce: str
    opened: float
    grant: DeviceGrant | None = None
    status: str = "pending"
    certificate: str = ""
    subject: str = ""
    reason: str = ""
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def end(self, *, certificate: str = "", subject: str = "", reason: str = "") -> None:
        self.status = "issued" if certificate else "refused"
        self.certificate, self.subject, self.reason = certificate, subject, reason
        self.done.set()


def _page(title: str, text: str, status: int = 200) -> web.Response:
    body = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "</head><body style='font-family:sans-serif;max-width:40em;margin:3em auto'>"
        f"<h1>{html.escape(title)}</h1><p>{html.escape(text)}</p></body></html>"
    )
    return web.Response(text=body, status=status, content_type="text/html")


def _error(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status)


class IssuerService:
    """The service's state and routes (see the module's docstring)."""

    def __init__(
        self,
        identity: Identity,
        network_id: str,
        connectors: Sequence[Connector],
        policy: Policy,
        ledger: Ledger,
        *,
        public_url: str = "",
    ) -> None:
        if not connectors:
            raise LocalError("the issuer needs at least one connector ([[connectors]])")
        self.identity = identity
        self.network_id = network_id
        self.connectors = {connector.name: connector for connector in connectors}
        self.policy = policy
        self.ledger = ledger
        #: Where people reach the service (``http://host:port``), set once it listens.
        self.public_url = public_url.rstrip("/")
        self._pending: OrderedDict[str, _SignIn] = OrderedDict()
        self._by_state: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024)
        app.add_routes(
            [
                web.get("/", self._info),
                web.post("/sign-in", self._open),
                web.get("/sign-in/{session}", self._visit),
                web.get("/sign-in/{session}/result", self._result),
                web.get("/callback", self._callback),
                web.post("/renew", self._renew),
                web.post("/redeem", self._redeem),
            ]
        )
        app.on_cleanup.append(self._cleanup)
        return app

    async def prepare(self) -> None:
        for connector in self.connectors.values():
            await connector.prepare()

    async def _cleanup(self, _: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- certificates --------------------------------------------------------------

    def certify(
        self,
        key: bytes,
        proven: Proven,
        *,
        renewal: bool = False,
        invite: Invite | None = None,
        roles: tuple[str, ...] | None = None,
    ) -> tuple[str, str]:
        """A certificate for ``key`` held by ``proven`` (envelope hex, subject), with the
        policy's ``roles`` unless given; raises SignInRefused with the policy's reason. A
        ``renewal`` knows the subject only; a key admitted by an ``invite`` counts as one of
        its uses, which are its limit (and so are not held to the keys-per-person limit)."""
        at = now_ms()
        by_invite = proven.subject.startswith(INVITE_SUBJECT)
        if invite is not None:
            refusal = self.ledger.redeem(invite.id, key, invite.uses)
        elif renewal:
            refusal = None if by_invite else self.policy.renewal_refusal(proven.subject)
        else:
            refusal = self.policy.refusal(proven)
        if refusal is None:
            limit = invite.uses if invite else self.policy.max_keys_per_subject
            refusal = self.ledger.limit_problem(
                key, proven.subject, limit if not (renewal and by_invite) else 1 << 30, at
            )
        if refusal is not None:
            log.info("refused key %s of %s: %s", peer_id_of(key)[:16], proven.subject, refusal)
            raise SignInRefused(refusal)
        expires = at + int(self.policy.lifetime_s * 1000)
        signed = issue_certificate(
            self.identity,
            self.network_id,
            key,
            roles=roles if roles is not None else self.policy.roles,
            expires_ms=expires,
            name=proven.subject,
        )
        self.ledger.record(key, proven.subject, expires, at)
        log.info("certified key %s for %s", peer_id_of(key)[:16], proven.subject)
        return bytes(signed.envelope.encode()).hex(), proven.subject

    # --- routes ----------------------------------------------------------------------

    async def _info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "network_id": self.network_id,
                "issuer": self.identity.public_key.hex(),
                "connectors": [
                    {**c.describe(), "device_flow": c.device_flow, "browser": c.redirects}
                    for c in self.connectors.values()
                ],
                "roles": list(self.policy.roles),
                "lifetime_s": self.policy.lifetime_s,
                "renew": self.policy.renew,
            }
        )

    async def _signed(self, request: web.Request) -> tuple[bytes, dict[str, Any]]:
        body = await request.read()
        try:
            return open_request(request.path, body, request.headers.get(SIGNATURE_HEADER, ""))
        except ValueError as exc:
            raise web.HTTPBadRequest(
                text=json.dumps({"error": str(exc)}), content_type="application/json"
            ) from exc

    def _forget_stale(self) -> None:
        now = time.monotonic()
        while self._pending:
            session, sign_in = next(iter(self._pending.items()))
            if now - sign_in.opened < SESSION_TTL_S and len(self._pending) < MAX_PENDING:
                break
            self._pending.pop(session)
            self._by_state.pop(sign_in.state, None)
            if not sign_in.done.is_set():
                sign_in.end(reason="the sign-in was not finished in time; start it again")

    async def _open(self, request: web.Request) -> web.Response:
        key, fields = await self._signed(request)
        name = fields.get("connector") or next(iter(self.connectors))
        connector = self.connectors.get(str(name))
        if connector is None:
            return _error(
                404,
                f"no connector {name!r} here; this issuer has {', '.join(self.connectors)}",
            )
        self._forget_stale()
        session = secrets.token_urlsafe(18)
        sign_in = _SignIn(
            key=key,
            connector=connector,
            state=secrets.token_urlsafe(18),
            verifier=secrets.token_urlsafe(48),
            nonce=secrets.token_urlsafe(18),
            opened=time.monotonic(),
        )
        answer: dict[str, Any] = {"session": session, "connector": connector.name}
        if fields.get("device"):
            try:
                sign_in.grant = await connector.start_device()
            except SignInRefused as exc:
                return _error(400, str(exc))
            answer.update(
                user_code=sign_in.grant.user_code,
                verification_uri=sign_in.grant.verification_uri,
                verification_uri_complete=sign_in.grant.verification_uri_complete,
            )
            task = asyncio.create_task(self._poll_device(sign_in))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            answer["url"] = f"{self.public_url}/sign-in/{session}"
        self._pending[session] = sign_in
        self._by_state[sign_in.state] = session
        return web.json_response(answer)

    def _finish(self, sign_in: _SignIn, proven: Proven) -> None:
        try:
            certificate, subject = self.certify(sign_in.key, proven)
        except SignInRefused as exc:
            sign_in.end(subject=proven.subject, reason=str(exc))
        else:
            sign_in.end(certificate=certificate, subject=subject)

    async def _poll_device(self, sign_in: _SignIn) -> None:
        grant = sign_in.grant
        assert grant is not None
        while not sign_in.done.is_set():
            if time.monotonic() > grant.expires_at:
                sign_in.end(reason="the device code expired before it was entered")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sign_in.done.wait(), grant.interval_s)
            if sign_in.done.is_set():
                return
            try:
                proven = await sign_in.connector.poll_device(grant)
            except SignInRefused as exc:
                sign_in.end(reason=str(exc))
                return
            if proven is not None:
                self._finish(sign_in, proven)

    def _redirect_uri(self) -> str:
        return f"{self.public_url}/callback"

    async def _visit(self, request: web.Request) -> web.StreamResponse:
        sign_in = self._pending.get(request.match_info["session"])
        if sign_in is None or sign_in.grant is not None:
            return _page("Unknown sign-in", "This sign-in link is unknown or has expired.", 404)
        if sign_in.done.is_set():
            return self._outcome_page(sign_in)
        connector = sign_in.connector
        if not connector.redirects:
            try:
                proven = connector.from_ingress(request.remote, request.headers)
            except SignInRefused as exc:
                return _page("Not signed in", str(exc), 403)
            self._finish(sign_in, proven)
            return self._outcome_page(sign_in)
        try:
            url = await connector.authorization_url(
                redirect_uri=self._redirect_uri(),
                state=sign_in.state,
                verifier=sign_in.verifier,
                nonce=sign_in.nonce,
            )
        except SignInRefused as exc:
            return _page("Sign-in unavailable", f"{exc}; try again later", 502)
        raise web.HTTPFound(url)

    def _outcome_page(self, sign_in: _SignIn) -> web.Response:
        if sign_in.status == "issued":
            return _page(
                "Signed in",
                f"Signed in as {sign_in.subject}: node key {peer_id_of(sign_in.key)[:16]} has "
                "its certificate. You can close this page.",
            )
        return _page("Not signed in", sign_in.reason, 403)

    async def _callback(self, request: web.Request) -> web.Response:
        session = self._by_state.get(request.query.get("state", ""))
        sign_in = None if session is None else self._pending.get(session)
        if sign_in is None:
            return _page("Unknown sign-in", "This sign-in is unknown or has expired.", 400)
        if sign_in.done.is_set():
            return self._outcome_page(sign_in)
        if "error" in request.query:
            reason = request.query.get("error_description") or request.query["error"]
            sign_in.end(reason=f"the provider did not sign you in: {reason}")
            return self._outcome_page(sign_in)
        try:
            proven = await sign_in.connector.finish(
                code=request.query.get("code", ""),
                redirect_uri=self._redirect_uri(),
                verifier=sign_in.verifier,
                nonce=sign_in.nonce,
            )
        except SignInRefused as exc:
            sign_in.end(reason=str(exc))
        else:
            self._finish(sign_in, proven)
        return self._outcome_page(sign_in)

    async def _result(self, request: web.Request) -> web.Response:
        sign_in = self._pending.get(request.match_info["session"])
        if sign_in is None:
            return _error(404, "this sign-in is unknown or has expired; start it again")
        try:
            wait = min(max(float(request.query.get("wait", "0")), 0.0), MAX_WAIT_S)
        except ValueError:
            return _error(400, "wait: a number of seconds")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sign_in.done.wait(), wait)
        return web.json_response(
            {
                "status": sign_in.status,
                "certificate": sign_in.certificate,
                "subject": sign_in.subject,
                "reason": sign_in.reason,
            }
        )

    async def _renew(self, request: web.Request) -> web.Response:
        key, fields = await self._signed(request)
        try:
            old = open_envelope(
                bytes.fromhex(str(fields.get("certificate", ""))), AdmissionCertificate
            )
        except (ValueError, ProtocolViolation) as exc:
            return _error(400, f"certificate: not a signed admission certificate ({exc})")
        certificate = old.record
        if certificate.subject != key or certificate.issuer != self.identity.public_key:
            return _error(403, "the certificate is not this issuer's certificate for this key")
        if certificate.network_id != self.network_id:
            return _error(403, f"the certificate is for network {certificate.network_id[:16]}")
        if self.policy.renew == "sign-in":
            return _error(403, "this issuer renews only after a new sign-in: run p2ptrain sign-in")
        if certificate.not_after_ms and certificate.not_after_ms < now_ms():
            return _error(403, "the certificate has expired: sign in again (p2ptrain sign-in)")
        subject = self.ledger.subject_of(key)
        if subject is None or subject != certificate.name:
            return _error(403, "this issuer has no record of certifying this key: sign in again")
        try:
            renewed, _ = self.certify(
                key, Proven(subject=subject), renewal=True, roles=certificate.roles
            )
        except SignInRefused as exc:
            return _error(403, str(exc))
        return web.json_response({"certificate": renewed, "subject": subject})

    async def _redeem(self, request: web.Request) -> web.Response:
        key, fields = await self._signed(request)
        try:
            invite = read_invite(str(fields.get("invite", "")))
        except LocalError as exc:
            return _error(400, str(exc))
        if invite.issuer != self.identity.public_key or invite.network_id != self.network_id:
            return _error(403, "this invite was not made by this issuer for its network")
        if invite.mode != "grant":
            return _error(400, "this invite asks you to sign in: p2ptrain sign-in")
        expired = invite.expired_problem(now_ms())
        if expired is not None:
            return _error(403, expired)
        try:
            certificate, subject = self.certify(
                key, Proven(invite.subject()), invite=invite, roles=invite.roles
            )
        except SignInRefused as exc:
            return _error(403, str(exc))
        return web.json_response({"certificate": certificate, "subject": subject})


async def start_service(service: IssuerService, where: str) -> web.AppRunner:
    """Serve ``service`` at ``where`` (HOST:PORT; port 0: any free one); sets its public
    URL to the bound address unless one was given."""
    from p2ptrain.observe.dashboard import parse_listen

    host, port = parse_listen(where, "--listen")
    await service.prepare()
    runner = web.AppRunner(service.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise LocalError(
            f"--listen {where}: cannot listen there ({exc.strerror or exc}); pick another "
            "port, or port 0 for any free one"
        ) from exc
    if not service.public_url:
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else str(bound[0])
        service.public_url = f"http://{shown}:{bound[1]}"
    return runner
