"""``p2ptrain issuer`` and ``p2ptrain sign-in``: people sign in, their nodes get
certificates.

``issuer --dir D --config F`` runs the issuing service with the key in ``D`` (one of the
network's issuers: the seed names it with ``--issuer KEY``), the policy and connectors in
``F`` (:mod:`p2ptrain.issuer.config`). ``sign-in URL --dir D`` signs the node key in ``D``
in at the issuer at ``URL`` (through a browser link, or ``--device`` for a code entered on
any other device), keeps the certificate and the issuer's address in ``D``; the node started
on ``D`` then needs no ``--certificate``, and renews it before it expires.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from p2ptrain.cli.commands import add_command
from p2ptrain.errors import LocalError

__all__ = ["add_parsers"]


def add_parsers(commands: Any, data_dir: str) -> None:
    issuer = add_command(
        commands,
        "issuer",
        description="Run the issuing service of a certificate network: a person signs in "
        "(OpenID Connect, OAuth 2, GitHub, or a trusted proxy) and their node key receives a "
        "certificate carrying who they are, within the allow-list and the keys-per-person "
        "limit of the configuration file. The key in --dir must be an issuer of the network "
        "(start the seed with --issuer KEY).",
        epilog="The configuration file:\n\n" + _config_doc(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    issuer.add_argument("--dir", default=data_dir, help="the issuer's data directory (its key)")
    issuer.add_argument("--config", required=True, help="the policy and connectors (TOML)")
    issuer.add_argument(
        "--network",
        help="the network id (default: the network of the node in --dir, e.g. the seed's)",
    )
    issuer.add_argument(
        "--listen",
        default="127.0.0.1:8460",
        help="HOST:PORT to serve on (default 127.0.0.1:8460; port 0: any free port)",
    )
    issuer.add_argument(
        "--public-url",
        default="",
        help="the address people and providers reach the service at (default: the listening "
        "address); the providers' redirect URI is PUBLIC_URL/callback",
    )
    issuer.add_argument("--json", action="store_true", help="print events as JSON lines")
    issuer.set_defaults(handler=run_issuer)

    sign_in = add_command(
        commands,
        "sign-in",
        description="Sign in at a certificate network's issuer: its certificate for this "
        "node's key (created in --dir if there is none) is kept in --dir, and the node renews "
        "it there before it expires.",
    )
    sign_in.add_argument("url", metavar="ISSUER_URL", help="the issuer's address")
    sign_in.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    sign_in.add_argument("--connector", help="how to sign in (default: the issuer's first)")
    sign_in.add_argument(
        "--device",
        action="store_true",
        help="the device flow: enter a code on any device's browser (for a headless machine)",
    )
    sign_in.add_argument(
        "--timeout", type=float, default=600.0, help="how long to wait, seconds (default 600)"
    )
    sign_in.add_argument("--json", action="store_true", help="print events as JSON lines")
    sign_in.set_defaults(handler=run_sign_in)

    invite = add_command(
        commands,
        "invite",
        description="Print an invite to a certificate network (an issuer's command): one line "
        "that `p2ptrain join` turns into a trainer, carrying the experiment, the bootstraps, "
        "the roles, an expiry and either an admission grant for --uses keys (redeemed at the "
        "issuing service) or, with --sign-in, the issuer's sign-in.",
    )
    invite.add_argument("--dir", default=data_dir, help="the issuer's data directory (its key)")
    invite.add_argument(
        "--issuer-url", required=True, help="the issuing service's address (p2ptrain issuer)"
    )
    invite.add_argument(
        "--bootstrap",
        action="append",
        required=True,
        metavar="URL",
        help="a node of the network the joiner dials (repeatable; give TLS pins)",
    )
    invite.add_argument(
        "--experiment", help="the experiment id (default: the node's in --dir, e.g. the seed's)"
    )
    invite.add_argument("--network", help="the network id (default: the node's in --dir)")
    invite.add_argument("--roles", default="trainer", help="the roles admitted (default trainer)")
    invite.add_argument(
        "--expires", default="7d", help="how long the invite can be used: 7d, 12h, 30m (default 7d)"
    )
    invite.add_argument(
        "--uses", type=int, default=1, help="how many keys the grant admits (default 1)"
    )
    invite.add_argument(
        "--sign-in",
        action="store_true",
        help="the joiner signs in at the issuer instead of being admitted by the invite",
    )
    invite.add_argument("--name", default="", help="who it is for (certificates say invite:NAME)")
    invite.set_defaults(handler=run_invite)

    join = add_command(
        commands,
        "join",
        description="Join a certificate network with an invite and train: creates this "
        "node's key in --dir, gets its certificate (the invite's grant, or a sign-in), checks "
        "the network, and starts `p2ptrain train` on the invite's experiment.",
    )
    join.add_argument("invite", metavar="INVITE", help="the line `p2ptrain invite` printed")
    join.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    join.add_argument("--workload", help="the workload reference, for a workload of your own")
    join.add_argument("--data", help="the prepared data, where the workload needs it")
    join.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the best there is)")
    join.add_argument("--windows", type=int, help="train this many windows, then stop")
    join.add_argument("--listen", help="HOST:PORT to serve on (default: outbound only)")
    join.add_argument("--threads", type=int, help="torch threads (default 1)")
    join.add_argument(
        "--device-flow",
        action="store_true",
        help="with a sign-in invite: sign in with a code on another device",
    )
    join.add_argument("--json", action="store_true", help="print events as JSON lines")
    join.set_defaults(handler=run_join)


def _config_doc() -> str:
    from p2ptrain.issuer import config

    doc = config.__doc__ or ""
    return doc[doc.index("::") + 3 :] if "::" in doc else doc


def _say(as_json: bool) -> Any:
    def say(event: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(event), flush=True)
            return
        kind = event["event"]
        if kind == "sign-in":
            text = (
                f"Open this link in a browser to sign in ({event['connector']}):\n  {event['url']}"
            )
        elif kind == "device-code":
            text = (
                f"On any device, open {event['verification_uri']} and enter the code "
                f"{event['user_code']}\n  (or open {event['verification_uri_complete']})"
            )
        elif kind == "issuer-ready":
            text = (
                f"issuer of network {event['network_id'][:16]} at {event['url']} (key "
                f"{event['issuer'][:16]}...; connectors: {', '.join(event['connectors'])}); "
                "Ctrl-C to stop"
            )
        elif kind == "signed-in":
            until = event["expires"] or "no expiry"
            text = (
                f"signed in as {event['subject']}: the certificate ({until}) is kept in "
                f"{event['dir']}; start the node with --dir {event['dir']}"
            )
        else:
            text = json.dumps(event)
        print(text, flush=True)

    return say


def _network_id(args: argparse.Namespace, identity: Any) -> str:
    from p2ptrain.cli.admission_commands import check_issuer, network_of

    network = network_of(args.dir)
    if network is None:
        if args.network is None:
            raise LocalError(
                f"{args.dir} holds no network: give --network ID (the seed's status shows it)"
            )
        return str(args.network)
    check_issuer(identity, network, args.dir)
    return network.id


def run_issuer(args: argparse.Namespace) -> int:
    import asyncio

    from p2ptrain.issuer.config import load_config
    from p2ptrain.issuer.policy import Ledger
    from p2ptrain.issuer.service import IssuerService, start_service
    from p2ptrain.store.keyfile import load_identity

    identity = load_identity(args.dir)
    network_id = _network_id(args, identity)
    policy, connectors = load_config(Path(args.config))
    say = _say(args.json)

    async def serve() -> int:
        import contextlib
        import signal

        ledger = Ledger(Path(args.dir))
        service = IssuerService(
            identity, network_id, connectors, policy, ledger, public_url=args.public_url
        )
        runner = await start_service(service, args.listen)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        say(
            {
                "event": "issuer-ready",
                "url": service.public_url,
                "network_id": network_id,
                "issuer": identity.public_key.hex(),
                "connectors": list(service.connectors),
            }
        )
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            ledger.close()
        return 0

    return asyncio.run(serve())


def run_sign_in(args: argparse.Namespace) -> int:
    import asyncio

    from p2ptrain.core.admission import when_text
    from p2ptrain.issuer.client import save, sign_in
    from p2ptrain.store.keyfile import create_identity, identity_path, load_identity

    data_dir = Path(args.dir)
    identity = (
        load_identity(data_dir) if identity_path(data_dir).exists() else create_identity(data_dir)
    )
    say = _say(args.json)
    signed_in = asyncio.run(
        sign_in(
            args.url,
            identity,
            connector=args.connector,
            device=args.device,
            say=say,
            timeout_s=args.timeout,
        )
    )
    save(data_dir, args.url, signed_in.certificate)
    expiry = signed_in.certificate.record.not_after_ms
    say(
        {
            "event": "signed-in",
            "subject": signed_in.subject,
            "peer_id": identity.peer_id,
            "expires": f"expires {when_text(expiry)}" if expiry else "",
            "not_after_ms": expiry,
            "dir": str(data_dir),
        }
    )
    return 0


def _node_experiment(data_dir: str) -> tuple[str, str] | None:
    """The network and experiment ids of the node in ``data_dir`` (None: none)."""
    if not (Path(data_dir) / "node.db").exists():
        return None
    from p2ptrain.core.envelope import open_envelope
    from p2ptrain.core.manifests import ExperimentManifest
    from p2ptrain.node.persist import NodeStore
    from p2ptrain.store.datadir import DataDir

    with DataDir(data_dir) as datadir:
        store = NodeStore(datadir)
        experiment_id = store.experiment_id()
        raw = None if experiment_id is None else store.record(experiment_id)
    if raw is None or experiment_id is None:
        return None
    return open_envelope(raw, ExperimentManifest).record.network_id, experiment_id


def run_invite(args: argparse.Namespace) -> int:
    from p2ptrain.cli.admission_commands import parse_expiry, parse_roles
    from p2ptrain.core.admission import now_ms
    from p2ptrain.issuer.invite import make_invite
    from p2ptrain.store.keyfile import load_identity

    identity = load_identity(args.dir)
    roles = parse_roles(args.roles)
    expires = parse_expiry(args.expires, now_ms())
    if args.uses < 1:
        raise LocalError(f"--uses {args.uses}: at least 1")
    known = None if args.network and args.experiment else _node_experiment(args.dir)
    network_id = args.network or (known[0] if known else None)
    experiment_id = args.experiment or (known[1] if known else None)
    if network_id is None or experiment_id is None:
        raise LocalError(
            f"{args.dir} holds no node: give --network ID and --experiment ID (the seed's "
            "status shows them)"
        )
    invite, text = make_invite(
        identity,
        network_id=network_id,
        experiment_id=experiment_id,
        bootstrap=args.bootstrap,
        roles=roles,
        issuer_url=args.issuer_url,
        mode="sign-in" if args.sign_in else "grant",
        uses=args.uses,
        expires_ms=expires,
        name=args.name,
    )
    how = "a sign-in at the issuer" if args.sign_in else f"a grant for {args.uses} key(s)"
    print(
        f"invite {invite.id} to experiment {experiment_id[:16]} ({', '.join(roles)}; {how}; "
        f"expires in {args.expires}); the newcomer runs: p2ptrain join INVITE",
        file=sys.stderr,
    )
    print(text, flush=True)
    return 0


async def _joined_network(invite: Any) -> Any:
    """The invite's network manifest, from the first of its bootstraps that answers."""
    from p2ptrain.core.envelope import open_envelope
    from p2ptrain.core.manifests import NetworkManifest
    from p2ptrain.errors import P2PTrainError
    from p2ptrain.net.client import fetch_network_manifest

    failures = []
    for address in invite.bootstrap:
        try:
            raw = await fetch_network_manifest(address, timeout_s=15)
            network = open_envelope(raw, NetworkManifest).record
        except P2PTrainError as exc:
            failures.append(f"{address} ({exc})")
            continue
        if network.id != invite.network_id:
            failures.append(f"{address} (it serves network {network.id[:16]}, not the invite's)")
            continue
        if invite.issuer not in network.issuer_keys:
            raise LocalError(
                f"the invite was signed by a key that is not an issuer of network "
                f"{network.name!r}: do not use it, and ask the network's operator"
            )
        return network
    raise LocalError(
        "none of the invite's bootstraps answered: " + "; ".join(failures) + "; the network "
        "may be down or unreachable from here: try again later, or ask for a new invite"
    )


def _kept_certificate(data_dir: Path, network: Any, identity: Any, roles: Any) -> Any:
    """The certificate kept in ``data_dir`` when it still admits this node to ``network``
    (a restarted join redeems nothing again)."""
    from p2ptrain.core.admission import (
        CERTIFICATE_FILE,
        certificate_problem,
        now_ms,
        read_certificate,
    )

    path = data_dir / CERTIFICATE_FILE
    if not path.exists():
        return None
    try:
        signed = read_certificate(path)
    except LocalError:
        return None
    problem = certificate_problem(signed.record, network, identity, roles, now_ms() + 60_000)
    return signed if problem is None else None


async def _redeem(invite: Any, identity: Any) -> Any:
    from p2ptrain.issuer.client import redeem

    return await redeem(invite.issuer_url, identity, invite)


def run_join(args: argparse.Namespace) -> int:
    import asyncio

    from p2ptrain.cli.main import main
    from p2ptrain.core.admission import now_ms
    from p2ptrain.issuer.client import save, sign_in
    from p2ptrain.issuer.invite import read_invite
    from p2ptrain.store.keyfile import create_identity, identity_path, load_identity

    invite = read_invite(args.invite)
    data_dir = Path(args.dir)
    say = _say(args.json)
    network = asyncio.run(_joined_network(invite))
    identity = (
        load_identity(data_dir) if identity_path(data_dir).exists() else create_identity(data_dir)
    )
    if _kept_certificate(data_dir, network, identity, invite.roles) is None:
        expired = invite.expired_problem(now_ms())
        if expired is not None:
            raise LocalError(expired)
        if invite.mode == "grant":
            certificate = asyncio.run(_redeem(invite, identity))
            subject = certificate.record.name
        else:
            signed_in = asyncio.run(
                sign_in(invite.issuer_url, identity, device=args.device_flow, say=say)
            )
            certificate, subject = signed_in.certificate, signed_in.subject
        save(data_dir, invite.issuer_url, certificate)
        say(
            {
                "event": "admitted",
                "subject": subject,
                "peer_id": identity.peer_id,
                "network": network.name,
                "roles": list(invite.roles),
            }
        )
    command = ["node", *(f"--role={role}" for role in invite.roles)]
    if list(invite.roles) == ["trainer"]:
        command = ["train"]
    command += ["--dir", str(data_dir), "--experiment", invite.experiment_id]
    for address in invite.bootstrap:
        command += ["--bootstrap", address]
    for option in ("workload", "data", "device", "windows", "listen", "threads"):
        value = getattr(args, option)
        if value is not None:
            command += [f"--{option}", str(value)]
    if args.json:
        command.append("--json")
    return main(command)
