"""Sign-in connectors of the issuing service: each proves who a person is, one way.

Every connector is a small class over :class:`Connector`:

* :class:`OidcConnector`: a generic OpenID Connect provider, found by its discovery
  document: authorization code with PKCE (S256) and a nonce, or the device flow for a
  headless trainer; the ID token's signature (the provider's JWKS), issuer, audience,
  expiry and nonce are checked. The subject is ``oidc:ISSUER#SUB``.
* :class:`OAuth2Connector`: a generic OAuth 2 server with configured endpoints: the
  authorization code flow with PKCE, then the user-info endpoint, one of whose fields names
  the person (``PREFIX:VALUE``).
* :class:`GitHubConnector`: the OAuth 2 connector with GitHub's endpoints and API: the
  subject is ``github:LOGIN``; the person's organisations and teams (``org``, ``org/team``)
  come from the API, for an allow-list of them.
* :class:`TrustedIngress`: an authenticating reverse proxy has already signed the person in
  and names them in a request header; the header is believed only on a connection from one
  of the configured proxy addresses.

The OAuth machinery (PKCE, the token requests, client authentication) is authlib's; the ID
token checks are joserfc's. What is ours is what a sign-in proves: a subject string, and the
groups an allow-list may name.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Final

from p2ptrain.errors import LocalError

__all__ = [
    "DEVICE_GRANT",
    "Connector",
    "DeviceGrant",
    "GitHubConnector",
    "OAuth2Connector",
    "OidcConnector",
    "Proven",
    "SignInRefused",
    "TrustedIngress",
]

DEVICE_GRANT: Final = "urn:ietf:params:oauth:grant-type:device_code"
#: How long a request to a provider may take.
HTTP_TIMEOUT_S: Final = 15.0


class SignInRefused(Exception):
    """The sign-in did not prove who the person is (the message says why, for the person)."""


@dataclasses.dataclass(frozen=True)
class Proven:
    """Who a sign-in proved the person to be."""

    #: ``oidc:ISSUER#SUB``, ``github:LOGIN``, ``PREFIX:VALUE``.
    subject: str
    #: Organisations and teams (``org``, ``org/team``) the provider says the person is in.
    groups: frozenset[str] = frozenset()


@dataclasses.dataclass
class DeviceGrant:
    """A device-flow sign-in in progress: the person enters ``user_code`` at
    ``verification_uri`` while the issuer polls the provider."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str
    expires_at: float
    interval_s: float


def _client(
    client_id: str, client_secret: str | None, *, redirect_uri: str | None = None, scope: str = ""
) -> Any:
    from authlib.integrations.httpx_client import AsyncOAuth2Client

    return AsyncOAuth2Client(
        client_id=client_id,
        client_secret=client_secret,
        token_endpoint_auth_method="client_secret_basic" if client_secret else "none",
        code_challenge_method="S256",
        redirect_uri=redirect_uri,
        scope=scope or None,
        timeout=HTTP_TIMEOUT_S,
    )


def _transport_errors() -> tuple[type[Exception], ...]:
    """What authlib's client raises when the server cannot be reached or answers nonsense."""
    import httpx

    return (httpx.HTTPError, ValueError)


def _oauth_failure(where: str, exc: Exception) -> SignInRefused:
    description = getattr(exc, "description", None) or getattr(exc, "error", None) or exc
    return SignInRefused(f"{where}: {description}")


class Connector(ABC):
    """One way of proving who a person is."""

    #: What the configuration calls it (``kind``).
    kind: str = ""

    def __init__(self, name: str) -> None:
        #: The name people choose it by (``p2ptrain sign-in --connector NAME``).
        self.name = name

    async def prepare(self) -> None:
        """Read what the connector needs from its provider before the service opens."""
        return None

    @property
    def device_flow(self) -> bool:
        """Whether a headless trainer can sign in with the device flow."""
        return False

    @property
    def redirects(self) -> bool:
        """Whether a sign-in sends the browser to a provider (else: :meth:`from_ingress`)."""
        return True

    async def authorization_url(
        self, *, redirect_uri: str, state: str, verifier: str, nonce: str
    ) -> str:
        raise SignInRefused(f"connector {self.name!r} does not sign in through a browser")

    async def finish(self, *, code: str, redirect_uri: str, verifier: str, nonce: str) -> Proven:
        raise SignInRefused(f"connector {self.name!r} does not sign in through a browser")

    async def start_device(self) -> DeviceGrant:
        raise SignInRefused(
            f"connector {self.name!r} has no device flow: sign in through a browser"
        )

    async def poll_device(self, grant: DeviceGrant) -> Proven | None:
        """Who signed in with ``grant`` (None: not yet; :class:`SignInRefused`: never)."""
        raise SignInRefused(f"connector {self.name!r} has no device flow")

    def from_ingress(self, remote: str | None, headers: Mapping[str, str]) -> Proven:
        raise SignInRefused(f"connector {self.name!r} does not take a proxy's word")

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What ``GET /`` shows of this connector."""


class _CodeFlow(Connector):
    """The authorization code flow with PKCE, and the device flow where the server has one;
    subclasses say who the token's holder is (:meth:`_prove`)."""

    def __init__(
        self,
        name: str,
        *,
        client_id: str,
        client_secret: str | None,
        scope: str,
    ) -> None:
        super().__init__(name)
        self.client_id = client_id
        self.client_secret = client_secret
        self.scope = scope

    @abstractmethod
    async def _endpoints(self) -> tuple[str, str, str | None]:
        """The authorization, token and device-authorization (None: none) endpoints."""

    @abstractmethod
    async def _prove(self, token: Mapping[str, Any], nonce: str | None) -> Proven:
        """Who holds ``token`` (``nonce``: the one the authorization request sent)."""

    @property
    def device_flow(self) -> bool:
        return self._device_endpoint is not None

    _device_endpoint: str | None = None

    async def authorization_url(
        self, *, redirect_uri: str, state: str, verifier: str, nonce: str
    ) -> str:
        authorize, _, _ = await self._endpoints()
        async with _client(
            self.client_id, self.client_secret, redirect_uri=redirect_uri, scope=self.scope
        ) as client:
            url, _ = client.create_authorization_url(
                authorize, state=state, code_verifier=verifier, nonce=nonce
            )
        return str(url)

    async def finish(self, *, code: str, redirect_uri: str, verifier: str, nonce: str) -> Proven:
        from authlib.integrations.base_client import OAuthError

        _, token_url, _ = await self._endpoints()
        async with _client(
            self.client_id, self.client_secret, redirect_uri=redirect_uri, scope=self.scope
        ) as client:
            try:
                token = await client.fetch_token(
                    token_url, code=code, code_verifier=verifier, redirect_uri=redirect_uri
                )
            except OAuthError as exc:
                raise _oauth_failure(f"{self.name}: the code was not accepted", exc) from exc
            except _transport_errors() as exc:
                raise SignInRefused(f"{self.name}: {token_url} did not answer: {exc}") from exc
        return await self._prove(token, nonce)

    async def start_device(self) -> DeviceGrant:
        _, _, device = await self._endpoints()
        if device is None:
            return await super().start_device()
        import httpx

        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
                answer = await http.post(
                    device,
                    data={"client_id": self.client_id, "scope": self.scope},
                    headers={"Accept": "application/json"},
                )
        except httpx.HTTPError as exc:
            raise SignInRefused(f"{self.name}: {device} did not answer: {exc}") from exc
        if answer.status_code != 200:
            raise SignInRefused(
                f"{self.name}: the device sign-in could not start ({answer.status_code}: "
                f"{answer.text[:200]})"
            )
        body = answer.json()
        return DeviceGrant(
            device_code=str(body["device_code"]),
            user_code=str(body["user_code"]),
            verification_uri=str(body["verification_uri"]),
            verification_uri_complete=str(
                body.get("verification_uri_complete") or body["verification_uri"]
            ),
            expires_at=time.monotonic() + float(body.get("expires_in", 600)),
            interval_s=float(body.get("interval", 5)),
        )

    async def poll_device(self, grant: DeviceGrant) -> Proven | None:
        from authlib.integrations.base_client import OAuthError

        _, token_url, _ = await self._endpoints()
        async with _client(self.client_id, self.client_secret) as client:
            try:
                token = await client.fetch_token(
                    token_url,
                    grant_type=DEVICE_GRANT,
                    device_code=grant.device_code,
                )
            except OAuthError as exc:
                if exc.error == "authorization_pending":
                    return None
                if exc.error == "slow_down":
                    grant.interval_s += 5
                    return None
                raise _oauth_failure(f"{self.name}: the device sign-in failed", exc) from exc
            except _transport_errors() as exc:
                raise SignInRefused(f"{self.name}: {token_url} did not answer: {exc}") from exc
        return await self._prove(token, None)


class OidcConnector(_CodeFlow):
    """A generic OpenID Connect provider (see the module's docstring)."""

    kind = "oidc"

    def __init__(
        self,
        name: str,
        *,
        issuer: str,
        client_id: str,
        client_secret: str | None = None,
        scope: str = "openid profile",
    ) -> None:
        super().__init__(name, client_id=client_id, client_secret=client_secret, scope=scope)
        self.issuer = issuer.rstrip("/")
        self._discovery: dict[str, Any] | None = None
        self._jwks: dict[str, Any] | None = None

    async def _get_json(self, url: str, what: str) -> Any:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
                answer = await http.get(url, headers={"Accept": "application/json"})
                answer.raise_for_status()
                return answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SignInRefused(
                f"{self.name}: cannot read the provider's {what} at {url}: {exc}"
            ) from exc

    async def discovery(self) -> dict[str, Any]:
        """The provider's discovery document (read once; its issuer checked)."""
        if self._discovery is None:
            url = f"{self.issuer}/.well-known/openid-configuration"
            document = await self._get_json(url, "discovery document")
            if not isinstance(document, dict) or document.get("issuer") != self.issuer:
                raise SignInRefused(
                    f"{self.name}: the discovery document at {url} names issuer "
                    f"{document.get('issuer') if isinstance(document, dict) else None!r}, "
                    f"not {self.issuer!r}: check the connector's issuer"
                )
            self._discovery = document
            self._device_endpoint = document.get("device_authorization_endpoint")
        return self._discovery

    async def prepare(self) -> None:
        await self.discovery()

    async def _endpoints(self) -> tuple[str, str, str | None]:
        document = await self.discovery()
        return (
            str(document["authorization_endpoint"]),
            str(document["token_endpoint"]),
            self._device_endpoint,
        )

    async def _keys(self, refresh: bool) -> Any:
        from joserfc.jwk import KeySet

        if self._jwks is None or refresh:
            document = await self.discovery()
            self._jwks = await self._get_json(str(document["jwks_uri"]), "signing keys")
        return KeySet.import_key_set(self._jwks)  # type: ignore[arg-type]

    async def _prove(self, token: Mapping[str, Any], nonce: str | None) -> Proven:
        from joserfc import jwt
        from joserfc.errors import JoseError

        id_token = token.get("id_token")
        if not isinstance(id_token, str):
            raise SignInRefused(f"{self.name}: the provider sent no ID token (scope openid?)")
        algorithms = (await self.discovery()).get(
            "id_token_signing_alg_values_supported", ["RS256"]
        )
        try:
            try:
                decoded = jwt.decode(id_token, await self._keys(False), algorithms=algorithms)
            except JoseError:  # a key the provider rotated in since we read its keys
                decoded = jwt.decode(id_token, await self._keys(True), algorithms=algorithms)
            expected: dict[str, Any] = {
                "iss": {"essential": True, "value": self.issuer},
                "aud": {"essential": True, "value": self.client_id},
                "sub": {"essential": True},
                "exp": {"essential": True},
            }
            if nonce is not None:
                expected["nonce"] = {"essential": True, "value": nonce}
            jwt.JWTClaimsRegistry(**expected).validate(decoded.claims)
        except (JoseError, ValueError) as exc:
            raise SignInRefused(f"{self.name}: the ID token was not valid: {exc}") from exc
        return Proven(subject=f"oidc:{self.issuer}#{decoded.claims['sub']}")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "issuer": self.issuer}


class OAuth2Connector(_CodeFlow):
    """A generic OAuth 2 server (see the module's docstring)."""

    kind = "oauth2"

    def __init__(
        self,
        name: str,
        *,
        authorize_url: str,
        token_url: str,
        userinfo_url: str,
        client_id: str,
        client_secret: str | None = None,
        scope: str = "",
        subject_field: str = "sub",
        prefix: str | None = None,
        device_url: str | None = None,
    ) -> None:
        super().__init__(name, client_id=client_id, client_secret=client_secret, scope=scope)
        self.authorize_url = authorize_url
        self.token_url = token_url
        self.userinfo_url = userinfo_url
        self.subject_field = subject_field
        self.prefix = prefix or name
        self._device_endpoint = device_url

    async def _endpoints(self) -> tuple[str, str, str | None]:
        return self.authorize_url, self.token_url, self._device_endpoint

    async def _api(self, token: Mapping[str, Any], url: str) -> Any:
        import httpx

        access = token.get("access_token")
        if not isinstance(access, str):
            raise SignInRefused(f"{self.name}: the server sent no access token")
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
                answer = await http.get(
                    url,
                    headers={"Authorization": f"Bearer {access}", "Accept": "application/json"},
                )
                answer.raise_for_status()
                return answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SignInRefused(f"{self.name}: {url} did not answer: {exc}") from exc

    async def _prove(self, token: Mapping[str, Any], nonce: str | None) -> Proven:
        info = await self._api(token, self.userinfo_url)
        value = info.get(self.subject_field) if isinstance(info, dict) else None
        if not isinstance(value, str | int) or str(value) == "":
            raise SignInRefused(
                f"{self.name}: the user info at {self.userinfo_url} has no "
                f"{self.subject_field!r} to name the person by"
            )
        return Proven(subject=f"{self.prefix}:{value}")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "authorize_url": self.authorize_url}


class GitHubConnector(OAuth2Connector):
    """GitHub's OAuth app sign-in: ``github:LOGIN``, with the person's organisations and
    teams as groups (the ``read:org`` scope)."""

    kind = "github"

    def __init__(
        self,
        name: str = "github",
        *,
        client_id: str,
        client_secret: str | None = None,
        base_url: str = "https://github.com",
        api_url: str = "https://api.github.com",
        authorize_url: str | None = None,
        token_url: str | None = None,
        scope: str = "read:org",
    ) -> None:
        base = base_url.rstrip("/")
        self.api_url = api_url.rstrip("/")
        super().__init__(
            name,
            authorize_url=authorize_url or f"{base}/login/oauth/authorize",
            token_url=token_url or f"{base}/login/oauth/access_token",
            userinfo_url=f"{self.api_url}/user",
            client_id=client_id,
            client_secret=client_secret,
            scope=scope,
            subject_field="login",
            prefix="github",
            device_url=f"{base}/login/device/code" if authorize_url is None else None,
        )

    async def _prove(self, token: Mapping[str, Any], nonce: str | None) -> Proven:
        person = await super()._prove(token, nonce)
        orgs = await self._api(token, f"{self.api_url}/user/orgs")
        teams = await self._api(token, f"{self.api_url}/user/teams")
        groups = {str(org["login"]) for org in orgs if isinstance(org, dict) and "login" in org}
        for team in teams if isinstance(teams, list) else []:
            org = team.get("organization", {}) if isinstance(team, dict) else {}
            if isinstance(org, dict) and "login" in org and "slug" in team:
                groups.add(f"{org['login']}/{team['slug']}")
        return Proven(subject=person.subject, groups=frozenset(groups))


class TrustedIngress(Connector):
    """The person signed in at an authenticating reverse proxy, which names them in
    ``header``; believed only on a connection from one of ``proxies``."""

    kind = "trusted-ingress"

    def __init__(
        self, name: str, *, header: str, proxies: frozenset[str], prefix: str = "ingress"
    ) -> None:
        super().__init__(name)
        if not proxies:
            raise LocalError(
                f"connector {name!r} (trusted-ingress): give the proxies' addresses "
                "(proxies = [...]): without them anyone could set the header"
            )
        self.header = header
        self.proxies = proxies
        self.prefix = prefix

    @property
    def redirects(self) -> bool:
        return False

    def from_ingress(self, remote: str | None, headers: Mapping[str, str]) -> Proven:
        if remote not in self.proxies:
            raise SignInRefused(
                f"{self.name}: this request came from {remote}, not through the "
                "authenticating proxy: open the sign-in link at the proxy's address"
            )
        value = headers.get(self.header, "").strip()
        if not value:
            raise SignInRefused(
                f"{self.name}: the proxy did not name the person (no {self.header} header)"
            )
        return Proven(subject=f"{self.prefix}:{value}")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "header": self.header}
