"""A network created with certificate admission, and TLS, from the command line.

One network for the module: a seed started with ``--admission certificate --tls`` (its own
key issues), a validator (q = 1, ``--tls``) and two trainers, each admitted with
``p2ptrain admit`` and started with ``--certificate``. The tests check that:

1. the admitted peers train together; a node without a certificate is refused before it
   asks anyone, and a certificate signed by a key that is not an issuer is refused at the
   seed's door;
2. the seed serves over TLS, its fingerprint pinned in its address, and a wrong pin is
   refused;
3. ``p2ptrain revoke`` cuts a trainer off within 5 s: it is refused at the door, stops with
   the reason, and no head after that holds its update; a node that joins later learns the
   revocation, and a restarted node keeps it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.core.records import Revocation
from p2ptrain.errors import TransportError
from p2ptrain.net.auth import ClientCredentials
from p2ptrain.net.client import PeerClient, Refused, fetch_network_manifest
from p2ptrain.node.admission import CERTIFICATE_FILE, issue_certificate, read_certificate
from p2ptrain.store.keyfile import load_identity
from tests.support.local_net import Net, new_net, stored_records

pytestmark = pytest.mark.integration

DEADLINE_S = 5.0
WAIT_S = 120.0
CUT_OFF_S = 5.0


def p2ptrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _admit(net: Net, name: str, roles: str) -> Path:
    out = net.workdir / f"{name}.cert"
    key = net.network.identity(name)
    admitted = p2ptrain(
        "admit", key, "--dir", str(net.data_dir("seed")), "--roles", roles,
        "--name", f"test:{name}", "--out", str(out),
    )  # fmt: skip
    assert admitted.returncode == 0, admitted.stderr
    return out


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("certificate-network"))
    try:
        path = net.write_experiment(
            validators=["validator-0"], quorum=1, max_updates=2, deadline_s=DEADLINE_S
        )
        net.start(
            "seed", "seed",
            args=["--experiment-toml", str(path), "--admission", "certificate", "--tls"],
        )  # fmt: skip
        net.wait_ready(["seed"])
        net.start(
            "validator-0", "validator",
            args=["--certificate", str(_admit(net, "validator-0", "validator")), "--tls"],
        )  # fmt: skip
        for name in ("trainer-0", "trainer-1"):
            net.start(name, "trainer", args=["--certificate", str(_admit(net, name, "trainer"))])
        net.wait_ready(["validator-0", "trainer-0", "trainer-1"])
        yield net
    finally:
        net.close()


def _accepted(net: Net, name: str, after: int = 0) -> list[int]:
    return [
        e["height"] for e in net.events("adopted", name)
        if e.get("update") == "accepted" and e["height"] > after
    ]  # fmt: skip


def _network(net: Net) -> NetworkManifest:
    address = net.network.seed.address if net.network.seed else None
    assert address is not None
    return open_envelope(asyncio.run(fetch_network_manifest(address)), NetworkManifest).record


async def _ask(net: Net, credentials: ClientCredentials) -> None:
    """One request to the seed with ``credentials`` (raises what the door says)."""
    assert net.network.seed is not None and net.network.seed.address is not None
    client = PeerClient(credentials)
    try:
        await client.peer_records(net.network.seed.address)
    finally:
        await client.close()


def test_admitted_peers_train_and_others_are_refused(net: Net) -> None:
    net.wait(
        "two heads holding each admitted trainer's update",
        WAIT_S,
        lambda: all(len(_accepted(net, t)) >= 2 for t in ("trainer-0", "trainer-1")),
    )
    net.start("stranger", "trainer")
    net.killed.add("stranger")  # it is meant to end by itself; its exit is checked
    net.wait("the stranger to give up", WAIT_S, lambda: "stranger" in net.exited)
    codes = [e["returncode"] for e in net.events("exited", "stranger")]
    net.check(codes == [2], f"the stranger exits with a usage error: {codes}")
    said = "\n".join(net.log("stranger"))
    net.check(
        "admits only peers with a certificate" in said and "p2ptrain admit" in said,
        f"a node without a certificate is told how to get one: {said[-600:]}",
    )
    network = _network(net)
    forger, someone = Identity.generate(), Identity.generate()
    forged = issue_certificate(forger, network.id, someone.public_key)
    credentials = ClientCredentials(network, someone, secret=None, admission=forged)
    with pytest.raises(Refused, match="not an issuer"):
        asyncio.run(_ask(net, credentials))


def test_the_seed_serves_tls_with_its_pin_and_refuses_a_wrong_one(net: Net) -> None:
    assert net.network.seed is not None and net.network.seed.address is not None
    address = net.network.seed.address
    assert address.startswith("https://") and "#sha256=" in address, address
    wrong = address.split("#")[0] + "#sha256=" + "0" * 64
    with pytest.raises(TransportError, match=r"(?i)fingerprint"):
        asyncio.run(fetch_network_manifest(wrong))


def test_a_revoked_trainer_is_cut_off_within_5_s(net: Net) -> None:
    revoked = load_identity(net.data_dir("trainer-1"))
    assert net.network.seed is not None and net.network.seed.address is not None
    started = time.monotonic()
    result = p2ptrain(
        "revoke", revoked.public_key.hex(), "--dir", str(net.data_dir("seed")),
        "--bootstrap", net.network.seed.address, "--reason", "left the study",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    net.wait(
        "the revoked trainer to stop",
        CUT_OFF_S + (time.monotonic() - started),
        lambda: "trainer-1" in net.exited,
    )
    said = "\n".join(net.log("trainer-1"))
    net.check("revoked" in said and "left the study" in said, f"it says why: {said[-600:]}")
    # refused at the door, with its own still valid certificate
    kept = read_certificate(net.data_dir("trainer-1") / CERTIFICATE_FILE)
    credentials = ClientCredentials(_network(net), revoked, secret=None, admission=kept)
    with pytest.raises(Refused, match="revoked"):
        asyncio.run(_ask(net, credentials))
    # the heads after it hold trainer-0's update and never trainer-1's
    height = net.stopped["trainer-1"]
    net.wait(
        "two more heads holding trainer-0's update",
        WAIT_S,
        lambda: len(_accepted(net, "trainer-0", after=height + 1)) >= 2,
    )
    late = [e for e in net.events("adopted", "validator-0") if e["height"] > height + 1]
    net.check(all(e["accepted"] == 1 for e in late), f"one update per head now: {late}")
    # a node that joins now learns the revocation from the peers it connects to
    net.start(
        "trainer-2", "trainer", args=["--certificate", str(_admit(net, "trainer-2", "trainer"))]
    )
    net.wait_ready(["trainer-2"])
    net.wait(
        "trainer-2 to keep the revocation",
        WAIT_S,
        lambda: bool(stored_records(net.data_dir("trainer-2"), "revocation", Revocation)),
    )

    # its status names its certificate, and the peer it refuses and why
    def revoked_in_status() -> bool:
        try:
            status = net.status("trainer-0")
        except (OSError, ValueError):  # not written yet, or being written
            return False
        return [r["reason"] for r in status.get("revoked", [])] == ["left the study"]

    net.wait("trainer-0's status to list the revoked peer", WAIT_S, revoked_in_status)
    admission = net.status("trainer-0")["admission"]
    net.check(
        admission["name"] == "test:trainer-0" and admission["roles"] == ["trainer"],
        f"trainer-0's status shows its certificate: {admission}",
    )

    # the dashboard's peer graph draws the revoked peer, crossed, with the name its
    # certificate gave at the seed's door
    def revoked_on_the_graph() -> list[dict[str, object]]:
        peers = json.loads((net.data_dir("seed") / "peers.json").read_text())
        return [p for p in peers if p["peer_id"] == revoked.peer_id and p.get("revoked")]

    net.wait("the revoked peer on the seed's graph", WAIT_S, lambda: bool(revoked_on_the_graph()))
    net.check(
        revoked_on_the_graph()[0]["subject"] == "test:trainer-1",
        f"the graph names the revoked peer's subject: {revoked_on_the_graph()}",
    )
    # a restarted node cuts the revoked peer off again from what it kept
    cut_before = sum("admission revoked" in line for line in net.log("trainer-0"))
    net.stop(["trainer-0"])
    net.restart("trainer-0")
    net.wait(
        "the restarted trainer-0 to apply the revocation it kept",
        WAIT_S,
        lambda: sum("admission revoked" in line for line in net.log("trainer-0")) > cut_before,
    )
