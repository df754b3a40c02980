"""One-command join: a newcomer with nothing but an invite trains in a certificate network.

One network for the module: a seed created with ``--admission certificate`` naming its own
key and an issuing service's as issuers, a validator admitted with ``p2ptrain admit``, and
``p2ptrain issuer`` (a trusted-ingress connector: the invites here grant admission, nobody
signs in). The tests check that:

1. ``p2ptrain join INVITE --dir D`` alone (an empty D) creates the key, redeems the invite's
   one-key grant, and trains: its updates are certified, its certificate says
   ``invite:NAME``; started again on D with the same invite, it redeems nothing again;
2. the same invite for a second key is refused as used up, an expired invite is refused
   with its expiry, a damaged one is refused as damaged, and an invite whose bootstraps do
   not answer names them; each exits non-zero with the reason, before training.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from p2ptrain.cli.main import main
from p2ptrain.core.admission import CERTIFICATE_FILE, read_certificate
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.issuer.invite import read_invite
from p2ptrain.net.client import fetch_network_manifest
from tests.support.local_net import Net, new_net

pytestmark = pytest.mark.integration

DEADLINE_S = 5.0
WAIT_S = 120.0


def p2ptrain(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("invite-network"))
    issuer: subprocess.Popen[str] | None = None
    try:
        path = net.write_experiment(
            validators=["validator-0"], quorum=1, max_updates=2, deadline_s=DEADLINE_S
        )
        net.start(
            "seed", "seed",
            args=[
                "--experiment-toml", str(path), "--admission", "certificate",
                "--issuer", net.network.identity("seed"),
                "--issuer", net.network.identity("issuer"),
            ],
        )  # fmt: skip
        net.wait_ready(["seed"])
        certificate = net.workdir / "validator-0.cert"
        admitted = p2ptrain(
            "admit", net.network.identity("validator-0"), "--dir", str(net.data_dir("seed")),
            "--roles", "validator", "--out", str(certificate),
        )  # fmt: skip
        assert admitted.returncode == 0, admitted.stderr
        net.start("validator-0", "validator", args=["--certificate", str(certificate)])
        net.wait_ready(["validator-0"])
        assert net.network.seed is not None and net.network.seed.address is not None
        raw = asyncio.run(fetch_network_manifest(net.network.seed.address))
        net.network_id = open_envelope(raw, NetworkManifest).record.id  # type: ignore[attr-defined]
        config = net.workdir / "issuer.toml"
        config.write_text(
            '[[connectors]]\nkind = "trusted-ingress"\nname = "proxy"\nproxies = ["127.0.0.9"]\n'
        )
        issuer = subprocess.Popen(
            [
                sys.executable, "-m", "p2ptrain", "issuer", "--dir", str(net.data_dir("issuer")),
                "--config", str(config), "--listen", "127.0.0.1:0", "--json",
                "--network", net.network_id,  # type: ignore[attr-defined]
            ],
            stdout=subprocess.PIPE,
            stderr=(net.workdir / "issuer.log").open("w"),
            text=True,
        )  # fmt: skip
        assert issuer.stdout is not None
        ready = json.loads(issuer.stdout.readline() or "{}")
        assert ready.get("event") == "issuer-ready", (net.workdir / "issuer.log").read_text()
        net.issuer_url = ready["url"]  # type: ignore[attr-defined]
        yield net
    finally:
        if issuer is not None:
            issuer.terminate()
            issuer.wait(10)
        net.close()


def in_process(*args: str) -> tuple[int, str, str]:
    """``p2ptrain ARGS`` run in this process (no interpreter to start): its exit code,
    standard output and error output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def _invite(net: Net, *options: str, bootstrap: str | None = None) -> str:
    assert net.network.seed is not None and net.network.seed.address is not None
    code, out, err = in_process(
        "invite", "--dir", str(net.data_dir("issuer")),
        "--issuer-url", net.issuer_url,  # type: ignore[attr-defined]
        "--bootstrap", bootstrap or net.network.seed.address,
        "--experiment", str(net.network.experiment_id),
        "--network", net.network_id,  # type: ignore[attr-defined]
        *options,
    )  # fmt: skip
    assert code == 0, err
    return out.strip()


def _join(net: Net, name: str, invite: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "p2ptrain", "join", invite, "--dir", str(net.data_dir(name)),
            "--json", "--windows", "1",
        ],
        stdout=subprocess.PIPE,
        stderr=(net.workdir / f"{name}.log").open("a"),
        text=True,
    )  # fmt: skip


def _accepted_in(process: subprocess.Popen[str], deadline: float) -> list[dict[str, object]]:
    """The join's events until it ends (it trains 1 window, then stops)."""
    assert process.stdout is not None
    events = []
    for line in process.stdout:
        if line.startswith("{"):
            events.append(json.loads(line))
        if time.monotonic() > deadline:
            process.kill()
            break
    process.wait(30)
    return events


def test_a_newcomer_joins_with_the_invite_alone_and_trains(net: Net) -> None:
    invite = _invite(net, "--uses", "1", "--expires", "10m", "--name", "newcomer")
    joined = _join(net, "newcomer", invite)
    events = _accepted_in(joined, time.monotonic() + WAIT_S)
    log = (net.workdir / "newcomer.log").read_text()
    assert joined.returncode == 0, log[-2000:]
    admitted = [e for e in events if e.get("event") == "admitted"]
    assert admitted and admitted[0]["subject"] == "invite:newcomer", events[:3]
    accepted = [e for e in events if e.get("event") == "adopted" and e.get("update") == "accepted"]
    assert accepted, f"no head held the newcomer's update: {events[-5:]}"
    certificate = read_certificate(net.data_dir("newcomer") / CERTIFICATE_FILE).record
    assert certificate.name == "invite:newcomer" and certificate.roles == ("trainer",)
    # again on the same directory: the kept certificate, no second use of the invite
    again = _join(net, "newcomer", invite)
    assert again.stdout is not None
    before_ready = []
    for line in again.stdout:
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") == "ready":
            break
        before_ready.append(event)
    again.send_signal(signal.SIGINT)
    again.wait(60)
    assert again.returncode == 0, (net.workdir / "newcomer.log").read_text()[-2000:]
    assert not [e for e in before_ready if e.get("event") == "admitted"], before_ready
    net.invite = invite  # type: ignore[attr-defined]


def test_used_up_expired_damaged_and_unreachable_invites_are_refused(net: Net) -> None:
    used: str = net.invite  # type: ignore[attr-defined]
    code, _, err = in_process("join", used, "--dir", str(net.data_dir("second")))
    assert code != 0
    assert "this invite was used up: it admits 1 key, and all were admitted" in err
    expired = _invite(net, "--expires", "1s")
    expiry = read_invite(expired).expires_ms / 1000
    net.wait_until("the invite's expiry", 10, lambda: time.time() > expiry)
    code, _, err = in_process("join", expired, "--dir", str(net.data_dir("late")))
    assert code != 0 and "this invite expired at" in err, err
    code, _, err = in_process("join", used[:-6] + "AAAAAA", "--dir", str(net.data_dir("late")))
    assert code != 0 and "signature does not verify" in err, err
    nowhere = _invite(net, bootstrap="http://127.0.0.1:9")
    code, _, err = in_process("join", nowhere, "--dir", str(net.data_dir("late")))
    assert code != 0
    assert "none of the invite's bootstraps answered: http://127.0.0.1:9" in err, err
    for name in ("second", "late"):
        assert not (net.data_dir(name) / CERTIFICATE_FILE).exists()
