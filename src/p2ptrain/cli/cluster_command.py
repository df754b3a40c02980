"""``p2ptrain cluster``: the machines of a LAN train one model as one synchronous cluster.

Run ``p2ptrain cluster --secret-file F`` on each machine: the members find each other by
mDNS, prove the shared secret to each other, elect the most senior as leader, meet at the
leader's torch.distributed store and train with DDP and a compression hook; they re-form
when a member dies or joins (docs/clusters.md). One line per event (``--json``: one JSON
object per line, on stdout); problems on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.cli.commands import add_command
from p2ptrain.errors import LocalError

if TYPE_CHECKING:  # the runtime (torch) is imported by the handler
    from p2ptrain.cli.cluster_pod import PodNetwork
    from p2ptrain.cluster.events import ClusterEvent

_COMPRESSIONS = ("auto", "none", "fp16", "bf16", "powersgd")
_WORKLOAD, _COMPRESSION, _COLLECTIVE_TIMEOUT_S = "char-gpt", "auto", 30.0
#: What a cluster in a network takes from the experiment instead (the option, its flag).
_OWN_TRAINING = (("config", "--config"), ("steps", "--steps"), ("compression", "--compression"))


def add_parsers(commands: Any, data_dir: str) -> None:
    cluster = add_command(
        commands,
        "cluster",
        description="Train with the machines of your LAN as one synchronous cluster: run this "
        "on each machine with the same --secret-file. Members find each other by mDNS, prove "
        "the secret to each other (it never travels), and the member in the cluster longest "
        "leads: it hosts the torch.distributed store, and DDP trains with a compression hook. "
        "When a member (or the leader) dies the others re-form and go on from the last "
        "completed step; a new member joins at the next re-form. torch.distributed's store "
        "and collectives are neither authenticated nor encrypted: run a cluster on a trusted "
        "LAN or a VPN only (docs/clusters.md). With --experiment and --bootstrap the "
        "cluster trains in that p2ptrain network as one pod trainer: its leader runs the "
        "trainer node and every member is a rank of its pod.",
    )
    cluster.add_argument(
        "--secret-file",
        required=True,
        help="the cluster's shared secret (the same file on every member; 16 bytes or more, "
        "hex or text; e.g. `openssl rand -hex 32 > cluster.secret`)",
    )
    cluster.add_argument(
        "--dir",
        default=data_dir,
        help=f"data directory with this member's identity (created if needed; default: {data_dir})",
    )
    cluster.add_argument(
        "--workload",
        help="what to train: a built-in name or path/file.py:factory or package.module:factory "
        "(default: char-gpt; with --experiment: the experiment's own)",
    )
    cluster.add_argument(
        "--config",
        action="append",
        metavar="KEY=VALUE",
        help="a setting of the workload's config (repeatable; numbers and true/false are "
        "read as such)",
    )
    cluster.add_argument("--steps", type=int, help="stop after this many completed steps")
    network = cluster.add_argument_group(
        "training in a p2ptrain network as one pod trainer",
        "the experiment fixes the workload's config and the steps, and the pod's gradients "
        "travel plain (DDP): --config, --steps and --compression do not apply",
    )
    network.add_argument(
        "--experiment", help="the experiment id to train in (as p2ptrain train takes it)"
    )
    network.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="URL",
        help="a peer of the network to join through (repeatable; needed with --experiment)",
    )
    network.add_argument(
        "--network-secret-file",
        help="the network's admission secret (p2ptrain train's --secret-file), if it has one",
    )
    network.add_argument(
        "--device",
        default="cpu",
        help="where each member's rank trains: cpu (default; the pod's collectives run on "
        "gloo) or cuda (one GPU per member; NCCL)",
    )
    cluster.add_argument(
        "--compression",
        choices=_COMPRESSIONS,
        help="how gradients travel: auto (default: measured at each re-form, PowerSGD with "
        "error feedback on links slower than 250 MB/s, plain fp32 on faster ones), or "
        "always one of torch's DDP hooks: fp16, bf16 (needs NCCL), powersgd, or none",
    )
    cluster.add_argument(
        "--collective-timeout-s",
        type=float,
        default=_COLLECTIVE_TIMEOUT_S,
        help="seconds a collective may take before the members re-form without the silent "
        "ones (default 30)",
    )
    cluster.add_argument("--name", default="home", help="the cluster's name on the LAN")
    cluster.add_argument(
        "--host",
        help="this machine's IPv4 address the others reach (default: the address of the "
        "interface carrying the LAN's multicast)",
    )
    cluster.add_argument(
        "--port", type=int, default=0, help="the control endpoint's port (default: a free one)"
    )
    cluster.add_argument(
        "--listen-interface",
        action="append",
        metavar="ADDRESS",
        help="IPv4 address of an interface mDNS uses (repeatable; default: --host's, or all)",
    )
    cluster.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a member's control endpoint to ask directly, e.g. over a VPN without multicast "
        "(repeatable)",
    )
    cluster.add_argument(
        "--no-mdns",
        action="store_true",
        help="do not use mDNS: members find this one through their --peer, and it finds "
        "them through its own",
    )
    cluster.add_argument(
        "--wait-for",
        type=int,
        default=1,
        metavar="N",
        help="start training once N members (this one included) are ready (default 1)",
    )
    cluster.add_argument(
        "--discovery-s",
        type=float,
        default=3.0,
        help="seconds spent finding members before the first generation (default 3)",
    )
    cluster.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="seconds a leader waits for known members to ask to join (default 3)",
    )
    cluster.add_argument("--seed", type=int, default=0, help="seed of the sample order")
    cluster.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    cluster.add_argument("--json", action="store_true", help="one JSON object per event")
    cluster.set_defaults(handler=run_cluster)


def read_secret(path: str) -> bytes:
    """The secret in ``path``: hex when it reads as hex, else the text's bytes."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise LocalError(f"cannot read the secret file {path}: {exc}") from exc
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = text.encode()
    if len(secret) < 16:
        raise LocalError(
            f"the secret in {path} is shorter than 16 bytes; make one with "
            f"`openssl rand -hex 32 > {path}` and copy it to every member"
        )
    return secret


def parse_config(pairs: list[str]) -> dict[str, str | int | float | bool]:
    """``KEY=VALUE`` pairs as a workload config: ints, floats, true/false, else text."""
    config: dict[str, str | int | float | bool] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise LocalError(f"--config {pair!r:.80}: use KEY=VALUE, e.g. --config n_layer=2")
        value: str | int | float | bool = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    continue
        config[key.strip()] = value
    return config


_STDOUT = threading.Lock()


def print_line(line: str) -> None:
    """``line`` on stdout in one write, whole: in pod mode the node's events (relayed by a
    reader thread) and the member's own come from two threads, and with an unbuffered
    stdout ``print`` writes a line and its newline apart, so two lines could interleave."""
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _pod_network(args: argparse.Namespace) -> PodNetwork | None:
    """The network to train in as one pod (``--experiment``), checked; None: on our own."""
    from p2ptrain.cli.cluster_pod import PodNetwork

    if args.experiment is None:
        if args.bootstrap or args.network_secret_file:
            raise LocalError(
                "--bootstrap / --network-secret-file without --experiment: give the "
                "experiment id the cluster trains in, or leave them out"
            )
        return None
    if not args.bootstrap:
        raise LocalError(
            f"--experiment {args.experiment}: give --bootstrap URL, a peer of that network "
            "(the seed's address, for example)"
        )
    for name, flag in _OWN_TRAINING:
        if getattr(args, name) is not None:
            raise LocalError(
                f"{flag} with --experiment: the experiment fixes the workload's config and "
                "the windows, and a pod's gradients travel plain; leave it out"
            )
    secret = args.network_secret_file
    return PodNetwork(
        experiment=args.experiment,
        bootstrap=tuple(args.bootstrap),
        secret_file=None if secret is None else Path(secret),
        workload=args.workload,
        device=args.device,
    )


def run_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from p2ptrain.cluster.events import describe, encode_event
    from p2ptrain.cluster.runtime import ClusterMember
    from p2ptrain.cluster.settings import ClusterSettings
    from p2ptrain.store.datadir import DataDirLock
    from p2ptrain.store.keyfile import create_identity, identity_path, load_identity

    network = _pod_network(args)
    settings = ClusterSettings(
        secret=read_secret(args.secret_file),
        data_dir=Path(args.dir),
        workload=args.workload or ("" if network else _WORKLOAD),
        config=parse_config(args.config or []),
        name=args.name,
        host=args.host,
        port=args.port,
        mdns=not args.no_mdns,
        mdns_interfaces=None if args.listen_interface is None else tuple(args.listen_interface),
        peers=tuple(args.peer),
        steps=args.steps,
        # a pod trainer's gradients travel plain, under the pod's DDP
        compression="none" if network else args.compression or _COMPRESSION,
        collective_timeout_s=args.collective_timeout_s,
        wait_for=args.wait_for,
        discovery_s=args.discovery_s,
        settle_s=args.settle_s,
        seed=args.seed,
        threads=args.threads,
        gloo_interface=os.environ.get("GLOO_SOCKET_IFNAME") or None,
        experiment=None if network is None else network.experiment,
    )
    lock = DataDirLock(settings.data_dir)
    try:
        exists = identity_path(settings.data_dir).exists()
        identity = (
            load_identity(settings.data_dir) if exists else create_identity(settings.data_dir)
        )

        def show(event: ClusterEvent) -> None:
            print_line(encode_event(event) if args.json else describe(event))

        if network is None:
            member = ClusterMember(settings, identity, on_event=show)
        else:
            from p2ptrain.cli.cluster_pod import pod_generations

            relay = print_line if args.json else None  # the node's events among ours
            build = pod_generations(network, relay)
            member = ClusterMember(settings, identity, on_event=show, build=build)
        try:
            asyncio.run(member.run())
        except asyncio.CancelledError:
            print("p2ptrain: cluster member stopped at once (asked twice)", flush=True)
            return 130
    finally:
        lock.release()
    return 0
