"""The issuer's other connectors, end to end on loopback: the generic OAuth 2 connector and
the GitHub preset against the real OpenID provider (``oidc-provider``, skipped without it),
and trusted ingress.

The GitHub preset's OAuth endpoints point at the provider; its API at a recorded GitHub API
on loopback that answers ``/user``, ``/user/orgs`` and ``/user/teams`` with answers recorded
per login, for whoever holds the bearer token (the provider's user-info endpoint says who).
One issuing service (in this process) serves all three connectors, with an allow-list of
the ``p2ptrain`` organisation and the person ``forge:carol``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.core.identity import Identity
from p2ptrain.errors import LocalError
from p2ptrain.issuer.client import SignedIn, sign_in
from p2ptrain.issuer.connectors import GitHubConnector, OAuth2Connector, TrustedIngress
from p2ptrain.issuer.policy import Ledger, Policy
from p2ptrain.issuer.service import IssuerService, start_service
from tests.support.oidc import (
    WEB_CLIENT,
    WEB_SECRET,
    OidcProvider,
    log_in,
    provider_unavailable,
)

pytestmark = pytest.mark.integration

NETWORK = "cd" * 32
PROXY = "127.0.0.2"  # the trusted proxy's address: loopback, but not the tests' own
#: What GitHub's API answered for two people, as recorded (trimmed to the fields read).
RECORDED: dict[str, dict[str, Any]] = {
    "octocat": {
        "user": {"login": "octocat", "id": 583231, "type": "User"},
        "orgs": [{"login": "p2ptrain", "id": 9919}, {"login": "github", "id": 9920}],
        "teams": [{"slug": "trainers", "organization": {"login": "p2ptrain"}}],
    },
    "hubot": {
        "user": {"login": "hubot", "id": 480938, "type": "User"},
        "orgs": [{"login": "github", "id": 9920}],
        "teams": [],
    },
}


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    reason = provider_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with OidcProvider(tmp_path_factory.mktemp("oidc") / "provider.log") as provider:
        yield provider


def _recorded_github(provider: OidcProvider) -> web.Application:
    async def who(request: web.Request) -> str:
        bearer = request.headers.get("Authorization", "")
        if not bearer.startswith("Bearer "):
            raise web.HTTPUnauthorized(text='{"message": "Requires authentication"}')
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{provider.issuer}/me", headers={"Authorization": bearer}) as answer,
        ):
            if answer.status != 200:
                raise web.HTTPUnauthorized(text='{"message": "Bad credentials"}')
            return str((await answer.json())["sub"])

    def answering(part: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(RECORDED[await who(request)][part])

        return handler

    app = web.Application()
    app.add_routes(
        [
            web.get("/user", answering("user")),
            web.get("/user/orgs", answering("orgs")),
            web.get("/user/teams", answering("teams")),
        ]
    )
    return app


async def _serving(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


class Scene:
    def __init__(self, service: IssuerService) -> None:
        self.service = service

    async def sign_in(self, connector: str, login: str) -> SignedIn:
        async def person(event: dict[str, Any]) -> None:
            await log_in(event["url"], login)

        tasks: list[asyncio.Task[None]] = []
        try:
            return await sign_in(
                self.service.public_url,
                Identity.generate(),
                connector=connector,
                say=lambda event: tasks.append(asyncio.create_task(person(event))),
                timeout_s=60,
            )
        finally:
            await asyncio.gather(*tasks)


async def _scene(provider: OidcProvider, workdir: Path) -> AsyncIterator[Scene]:
    github_runner, github_api = await _serving(_recorded_github(provider))
    connectors = [
        OAuth2Connector(
            "forge",
            authorize_url=f"{provider.issuer}/auth",
            token_url=f"{provider.issuer}/token",
            userinfo_url=f"{provider.issuer}/me",
            client_id=WEB_CLIENT,
            client_secret=WEB_SECRET,
            scope="openid profile",
            subject_field="preferred_username",
        ),
        GitHubConnector(
            "github",
            client_id=WEB_CLIENT,
            client_secret=WEB_SECRET,
            authorize_url=f"{provider.issuer}/auth",
            token_url=f"{provider.issuer}/token",
            api_url=github_api,
            scope="openid read:org",
        ),
        TrustedIngress("proxy", header="X-Forwarded-User", proxies=frozenset({PROXY})),
    ]
    policy = Policy(
        allow_subjects=frozenset({"forge:carol", "ingress:dave"}),
        allow_groups=frozenset({"p2ptrain"}),
    )
    ledger = Ledger(workdir)
    service = IssuerService(Identity.generate(), NETWORK, connectors, policy, ledger)
    runner = await start_service(service, "127.0.0.1:0")
    try:
        yield Scene(service)
    finally:
        await runner.cleanup()
        await github_runner.cleanup()
        ledger.close()


def _run(provider: OidcProvider, workdir: Path, body: Any) -> None:
    async def main() -> None:
        scenes = _scene(provider, workdir)
        scene = await anext(scenes)
        try:
            await body(scene)
        finally:
            await scenes.aclose()

    asyncio.run(main())


def test_generic_oauth2_names_the_person_by_a_user_info_field(
    provider: OidcProvider, tmp_path: Path
) -> None:
    async def body(scene: Scene) -> None:
        signed_in = await scene.sign_in("forge", "carol")
        assert signed_in.subject == "forge:carol"
        assert signed_in.certificate.record.name == "forge:carol"
        with pytest.raises(LocalError, match="forge:erin is not on this network's allow-list"):
            await scene.sign_in("forge", "erin")

    _run(provider, tmp_path, body)


def test_the_github_preset_certifies_an_org_member_and_refuses_others(
    provider: OidcProvider, tmp_path: Path
) -> None:
    async def body(scene: Scene) -> None:
        signed_in = await scene.sign_in("github", "octocat")
        assert signed_in.subject == "github:octocat"
        assert signed_in.certificate.record.name == "github:octocat"
        with pytest.raises(LocalError, match=r"github:hubot \(member of github\) is not on"):
            await scene.sign_in("github", "hubot")

    _run(provider, tmp_path, body)


def test_trusted_ingress_takes_the_header_only_from_the_proxy(
    provider: OidcProvider, tmp_path: Path
) -> None:
    async def visit(url: str, local: str) -> tuple[int, str]:
        connector = aiohttp.TCPConnector(local_addr=(local, 0))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.get(url, headers={"X-Forwarded-User": "dave"}) as answer,
        ):
            return answer.status, await answer.text()

    async def body(scene: Scene) -> None:
        pages: list[tuple[int, str]] = []

        async def person(event: dict[str, Any]) -> None:
            pages.append(await visit(event["url"], "127.0.0.1"))  # around the proxy
            pages.append(await visit(event["url"], PROXY))  # through it

        tasks: list[asyncio.Task[None]] = []
        signed_in = await sign_in(
            scene.service.public_url,
            Identity.generate(),
            connector="proxy",
            say=lambda event: tasks.append(asyncio.create_task(person(event))),
            timeout_s=60,
        )
        await asyncio.gather(*tasks)
        assert pages[0][0] == 403 and "not through the authenticating proxy" in pages[0][1]
        assert pages[1][0] == 200 and "Signed in as ingress:dave" in pages[1][1]
        assert signed_in.subject == "ingress:dave"

    _run(provider, tmp_path, body)
