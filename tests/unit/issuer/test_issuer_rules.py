"""The issuing service's rules without a provider: the allow-list, the keys-per-person
limit across restarts, revoked keys, signed requests, the configuration file, trusted
ingress, and the service's sign-in and renewal answers (over aiohttp's test server)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from p2ptrain.core.admission import issue_certificate, now_ms
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.records import AdmissionCertificate
from p2ptrain.errors import LocalError
from p2ptrain.issuer.config import load_config
from p2ptrain.issuer.connectors import (
    GitHubConnector,
    OidcConnector,
    Proven,
    SignInRefused,
    TrustedIngress,
)
from p2ptrain.issuer.policy import Ledger, Policy
from p2ptrain.issuer.service import IssuerService
from p2ptrain.issuer.signed_request import SIGNATURE_HEADER, open_request, sign

NETWORK = "ab" * 32
ALICE = Proven("github:alice", frozenset({"lab", "lab/core"}))


def test_the_allow_list_names_people_or_their_groups() -> None:
    assert Policy().refusal(ALICE) is None  # no list: everyone who signs in
    assert Policy(allow_subjects=frozenset({"github:alice"})).refusal(ALICE) is None
    assert Policy(allow_groups=frozenset({"lab/core"})).refusal(ALICE) is None
    refusal = Policy(allow_groups=frozenset({"other"})).refusal(ALICE)
    assert refusal is not None and "github:alice (member of lab, lab/core)" in refusal
    assert "not on this network's allow-list (other)" in refusal
    listed = Policy(allow_subjects=frozenset({"github:bob"}))
    assert listed.renewal_refusal("github:alice") is not None
    assert listed.renewal_refusal("github:bob") is None


def test_the_ledger_holds_each_person_to_the_limit_across_restarts(tmp_path: Path) -> None:
    keys = [Identity.generate().public_key for _ in range(3)]
    at = now_ms()
    ledger = Ledger(tmp_path)
    assert ledger.limit_problem(keys[0], "github:alice", 2, at) is None
    ledger.record(keys[0], "github:alice", at + 60_000, at)
    ledger.record(keys[1], "github:alice", at + 120_000, at)
    ledger.close()
    ledger = Ledger(tmp_path)  # a restarted issuer
    problem = ledger.limit_problem(keys[2], "github:alice", 2, at)
    assert problem is not None and "already holds certificates for 2 node keys" in problem
    assert ledger.limit_problem(keys[0], "github:alice", 2, at) is None  # a renewal
    assert ledger.limit_problem(keys[2], "github:alice", 2, at + 61_000) is None  # one expired
    taken = ledger.limit_problem(keys[0], "github:mallory", 2, at)
    assert taken is not None and "certified for another person" in taken
    ledger.revoke(keys[1])
    assert ledger.limit_problem(keys[2], "github:alice", 2, at) is None
    revoked = ledger.limit_problem(keys[1], "github:alice", 2, at)
    assert revoked is not None and "was revoked" in revoked
    ledger.close()


def test_a_signed_request_is_bound_to_its_key_path_and_time() -> None:
    node = Identity.generate()
    body, headers = sign(node, "/renew", {"certificate": "00"})
    key, fields = open_request("/renew", body, headers[SIGNATURE_HEADER])
    assert key == node.public_key and fields["certificate"] == "00"
    with pytest.raises(ValueError, match="not the key's"):
        open_request("/sign-in", body, headers[SIGNATURE_HEADER])
    stale = json.loads(body)
    stale["at_ms"] -= 600_000
    stale_body = json.dumps(stale, sort_keys=True).encode()
    signature = node.sign(b"p2ptrain issuer request v1\n/renew\n" + stale_body).hex()
    with pytest.raises(ValueError, match="clock"):
        open_request("/renew", stale_body, signature)
    with pytest.raises(ValueError, match="not a signed issuer request"):
        open_request("/renew", b"{}", "00")


def test_the_configuration_file_builds_the_policy_and_connectors(tmp_path: Path) -> None:
    (tmp_path / "gh.secret").write_text("s3cret\n")
    config = tmp_path / "issuer.toml"
    config.write_text(
        'lifetime = "12h"\nroles = ["trainer"]\nmax_keys_per_subject = 3\n'
        'allow_groups = ["lab"]\n\n'
        '[[connectors]]\nkind = "oidc"\nname = "idp"\nissuer = "https://idp.example/"\n'
        'client_id = "p2ptrain"\n\n'
        '[[connectors]]\nkind = "github"\nclient_id = "Iv1"\nclient_secret_file = "gh.secret"\n\n'
        '[[connectors]]\nkind = "trusted-ingress"\nname = "proxy"\nproxies = ["10.0.0.2"]\n'
    )
    policy, connectors = load_config(config)
    assert policy.lifetime_s == 12 * 3600 and policy.roles == ("trainer",)
    assert policy.max_keys_per_subject == 3 and policy.allow_groups == {"lab"}
    oidc, github, proxy = connectors
    assert isinstance(oidc, OidcConnector) and oidc.issuer == "https://idp.example"
    assert isinstance(github, GitHubConnector) and github.client_secret == "s3cret"
    assert github.userinfo_url == "https://api.github.com/user"
    assert isinstance(proxy, TrustedIngress) and proxy.proxies == {"10.0.0.2"}
    config.write_text('[[connectors]]\nkind = "saml"\n')
    with pytest.raises(LocalError, match=r"connectors\[0\].kind 'saml': choose from oidc"):
        load_config(config)
    config.write_text('[[connectors]]\nkind = "oidc"\nclient_id = "x"\n')
    with pytest.raises(LocalError, match=r"connector .oidc. \(oidc\): .*issuer"):
        load_config(config)
    config.write_text('max_keys = 3\n[[connectors]]\nkind = "github"\nclient_id = "x"\n')
    with pytest.raises(LocalError, match="unknown settings max_keys"):
        load_config(config)
    config.write_text('[[connectors]]\nkind = "trusted-ingress"\n')
    with pytest.raises(LocalError, match="give the proxies' addresses"):
        load_config(config)


def test_trusted_ingress_believes_the_header_only_from_its_proxies() -> None:
    ingress = TrustedIngress("proxy", header="X-Forwarded-User", proxies=frozenset({"10.0.0.2"}))
    headers = {"X-Forwarded-User": "alice"}
    assert ingress.from_ingress("10.0.0.2", headers) == Proven("ingress:alice")
    with pytest.raises(SignInRefused, match=r"came from 10\.0\.0\.9, not through the"):
        ingress.from_ingress("10.0.0.9", headers)
    with pytest.raises(SignInRefused, match="no X-Forwarded-User header"):
        ingress.from_ingress("10.0.0.2", {})


def test_the_service_signs_in_through_a_proxy_renews_and_refuses(tmp_path: Path) -> None:
    asyncio.run(_through_a_proxy(tmp_path))


async def _through_a_proxy(tmp_path: Path) -> None:
    issuer, node = Identity.generate(), Identity.generate()
    ingress = TrustedIngress("proxy", header="X-User", proxies=frozenset({"127.0.0.1"}))
    ledger = Ledger(tmp_path)
    service = IssuerService(
        issuer, NETWORK, [ingress], Policy(lifetime_s=60, roles=("trainer",)), ledger
    )
    async with TestClient(TestServer(service.app())) as client:
        service.public_url = str(client.make_url("")).rstrip("/")
        info = await (await client.get("/")).json()
        assert info["network_id"] == NETWORK and info["connectors"][0]["kind"] == "trusted-ingress"
        body, headers = sign(node, "/sign-in", {})
        opened = await (await client.post("/sign-in", data=body, headers=headers)).json()
        session = opened["session"]
        refused = await client.get(f"/sign-in/{session}")  # no header
        assert refused.status == 403 and "no X-User header" in await refused.text()
        page = await client.get(f"/sign-in/{session}", headers={"X-User": "alice"})
        assert page.status == 200 and "Signed in as ingress:alice" in await page.text()
        result = await (await client.get(f"/sign-in/{session}/result")).json()
        assert result["status"] == "issued" and result["subject"] == "ingress:alice"
        signed = open_envelope(bytes.fromhex(result["certificate"]), AdmissionCertificate)
        assert signed.record.subject == node.public_key and signed.record.roles == ("trainer",)
        assert signed.record.name == "ingress:alice" and signed.record.not_after_ms > now_ms()

        body, headers = sign(node, "/renew", {"certificate": result["certificate"]})
        renewed = await client.post("/renew", data=body, headers=headers)
        assert renewed.status == 200, await renewed.text()
        stranger = Identity.generate()
        body, headers = sign(stranger, "/renew", {"certificate": result["certificate"]})
        wrong = await client.post("/renew", data=body, headers=headers)
        assert (
            wrong.status == 403
            and "not this issuer's certificate for this key" in (await wrong.json())["error"]
        )
        other = issue_certificate(Identity.generate(), NETWORK, node.public_key)
        body, headers = sign(node, "/renew", {"certificate": other.envelope.encode().hex()})
        assert (await client.post("/renew", data=body, headers=headers)).status == 403
        forged = await client.post("/renew", data=body, headers={SIGNATURE_HEADER: "00" * 64})
        assert forged.status == 400
        unknown = await client.get("/sign-in/nothing/result")
        assert unknown.status == 404
    ledger.close()


def test_durations_read_the_same_in_the_config_and_on_the_command_line() -> None:
    from p2ptrain.cli.admission_commands import parse_expiry
    from p2ptrain.issuer.config import parse_duration_s

    assert parse_duration_s("90d", "lifetime") == 90 * 86400
    assert parse_duration_s("1.5h", "lifetime") == 5400
    assert parse_expiry("never", 1000) == 0 and parse_expiry("30m", 1000) == 1000 + 1_800_000
    with pytest.raises(LocalError, match=r"--expires .3 weeks.: use a duration .*, or never"):
        parse_expiry("3 weeks", 0)
    with pytest.raises(LocalError, match="lifetime '0s': use a duration"):
        parse_duration_s("0s", "lifetime")
