"""``p2ptrain node | seed | train | validate | reduce | view | status | export | evaluate``.

``p2ptrain node --role trainer --role validator ...`` runs one node holding every role it is
given (one identity, data directory, server and store); ``seed``, ``train``, ``validate``,
``reduce`` and ``view`` are shortcuts for a node of one role. Each node command takes its
settings from an optional TOML file (``--config``; keys are the flag names with ``_`` for
``-``, e.g. ``bootstrap = ["http://seed:7700"]``, and ``role = ["trainer", "validator"]``)
and from flags, which win. A node prints one line per certified window (``--json``: one JSON
object per event on stdout, for scripts and the demo) and logs problems on stderr, and with
``--log-file`` what it did to a rotated file too (:mod:`p2ptrain.cli.logs`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.cli.commands import add_command, summary
from p2ptrain.cli.logs import CONFIG_KEYS as LOG_CONFIG_KEYS
from p2ptrain.cli.logs import add_log_arguments
from p2ptrain.cli.pod_launch import add_pod_arguments, launch_pod, pod_from_environment
from p2ptrain.cli.status_text import (
    admission_rows,
    mib,
    store_text,
    tallies,
    validation_text,
)
from p2ptrain.core.roles import ROLES
from p2ptrain.driver.failures import DEFAULT_MAX_FAILURES
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.observe.events import (
    CatchingUp,
    Evaluated,
    HeadAdopted,
    NodeEvent,
    PeerReported,
    Ready,
    RoleFailure,
    Trained,
    encode_event,
)
from p2ptrain.observe.status import NodeStatus, decode_status, read_status
from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS

if TYPE_CHECKING:  # the node's runtime (torch) is imported by the commands that run one
    from p2ptrain.node.setup import NodeSettings

#: The commands that run a node of one role.
_NODE_COMMANDS = {
    "seed": "seed",
    "train": "trainer",
    "validate": "validator",
    "reduce": "reducer",
    "view": "viewer",
}
_SERVING_ROLES = ("seed", "validator", "reducer")
_CONFIG_KEYS = {
    "role",
    "heartbeat_s",
    "max_role_failures",
    "archive",
    "keep_heads",
    "dir",
    "experiment",
    "experiment_toml",
    "allow_minority_quorum",
    "admission",
    "issuer",
    "certificate",
    "tls",
    "bootstrap",
    "listen",
    "advertise",
    "relay",
    "secret_file",
    "metrics_listen",
    "windows",
    "until_height",
    "close_early",
    "threads",
    "mdns",
    "network_name",
    "workload",
    "device",
    "evaluate",
    "data",
    "data_cache_mb",
    "pod_ranks",
    "pod_timeout_s",
    "pod_restarts",
    "pod_wrap",
    *LOG_CONFIG_KEYS,
}
#: The node commands that take --evaluate: a validator or viewer (or any node) evaluates.
_EVALUATING = (None, "validator", "viewer")


def add_parsers(commands: Any, data_dir: str) -> None:
    node = add_command(
        commands,
        "node",
        description="Run one node holding every role given with --role (one identity, data "
        "directory, server and store): three friends can each train and validate.",
    )
    node.add_argument(
        "--role",
        action="append",
        dest="roles",
        choices=ROLES,
        help="a role this node holds (repeatable; or `role = [...]` in --config)",
    )
    _node_arguments(node, data_dir, None)
    node.set_defaults(handler=run_node_command)
    for command, role in _NODE_COMMANDS.items():
        parser = add_command(commands, command, description=summary(command) + ".")
        _node_arguments(parser, data_dir, role)
        parser.set_defaults(handler=run_node_command, roles=[role])

    status = add_command(
        commands,
        "status",
        description="Show the status of a node: a data directory (any role, read from its "
        "status file) or the address of a reachable node (asked over HTTP).",
    )
    status.add_argument(
        "target", nargs="?", default=data_dir, help=f"data directory or http address ({data_dir})"
    )
    status.add_argument("--secret-file", help="the network secret, for a private network")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--watch",
        action="store_true",
        help="a live view, read again every --interval seconds until Ctrl-C (a target that "
        "is not up yet is waited for)",
    )
    status.add_argument(
        "--interval",
        type=float,
        metavar="SECONDS",
        help="with --watch: seconds between two reads (default 2, at least 1)",
    )
    status.set_defaults(handler=run_status)

    export = add_command(
        commands,
        "export",
        description="Write the weights of the last certified head held in a data directory "
        "as a safetensors file (metadata: experiment, height, head id, workload) and its "
        "config as JSON beside it.",
    )
    export.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    export.add_argument(
        "--out",
        help="output file (plain: default model.safetensors) or directory (hf: default model-hf)",
    )
    export.add_argument(
        "--format",
        choices=("plain", "hf"),
        default="plain",
        help="plain: safetensors + JSON config; hf: a save_pretrained directory that "
        "AutoModelForCausalLM.from_pretrained loads (config, weights, vocabulary, model card)",
    )
    export.add_argument(
        "--workload",
        help="the experiment's code, when it is given by reference (path/file.py:factory)",
    )
    export.add_argument("--json", action="store_true", help="print JSON")
    export.set_defaults(handler=run_export)

    evaluate = add_command(
        commands,
        "evaluate",
        description="Verify the chain stored in a data directory, evaluate one of its heads "
        "(default: the tip) on the experiment's validation data with the experiment's "
        "workload, and print the local loss next to every stored metrics report of that "
        "head (each evaluator's key, its loss and the difference).",
    )
    evaluate.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    evaluate.add_argument("--head", help="the id of a stored certified head (default: the tip)")
    evaluate.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    evaluate.add_argument(
        "--workload",
        help="the experiment's code, when it is given by reference (path/file.py:factory)",
    )
    evaluate.add_argument("--json", action="store_true", help="print JSON")
    evaluate.set_defaults(handler=run_evaluate)


def _node_arguments(parser: argparse.ArgumentParser, data_dir: str, role: str | None) -> None:
    parser.add_argument("--config", help="TOML file with these settings (flags win)")
    parser.add_argument("--dir", help=f"data directory (default: {data_dir})")
    if role in ("seed", None):
        parser.add_argument(
            "--experiment-toml",
            help="experiment definition to sign and serve, for the seed creating the network "
            "(see examples/shakespeare.toml)",
        )
        parser.add_argument(
            "--admission",
            choices=("open", "certificate"),
            help="who may join the network this seed creates: open (default: anyone, or "
            "anyone with --secret-file) or certificate (only peers holding an issuer's "
            "certificate: p2ptrain admit)",
        )
        parser.add_argument(
            "--issuer",
            action="append",
            metavar="KEY",
            help="a public key that issues certificates (repeatable; default: this seed's)",
        )
        parser.add_argument(
            "--allow-minority-quorum",
            action="store_true",
            default=None,
            help="sign an experiment whose quorum is not a majority of its validators (two "
            "disjoint quorums could then certify two heads at one height: for test networks "
            "and validators you run yourself)",
        )
    parser.add_argument("--experiment", help="the experiment id to join (the seed prints it)")
    parser.add_argument(
        "--bootstrap", action="append", help="seed address http://HOST:PORT (repeatable)"
    )
    parser.add_argument(
        "--listen",
        help="HOST:PORT to serve on; 'none' for outbound only (default: 127.0.0.1:0 for a "
        "seed, validator or reducer, none otherwise)",
    )
    parser.add_argument(
        "--advertise", action="append", help="address peers should dial (repeatable)"
    )
    parser.add_argument(
        "--certificate",
        help="this node's admission certificate to a certificate network (p2ptrain admit "
        "writes it; kept in the data directory)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="serve over TLS; the certificate's fingerprint is pinned in the node's signed "
        "peer record, so peers need no certificate authority",
    )
    parser.add_argument("--relay", help="a seed that relays requests to this private node")
    parser.add_argument("--secret-file", help="file holding a private network's secret")
    parser.add_argument(
        "--metrics-listen",
        help="HOST:PORT of a listener of its own for /metrics and the dashboard, answered "
        "without credentials (default: none; the node's server answers /metrics to loopback "
        "only, and its dashboard at / to loopback, or to everyone on an open network)",
    )
    stop_at = parser.add_mutually_exclusive_group()
    stop_at.add_argument(
        "--windows",
        type=int,
        help="take part in this many more certified windows (counted once caught up), then stop",
    )
    stop_at.add_argument("--until-height", type=int, help="stop once the chain reaches this height")
    parser.add_argument(
        "--no-early-close",
        dest="close_early",
        action="store_false",
        default=None,
        help="(reducer, validator) wait for every window's deadline, even once every trainer "
        "it expects has reported",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default 1)")
    parser.add_argument("--mdns", action="store_true", default=None, help="find peers on the LAN")
    parser.add_argument("--network-name", help="name of the network a seed creates")
    parser.add_argument(
        "--max-role-failures",
        type=int,
        help="stop the node once a role failed this many steps in a row "
        f"(default {DEFAULT_MAX_FAILURES})",
    )
    parser.add_argument(
        "--archive",
        action="store_true",
        default=None,
        help="keep every accepted update and proposal for good (who trained and proposed "
        "what), and every blob; by default a node keeps only what its roles used, for the "
        "last window, and deletes the blobs it no longer needs",
    )
    parser.add_argument(
        "--keep-heads",
        type=int,
        help="keep the weights and optimizer state of this many last certified heads (and "
        "the genesis weights); older ones, and older windows' updates, are deleted "
        f"(default {DEFAULT_KEEP_HEADS}; --archive keeps everything)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        help="close a gossip socket whose peer has not answered a ping for this long "
        "(default 20; a transport fault, never held against the peer)",
    )
    parser.add_argument(
        "--workload",
        help="your model and data: path/to/file.py:factory or package.module:factory (a "
        "seed signs it into the experiment; trainers pass the same code to run it)",
    )
    parser.add_argument(
        "--data",
        help="a prepared dataset (p2ptrain data prepare) whose shards this node serves to "
        "trainers (a seed serves the one its experiment definition names by itself)",
    )
    if role in ("trainer", None):
        parser.add_argument(
            "--data-cache-mb",
            type=float,
            help="keep at most this many MiB of fetched shards of a prepared dataset, the "
            "least recently leased evicted first (default 4096)",
        )
        parser.add_argument(
            "--device",
            help="where to train: cpu (default), cuda, cuda:N or mps (validators keep the "
            "canonical arithmetic on the CPU); in a pod, cuda is each rank's own GPU",
        )
        add_pod_arguments(parser)
    if role in _EVALUATING:
        parser.add_argument(
            "--evaluate",
            action="store_true",
            default=None,
            help="evaluate every certified head this node adopts on the validation data and "
            "publish a signed metrics report (needs the experiment's workload)",
        )
    parser.add_argument("--json", action="store_true", help="print events as JSON lines")
    add_log_arguments(parser)
    # read_config: the log is set up (cli.logs) before the node reads its settings
    parser.set_defaults(data_dir_default=data_dir, read_config=_config)


def _config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise LocalError(f"cannot read the config {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise LocalError(f"the config {path} is not valid TOML: {exc}") from exc
    unknown = sorted(set(raw) - _CONFIG_KEYS)
    if unknown:
        known = ", ".join(sorted(_CONFIG_KEYS))
        raise LocalError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {known}")
    return raw


def _listen(text: str | None) -> tuple[str | None, int]:
    if text is None or text.lower() == "none":
        return None, 0
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise LocalError(f"--listen {text!r}: use HOST:PORT (port 0 picks a free one) or none")
    return host.strip("[]"), int(port)


def _public_key(option: str, text: str) -> bytes:
    try:
        key = bytes.fromhex(str(text))
    except ValueError:
        key = b""
    if len(key) != 32:
        raise LocalError(
            f"{option} {text!r:.80}: give an Ed25519 public key, 64 hex characters "
            "(p2ptrain identity prints a node's)"
        )
    return key


def network_secret(path: str | None, *, create: bool = False) -> bytes | None:
    """The network secret in ``path``; a seed (``create``) writes a new one when the file
    does not exist yet."""
    if path is None:
        return None
    if create and not Path(path).exists():
        from p2ptrain.node.setup import new_secret

        secret = new_secret()
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(secret.hex() + "\n")
        except OSError as exc:
            raise LocalError(f"cannot write a new network secret to {path}: {exc}") from exc
        print(
            f"wrote a new network secret to {path}: copy it to every node (--secret-file)",
            file=sys.stderr,
        )
        return secret
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise LocalError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = text.encode()
    if len(secret) < 16:
        raise LocalError(f"the secret in {path} is shorter than 16 bytes; use 32 random bytes")
    return secret


def settings_from(args: argparse.Namespace) -> NodeSettings:
    from p2ptrain.node.setup import DEFAULT_DATA_CACHE_MB, NodeSettings

    config = _config(args.config)

    def pick(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None)
        return config.get(name, default) if value is None else value

    roles = pick("roles") or config.get("role") or []
    if isinstance(roles, str):
        roles = [roles]
    if not roles:
        raise LocalError(
            f"p2ptrain node: give the node its roles, e.g. --role trainer --role validator "
            f"(one or more of {', '.join(ROLES)})"
        )
    serving = any(r in _SERVING_ROLES for r in roles)
    host, port = _listen(pick("listen", "127.0.0.1:0" if serving else None))
    toml = pick("experiment_toml")
    pod = pod_from_environment(os.environ, timeout_s=pick("pod_timeout_s"), wrap=pick("pod_wrap"))
    device = str(pick("device", "cpu"))
    if pod is not None and device == "cuda":
        device = f"cuda:{pod.local_rank}"  # one GPU per rank
    return NodeSettings(
        data_dir=Path(pick("dir", args.data_dir_default)),
        roles=tuple(roles),
        experiment_id=pick("experiment"),
        experiment_toml=None if toml is None else Path(toml),
        allow_minority_quorum=bool(pick("allow_minority_quorum", False)),
        admission=str(pick("admission", "open")),
        issuers=tuple(_public_key("--issuer", k) for k in pick("issuer", [])),
        certificate=None if pick("certificate") is None else Path(pick("certificate")),
        tls=bool(pick("tls", False)),
        bootstrap=tuple(pick("bootstrap", [])),
        host=host,
        port=port,
        advertise=tuple(pick("advertise", [])),
        relay=pick("relay"),
        secret=network_secret(pick("secret_file"), create="seed" in roles),
        network_name=pick("network_name", "p2ptrain"),
        windows=_stop_after(pick("windows"), pick("until_height")),
        until_height=_positive(pick("until_height"), "--until-height"),
        close_early=bool(pick("close_early", True)),
        threads=int(pick("threads", 1)),
        mdns=bool(pick("mdns", False)),
        max_role_failures=int(pick("max_role_failures", DEFAULT_MAX_FAILURES)),
        archive=bool(pick("archive", False)),
        keep_heads=int(pick("keep_heads", DEFAULT_KEEP_HEADS)),
        heartbeat_s=float(pick("heartbeat_s", 20.0)),
        workload=pick("workload"),
        device=device,
        evaluate=bool(pick("evaluate", False)),
        serve_data=None if pick("data") is None else Path(pick("data")),
        data_cache_bytes=int(float(pick("data_cache_mb", DEFAULT_DATA_CACHE_MB)) * (1 << 20)),
        metrics_listen=pick("metrics_listen"),
        pod=pod,
    )


def run_node_command(args: argparse.Namespace) -> int:
    config = _config(args.config)
    ranks = getattr(args, "pod_ranks", None)
    if ranks is None and "LOCAL_RANK" not in os.environ:  # (in the pod: what started it)
        ranks = config.get("pod_ranks")
    if ranks is not None:  # torchrun runs this command again, on each rank
        restarts = getattr(args, "pod_restarts", None)
        restarts = config.get("pod_restarts") if restarts is None else restarts
        return launch_pod(args.argv, int(ranks), restarts)
    settings = settings_from(args)
    if settings.pod is not None:
        from p2ptrain.node.parent_death import exit_with_parent

        # a rank outlives a torchrun agent that was killed: no rank trains on alone
        exit_with_parent(f"pod rank {settings.pod.rank}")
    if settings.pod is not None and settings.pod.rank > 0:
        from p2ptrain.node.pod import run_pod_rank

        run_pod_rank(settings, settings.pod)
        return 0
    from p2ptrain.node.launch import run_node

    if args.json:
        run_node(settings, on_event=_json_event)
        return 0
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=False, highlight=False)
    columns = [TextColumn("[bold]windows"), BarColumn(), TextColumn("{task.completed}")]
    total = settings.windows or settings.until_height
    if total is not None:
        columns.append(TextColumn("/ {task.total}"))
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
        # --windows counts the windows from the height the node started at
        task = progress.add_task("windows", total=total)
        started: list[int] = []

        def show(event: NodeEvent) -> None:
            line = _describe_event(event)
            if line:
                progress.console.print(line, soft_wrap=True)  # ids stay whole
            if isinstance(event, Ready):
                started.append(event.height)
            if isinstance(event, Ready | HeadAdopted):
                origin = started[0] if started and settings.windows is not None else 0
                progress.update(task, completed=max(0, event.height - origin))

        status = run_node(settings, on_event=show)
    console.print(f"stopped at height {status.height} (head {status.head_id[:12]})")
    return 0


def _json_event(event: NodeEvent) -> None:
    sys.stdout.buffer.write(encode_event(event) + b"\n")
    sys.stdout.flush()


def _describe_event(event: NodeEvent) -> str | None:
    """One line for an event worth a line (None for the others)."""
    stamp = time.strftime("%H:%M:%S")
    if isinstance(event, Ready):
        where = event.address or "outbound only"
        return (
            f"{stamp} ready: peer {event.peer_id[:16]} ({', '.join(event.roles)}) at {where}; "
            f"experiment {event.experiment_id} at height {event.height}"
        )
    if isinstance(event, HeadAdopted):
        return (
            f"{stamp} window {event.height} certified: head {event.head_id[:12]}, "
            f"{event.accepted} updates accepted, {event.seconds:.1f} s ({event.reason})"
        )
    if isinstance(event, Trained):
        return (
            f"{stamp} trained window {event.window}: loss {event.loss_before:.3f} -> "
            f"{event.loss_after:.3f} in {event.seconds:.1f} s, update "
            f"{event.blob_bytes / 1e6:.2f} MB"
        )
    if isinstance(event, Evaluated):
        skipped = f", {event.skipped} older head(s) skipped" if event.skipped else ""
        return (
            f"{stamp} evaluated head {event.height} ({event.head_id[:12]}): validation loss "
            f"{event.loss:.4f} on {event.samples} samples{skipped}"
        )
    if isinstance(event, PeerReported):
        return f"{stamp} [yellow]peer {event.peer[:16]} misbehaved: {event.reason}"
    if isinstance(event, CatchingUp):
        return f"{stamp} {event.role}: {event.reason}"
    if isinstance(event, RoleFailure):
        return (
            f"{stamp} [red]{event.role} failed in window {event.window} while {event.step}: "
            f"{event.error}: {event.message} ({event.failures} of {event.limit} in a row)"
        )
    return None


# -- status ---------------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    import asyncio

    target: str = args.target
    secret = (
        network_secret(args.secret_file) if target.startswith(("http://", "https://")) else None
    )

    def read() -> NodeStatus:
        if target.startswith(("http://", "https://")):
            return asyncio.run(_remote_status(target, secret))
        return read_status(Path(target))

    if args.watch:
        from rich.console import Console

        from p2ptrain.cli.status_watch import MIN_INTERVAL_S, run_watch

        if args.json:
            raise LocalError(
                "--watch shows a live view and --json prints one status: give one of them "
                "(for JSON every few seconds, run `p2ptrain status --json` in a loop)"
            )
        interval = 2.0 if args.interval is None else args.interval
        if not MIN_INTERVAL_S <= interval < float("inf"):
            raise LocalError(f"--interval {args.interval}: use {MIN_INTERVAL_S:g} second or more")
        return run_watch(read, target=target, interval_s=interval, console=Console())
    if args.interval is not None:
        raise LocalError("--interval sets how often --watch reads the status: add --watch")
    status = read()
    if args.json:
        from p2ptrain.observe.status import encode_status

        print(encode_status(status).decode())
        return 0
    for line in describe_status(status):
        print(line)
    return 0


def describe_status(status: NodeStatus) -> list[str]:
    """``p2ptrain status`` in words."""
    links = status.connections
    lines = [
        f"peer       {status.peer_id[:16]}  roles {', '.join(status.roles)}",
        f"address    {status.address or 'outbound only'}",
        f"experiment {status.experiment_id}",
        f"height     {status.height}  head {status.head_id[:16]}",
        f"peers      {status.peers} known, {status.banned} banned; connections "
        f"{links.outbound} out, {links.inbound} in",
    ]
    lines += [f"{label:<10} {text}" for label, text in admission_rows(status)]
    last = status.last_window
    if last is not None:
        lines.append(f"last       window {last.height}: {last.accepted} accepted ({last.reason})")
    for role in status.role_states:
        failing = f"; {role.failures_in_a_row} failures in a row" if role.failures_in_a_row else ""
        lines.append(f"{role.role:<10} {role.last_reason}{failing}")
    if status.validation is not None:
        lines.append(f"val loss   {validation_text(status.validation)}")
    if status.trainer is not None:
        t = status.trainer
        lines.append(
            f"trained    window {t.window}: loss {t.loss_before:.3f} -> {t.loss_after:.3f} "
            f"in {t.seconds:.1f} s"
        )
    if status.data is not None:
        d = status.data
        lines.append(f"data       {d.kind}: {d.descriptor}")
        if d.kind == "sharded":
            limit = "no limit" if d.cache_limit_bytes is None else mib(d.cache_limit_bytes)
            lines.append(
                f"shards     {d.shards_held} held ({mib(d.bytes_held)} of {limit}) in "
                f"{d.location}; fetched {d.fetched_shards} ({mib(d.downloaded_bytes)}) for "
                f"leases naming {d.leased_shards} ({mib(d.leased_bytes)}); "
                f"evicted {d.evicted_shards}"
            )
        elif d.location:
            lines.append(f"data at    {d.location}")
    lines.append(f"store      {store_text(status)}")
    lines += [f"{label:<10} {text}" for label, text in tallies(status)]
    for error in status.errors[-5:]:
        lines.append(f"error      {error.role}, {error.describe()}")
    if status.storage is not None:
        lines.append(
            f"STORAGE    {status.storage.message} ({status.storage.failures} writes failed)"
        )
    if status.failed:
        lines.append(f"FAILED     {status.failed}")
    lines += [f"report     {reason}" for reason in status.reasons]
    return lines


async def _remote_status(address: str, secret: bytes | None) -> NodeStatus:
    from p2ptrain.core.envelope import open_envelope
    from p2ptrain.core.identity import Identity
    from p2ptrain.core.manifests import NetworkManifest
    from p2ptrain.net.auth import ClientCredentials
    from p2ptrain.net.client import PeerClient, fetch_network_manifest

    try:
        network = open_envelope(await fetch_network_manifest(address), NetworkManifest)
        client = PeerClient(ClientCredentials(network.record, Identity.generate(), secret=secret))
        try:
            async with client.request("GET", address, "/v1/status") as response:
                data = await response.read()
        finally:
            await client.close()
    except (TransportError, ProtocolViolation) as exc:
        raise LocalError(
            f"cannot get the status of {address}: {exc}; check the address and that the node "
            "runs (or give its data directory)"
        ) from exc
    return decode_status(data, address)


# -- export ---------------------------------------------------------------------------------


def run_export(args: argparse.Namespace) -> int:
    from p2ptrain.node.export import export_checkpoint, export_hf

    if args.format == "hf":
        result = export_hf(Path(args.dir), Path(args.out or "model-hf"), workload=args.workload)
        wrote = f"{result['directory']}"
        usable = ": AutoModelForCausalLM.from_pretrained loads it"
    else:
        out = Path(args.out or "model.safetensors")
        result = export_checkpoint(Path(args.dir), out, workload=args.workload)
        wrote, usable = result["checkpoint"], f" and {result['config']}"
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"wrote {wrote} (height {result['height']}, head {result['head_id'][:12]}){usable}",
            file=sys.stderr,
        )
    return 0


# -- evaluate -------------------------------------------------------------------------------


def run_evaluate(args: argparse.Namespace) -> int:
    from p2ptrain.node.export import evaluate_stored_head

    if args.threads < 1:
        raise LocalError(f"--threads {args.threads}: use 1 or more")
    result = evaluate_stored_head(
        Path(args.dir), args.head, threads=args.threads, workload=args.workload
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"head {result['height']} ({result['head_id'][:16]}): local validation loss "
        f"{result['loss']:.6f} on {result['samples']} samples"
    )
    reports = result["reports"]
    if not reports:
        print("no metrics report of this head is stored")
    for report in reports:
        print(
            f"  evaluator {report['evaluator'][:16]}  loss {report['loss']:.6f}  "
            f"difference {report['difference']:+.2e}"
        )
    return 0


def _stop_after(windows: object, until_height: object) -> int | None:
    if windows is not None and until_height is not None:
        raise LocalError(
            "give --windows (more windows to take part in) or --until-height (a height to "
            "stop at), not both (check the config file too)"
        )
    return _positive(windows, "--windows")


def _positive(value: object, option: str) -> int | None:
    """``value`` as a whole number of at least 1 (None stays None), or a LocalError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LocalError(f"{option} must be a whole number of at least 1, got {value!r}")
    return value
