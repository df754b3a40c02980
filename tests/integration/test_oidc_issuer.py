"""People sign in at a real OpenID provider, their trainers get certificates and train.

One network for the module: a seed created with ``--admission certificate`` naming two
issuers (its own key, which admits the validator with ``p2ptrain admit``, and the issuing
service's), a validator, and ``p2ptrain issuer`` in front of panva's ``oidc-provider`` on
loopback (``make test`` installs it; skipped without it). Its policy: certificates for
trainers, valid 30 s, one key per person, an allow-list of alice and bob. The tests check:

1. alice signs in through a browser (authorization code with PKCE) and bob with the device
   flow (a code entered at the provider's page), each with ``p2ptrain sign-in``; their
   trainers start on their data directories alone and train, their certificates carrying
   ``oidc:ISSUER#alice`` and ``oidc:ISSUER#bob``;
2. alice with a second key is over her limit, and mallory is not on the allow-list: each
   sign-in fails with the reason, and no certificate is kept;
3. the 30 s certificates are renewed before they expire: after the first one's expiry the
   trainers still hold a valid certificate and their updates are still certified.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from p2ptrain.core.admission import CERTIFICATE_FILE, read_certificate
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.net.client import fetch_network_manifest
from tests.support.local_net import Net, new_net
from tests.support.oidc import (
    NATIVE_CLIENT,
    OidcProvider,
    enter_device_code,
    log_in,
    provider_unavailable,
)

pytestmark = pytest.mark.integration

DEADLINE_S = 5.0
WAIT_S = 120.0
LIFETIME_S = 30


class Issuer:
    def __init__(self, process: subprocess.Popen[str], url: str, provider: str) -> None:
        self.process, self.url, self.provider = process, url, provider

    def subject(self, login: str) -> str:
        return f"oidc:{self.provider}#{login}"


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    reason = provider_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with OidcProvider(tmp_path_factory.mktemp("oidc") / "provider.log") as provider:
        yield provider


def _network_id(net: Net) -> str:
    assert net.network.seed is not None and net.network.seed.address is not None
    raw = asyncio.run(fetch_network_manifest(net.network.seed.address))
    return open_envelope(raw, NetworkManifest).record.id


def _start_issuer(net: Net, provider: OidcProvider) -> Issuer:
    config = net.workdir / "issuer.toml"
    config.write_text(
        f'lifetime = "{LIFETIME_S}s"\nroles = ["trainer"]\nmax_keys_per_subject = 1\n'
        f'allow = ["oidc:{provider.issuer}#alice", "oidc:{provider.issuer}#bob"]\n\n'
        f'[[connectors]]\nkind = "oidc"\nname = "loopback"\nissuer = "{provider.issuer}"\n'
        f'client_id = "{NATIVE_CLIENT}"\n'
    )
    process = subprocess.Popen(
        [
            sys.executable, "-m", "p2ptrain", "issuer", "--dir", str(net.data_dir("issuer")),
            "--config", str(config), "--network", _network_id(net), "--listen", "127.0.0.1:0",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=(net.workdir / "issuer.log").open("w"),
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(10)
        raise AssertionError(
            f"the issuer did not start: {(net.workdir / 'issuer.log').read_text()}"
        )
    ready = json.loads(line)
    assert ready["event"] == "issuer-ready", ready
    return Issuer(process, ready["url"], provider.issuer)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory, provider: OidcProvider) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("oidc-network"))
    issuer: Issuer | None = None
    try:
        path = net.write_experiment(
            validators=["validator-0"], quorum=1, max_updates=2, deadline_s=DEADLINE_S
        )
        issuer_key = net.network.identity("issuer")
        net.start(
            "seed", "seed",
            args=[
                "--experiment-toml", str(path), "--admission", "certificate",
                "--issuer", net.network.identity("seed"), "--issuer", issuer_key,
            ],
        )  # fmt: skip
        net.wait_ready(["seed"])
        certificate = net.workdir / "validator-0.cert"
        admitted = subprocess.run(
            [
                sys.executable, "-m", "p2ptrain", "admit", net.network.identity("validator-0"),
                "--dir", str(net.data_dir("seed")), "--roles", "validator",
                "--out", str(certificate),
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert admitted.returncode == 0, admitted.stderr
        net.start("validator-0", "validator", args=["--certificate", str(certificate)])
        net.wait_ready(["validator-0"])
        issuer = _start_issuer(net, provider)
        net.issuer = issuer  # type: ignore[attr-defined]
        yield net
    finally:
        if issuer is not None:
            issuer.process.terminate()
            issuer.process.wait(10)
        net.close()


def _issuer(net: Net) -> Issuer:
    issuer: Issuer = net.issuer  # type: ignore[attr-defined]
    return issuer


def sign_in(net: Net, name: str, login: str, *, device: bool = False) -> tuple[int, list[Any], str]:
    """``p2ptrain sign-in`` for ``name``'s key, the person signing in as ``login``: its exit
    code, its events and its error output."""
    net.network.identity(name)  # the key, made now
    command = [
        sys.executable, "-m", "p2ptrain", "sign-in", _issuer(net).url,
        "--dir", str(net.data_dir(name)), "--json", "--timeout", "60",
    ]  # fmt: skip
    if device:
        command.append("--device")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    first = json.loads(process.stdout.readline() or "{}")
    if first.get("event") == "sign-in":
        asyncio.run(log_in(first["url"], login))
    elif first.get("event") == "device-code":
        asyncio.run(enter_device_code(first["verification_uri_complete"], login))
    out, err = process.communicate(timeout=60)
    events = [first, *(json.loads(line) for line in out.splitlines() if line.strip())]
    return process.returncode, events, err


def _accepted(net: Net, name: str, after: int = 0) -> list[int]:
    return [
        e["height"] for e in net.events("adopted", name)
        if e.get("update") == "accepted" and e["height"] > after
    ]  # fmt: skip


def test_people_sign_in_with_a_browser_or_a_device_and_their_trainers_train(net: Net) -> None:
    issuer = _issuer(net)
    code, events, err = sign_in(net, "trainer-alice", "alice")
    assert code == 0, err
    assert events[0]["event"] == "sign-in" and events[-1]["event"] == "signed-in", events
    assert events[-1]["subject"] == issuer.subject("alice")
    code, events, err = sign_in(net, "trainer-bob", "bob", device=True)
    assert code == 0, err
    assert events[0]["event"] == "device-code" and events[0]["user_code"], events
    assert events[-1]["subject"] == issuer.subject("bob")
    for name in ("trainer-alice", "trainer-bob"):
        certificate = read_certificate(net.data_dir(name) / CERTIFICATE_FILE).record
        assert certificate.roles == ("trainer",)
        net.start(name, "trainer")  # no --certificate: the one sign-in kept
    net.wait_ready(["trainer-alice", "trainer-bob"])
    net.wait(
        "a head holding each signed-in trainer's update",
        WAIT_S,
        lambda: all(_accepted(net, t) for t in ("trainer-alice", "trainer-bob")),
    )
    for name, login in (("trainer-alice", "alice"), ("trainer-bob", "bob")):
        net.wait_until(f"{name}'s status", WAIT_S, (net.data_dir(name) / "status.json").exists)
        admission = net.status(name)["admission"]
        assert admission["name"] == issuer.subject(login) and admission["renews_at"] == issuer.url


def test_over_the_key_limit_or_off_the_allow_list_is_refused_with_the_reason(net: Net) -> None:
    code, _, err = sign_in(net, "alice-second-key", "alice")
    assert code != 0
    assert f"{_issuer(net).subject('alice')} already holds a certificate for 1 node key" in err, err
    assert "the most this network allows one person" in err
    code, _, err = sign_in(net, "mallory", "mallory", device=True)
    assert code != 0
    assert "is not on this network's allow-list" in err, err
    for name in ("alice-second-key", "mallory"):
        assert not (net.data_dir(name) / CERTIFICATE_FILE).exists()


def test_certificates_are_renewed_before_they_expire_and_training_goes_on(net: Net) -> None:
    first = read_certificate(net.data_dir("trainer-alice") / "admission.cert").record
    if not first.not_after_ms:
        pytest.fail("the issuer's certificates should expire")
    expiry = first.not_after_ms / 1000
    net.wait_until(
        "the first certificate's expiry",
        LIFETIME_S + 10,
        lambda: time.time() > expiry + 1,
    )
    heights = {
        name: max(_accepted(net, name), default=0) for name in ("trainer-alice", "trainer-bob")
    }
    net.wait(
        "a head holding each trainer's update after its first certificate expired",
        WAIT_S,
        lambda: all(_accepted(net, name, heights[name]) for name in heights),
    )
    for name in heights:
        admission = net.status(name)["admission"]
        assert admission["renewed"] >= 1 and admission["renewal_problem"] == "", admission
        assert admission["not_after_ms"] > first.not_after_ms
    assert "trainer-alice" not in net.exited and "trainer-bob" not in net.exited
