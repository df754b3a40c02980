"""``p2ptrain admit`` and ``p2ptrain revoke``: an issuer of a certificate network lets a
peer key in, or throws it out for good.

``admit KEY`` signs an admission certificate for a peer's public key (``p2ptrain identity``
prints it) with the issuer's key in ``--dir``; the peer starts its node with
``--certificate FILE``. ``revoke KEY --bootstrap URL`` signs a revocation and hands it to a
node of the network, which floods it: every node that hears it closes the peer's
connections, refuses its requests and its records, keeps the revocation, and passes it to
every peer that connects later. The revocation travels through a short-lived courier key
the issuer certifies for a few minutes as a viewer, so the issuer's own node (often the
seed, running) needs no second connection under its key.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.cli.commands import add_command
from p2ptrain.core.roles import ROLES
from p2ptrain.errors import LocalError

if TYPE_CHECKING:
    from p2ptrain.core.envelope import Signed
    from p2ptrain.core.identity import Identity
    from p2ptrain.core.manifests import NetworkManifest
    from p2ptrain.core.records import Revocation

#: How long the courier that carries a revocation is certified for.
_COURIER_S = 300


def add_parsers(commands: Any, data_dir: str) -> None:
    admit = add_command(
        commands,
        "admit",
        description="Sign an admission certificate to a certificate network (an issuer's "
        "command): the peer whose public key is KEY starts its node with --certificate FILE.",
    )
    admit.add_argument("key", metavar="KEY", help="the peer's public key (p2ptrain identity)")
    admit.add_argument(
        "--dir",
        default=data_dir,
        help=f"the issuer's data directory (its key signs; default: {data_dir})",
    )
    admit.add_argument(
        "--network",
        help="the network id (default: the network of the node in --dir, e.g. the seed's)",
    )
    admit.add_argument(
        "--roles",
        default="",
        help=f"the roles the peer may run, comma-separated ({', '.join(ROLES)}; default: any)",
    )
    admit.add_argument(
        "--expires",
        default="never",
        help="how long the certificate is valid: 90d, 12h, 30m, or never (default)",
    )
    admit.add_argument("--name", default="", help="who the key belongs to, as you checked it")
    admit.add_argument("--out", help="where to write the certificate (default: PEER.cert)")
    admit.set_defaults(handler=run_admit)

    revoke = add_command(
        commands,
        "revoke",
        description="Withdraw a peer key's admission to a certificate network for good (an "
        "issuer's command): the revocation floods the network, and every node cuts the peer "
        "off, refuses its records and keeps the revocation.",
    )
    revoke.add_argument("key", metavar="KEY", help="the peer's public key")
    revoke.add_argument(
        "--dir", default=data_dir, help=f"the issuer's data directory (default: {data_dir})"
    )
    revoke.add_argument(
        "--bootstrap",
        action="append",
        required=True,
        metavar="URL",
        help="a node of the network to hand the revocation to (repeatable: the first that "
        "takes it)",
    )
    revoke.add_argument("--reason", default="", help="why (every node logs it)")
    revoke.add_argument("--secret-file", help="the network's secret, if it has one")
    revoke.add_argument("--out", help="also write the signed revocation to this file")
    revoke.set_defaults(handler=run_revoke)


def parse_key(text: str) -> bytes:
    """A peer's public key from its hex."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise LocalError(
            f"KEY {text!r:.80}: give the peer's Ed25519 public key, 64 hex characters (the "
            "peer runs p2ptrain identity --dir ITS_DIR to print it)"
        )
    return key


def parse_roles(text: str) -> tuple[str, ...]:
    roles = tuple(sorted({r.strip() for r in text.split(",") if r.strip()}))
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise LocalError(
            f"--roles {text!r:.80}: {', '.join(unknown)}: choose from {', '.join(ROLES)}"
        )
    return roles


def parse_expiry(text: str, now_ms: int) -> int:
    """The expiry in Unix milliseconds (0: never) of a duration from now."""
    from p2ptrain.issuer.config import parse_duration_s

    if text.strip().lower() == "never":
        return 0
    return now_ms + int(parse_duration_s(text, "--expires") * 1000)


def network_of(data_dir: str) -> NetworkManifest | None:
    """The network manifest of the node whose data directory is ``data_dir`` (None: it
    follows none)."""
    if not (Path(data_dir) / "node.db").exists():
        return None
    from p2ptrain.core.envelope import open_envelope
    from p2ptrain.core.manifests import ExperimentManifest, NetworkManifest
    from p2ptrain.node.persist import NodeStore
    from p2ptrain.store.datadir import DataDir

    with DataDir(data_dir) as datadir:
        store = NodeStore(datadir)
        experiment_id = store.experiment_id()
        raw = None if experiment_id is None else store.record(experiment_id)
        if raw is None:
            return None
        experiment = open_envelope(raw, ExperimentManifest).record
        network = store.record(experiment.network_id)
    return None if network is None else open_envelope(network, NetworkManifest).record


def check_issuer(identity: Identity, network: NetworkManifest, data_dir: str) -> None:
    if network.admission != "certificate":
        raise LocalError(
            f"network {network.name!r} admits peers without certificates (admission "
            f"{network.admission!r}); certificates are for a network whose seed was started "
            "with --admission certificate"
        )
    if identity.public_key not in network.issuer_keys:
        raise LocalError(
            f"the key in {data_dir} is not an issuer of network {network.name!r}: use the "
            "data directory of one of its issuers (the seed's, unless the seed named others "
            "with --issuer)"
        )


def run_admit(args: argparse.Namespace) -> int:
    from p2ptrain.core.identity import peer_id_of
    from p2ptrain.node.admission import issue_certificate, now_ms
    from p2ptrain.store.atomic import write_atomically
    from p2ptrain.store.keyfile import load_identity

    subject = parse_key(args.key)
    roles = parse_roles(args.roles)
    expires = parse_expiry(args.expires, now_ms())
    issuer = load_identity(args.dir)
    network = network_of(args.dir)
    if network is not None:
        check_issuer(issuer, network, args.dir)
        if args.network not in (None, network.id):
            raise LocalError(
                f"--network {args.network[:16]}: the node in {args.dir} belongs to network "
                f"{network.id[:16]}; leave --network out, or use that network's issuer"
            )
        network_id = network.id
    elif args.network is None:
        raise LocalError(
            f"{args.dir} holds no network: give --network ID (the seed's status shows it), "
            "or use the seed's data directory"
        )
    else:
        network_id = args.network
    signed = issue_certificate(
        issuer, network_id, subject, roles=roles, expires_ms=expires, name=args.name
    )
    out = Path(args.out or f"{peer_id_of(subject)[:16]}.cert")
    write_atomically(out, bytes(signed.envelope.encode()))
    until = "never expires" if not expires else f"expires in {args.expires}"
    print(
        f"admission certificate for {peer_id_of(subject)[:16]} ({', '.join(roles) or 'any role'}"
        f"; {until}) written to {out}: the peer starts its node with --certificate {out}",
        file=sys.stderr,
    )
    print(out)
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    import asyncio

    from p2ptrain.core.envelope import seal
    from p2ptrain.core.identity import peer_id_of
    from p2ptrain.core.records import Revocation
    from p2ptrain.node.admission import now_ms
    from p2ptrain.store.atomic import write_atomically
    from p2ptrain.store.keyfile import load_identity

    subject = parse_key(args.key)
    issuer = load_identity(args.dir)
    secret = _read_secret(args.secret_file)
    network, address = asyncio.run(_fetch_network(args.bootstrap))
    check_issuer(issuer, network, args.dir)
    revocation = seal(
        issuer,
        Revocation(
            network_id=network.id,
            subject=subject,
            issuer=issuer.public_key,
            issued_at_ms=now_ms(),
            reason=args.reason,
        ),
    )
    if args.out:
        write_atomically(Path(args.out), bytes(revocation.envelope.encode()))
    _forget_in_ledger(Path(args.dir), subject)
    peer = asyncio.run(_deliver(issuer, network, address, secret, revocation))
    print(
        f"revoked {peer_id_of(subject)[:16]}: handed to {peer[:16]} at {address}, which passes "
        "it to every node of the network",
        file=sys.stderr,
    )
    return 0


def _forget_in_ledger(data_dir: Path, subject: bytes) -> None:
    """In the data directory of an issuing service (``p2ptrain issuer``): the key is never
    renewed, and no longer counts against its person's limit."""
    from p2ptrain.issuer.policy import LEDGER_FILE, Ledger

    if (data_dir / LEDGER_FILE).exists():
        ledger = Ledger(data_dir)
        try:
            ledger.revoke(subject)
        finally:
            ledger.close()


def _read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    from p2ptrain.cli.node_commands import network_secret

    return network_secret(path)


async def _fetch_network(addresses: list[str]) -> tuple[NetworkManifest, str]:
    """The network manifest from the first bootstrap that serves one."""
    from p2ptrain.core.envelope import open_envelope
    from p2ptrain.core.manifests import NetworkManifest
    from p2ptrain.errors import ProtocolViolation, TransportError
    from p2ptrain.net.client import fetch_network_manifest

    problems = []
    for address in addresses:
        try:
            return open_envelope(await fetch_network_manifest(address), NetworkManifest).record, (
                address
            )
        except (TransportError, ProtocolViolation) as exc:
            problems.append(f"{address}: {exc}")
    raise LocalError(
        "no bootstrap served the network manifest (" + "; ".join(problems) + "); check the "
        "addresses"
    )


async def _deliver(
    issuer: Identity,
    network: NetworkManifest,
    address: str,
    secret: bytes | None,
    revocation: Signed[Revocation],
) -> str:
    """Hand ``revocation`` to the node at ``address`` through a courier key the issuer
    certifies for a few minutes; return that node's peer id."""
    import asyncio
    import tempfile

    from p2ptrain.core.identity import Identity
    from p2ptrain.errors import TransportError
    from p2ptrain.net.client import Refused
    from p2ptrain.net.config import NetConfig
    from p2ptrain.net.node import NetNode
    from p2ptrain.node.admission import issue_certificate, now_ms
    from p2ptrain.store.blobs import BlobStore

    courier = Identity.generate()
    admission = issue_certificate(
        issuer, network.id, courier.public_key, roles=("viewer",),
        expires_ms=now_ms() + _COURIER_S * 1000, name="revocation courier",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="p2ptrain-revoke-") as blobs:
        net = NetNode(
            identity=courier,
            network=network,
            blobs=BlobStore(blobs),
            config=NetConfig(host=None, bootstrap=()),
            roles=("viewer",),
            secret=secret,
            admission=admission,
        )
        async with net:
            # Held before we connect: a node sends the revocations it holds on every new
            # connection, first thing (a message published once the connection is open
            # would go only to a peer that has already said it takes the topic).
            net.publish_revocation(revocation)
            try:
                peer = await net.connect(address)
            except (TransportError, Refused) as exc:
                raise LocalError(f"cannot hand the revocation to {address}: {exc}") from exc
            started = time.monotonic()
            try:
                async with asyncio.timeout(10.0):
                    await net.wait_connected()  # the connection is being served
                    connection = net.gossip.connections.get(peer)
                    if connection is None:
                        raise LocalError(f"{address} closed the connection at once; try again")
                    # Its first frame says which topics it takes: it is reading ours now.
                    # Closing before that can reset the socket with our frames still unread
                    # in its buffer, and the revocation is lost.
                    while not connection.topics and not connection.closed:
                        await asyncio.sleep(0.01)
                await connection.drained(10.0)
            except TimeoutError:
                raise LocalError(
                    f"{address} did not take the revocation within "
                    f"{time.monotonic() - started:.0f} s; try another --bootstrap"
                ) from None
    return peer
