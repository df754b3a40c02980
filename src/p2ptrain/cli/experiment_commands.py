"""``p2ptrain experiment create|show``: define, sign and inspect experiments."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from p2ptrain.cli.usage import show_usage
from p2ptrain.core.envelope import open_envelope, seal
from p2ptrain.core.experiment_config import experiment_from_toml
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.store.atomic import write_atomically
from p2ptrain.store.datadir import DataDir
from p2ptrain.store.keyfile import load_identity


def add_parsers(commands: Any, data_dir: str) -> None:
    experiment = commands.add_parser(
        "experiment", help="create and inspect signed experiment manifests"
    )
    sub = experiment.add_subparsers(dest="experiment_command", metavar="SUBCOMMAND")

    create = sub.add_parser(
        "create",
        help="validate a TOML experiment definition, sign it and print its id",
        description="Validate a TOML experiment definition, sign it with the data "
        "directory's key (which becomes the experiment authority), store it, write the "
        "signed manifest to --out and print the experiment id.",
    )
    create.add_argument("toml", help="experiment definition (see examples/experiment.toml)")
    create.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    create.add_argument(
        "--out", help="where to write the signed manifest (default: TOML path + .experiment)"
    )
    create.add_argument(
        "--allow-minority-quorum",
        action="store_true",
        help="accept a quorum of at most half the validators (unsafe: two disjoint quorums "
        "could certify different heads)",
    )
    create.set_defaults(handler=run_create)

    show = sub.add_parser(
        "show",
        help="verify a signed experiment manifest and print it as JSON",
        description="Verify a signed experiment manifest file and print it as JSON.",
    )
    show.add_argument("manifest", help="signed manifest written by `experiment create`")
    show.set_defaults(handler=run_show)
    experiment.set_defaults(handler=lambda _args: show_usage(experiment))


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise LocalError(f"cannot read {path}: {exc.strerror}") from exc


def run_create(args: argparse.Namespace) -> int:
    try:
        text = _read(args.toml).decode("utf-8")
    except UnicodeDecodeError:
        raise LocalError(f"{args.toml} is not UTF-8 text") from None
    identity = load_identity(args.dir)
    manifest = experiment_from_toml(text, identity.public_key)
    if not manifest.has_majority_quorum and not args.allow_minority_quorum:
        raise LocalError(
            f"quorum: {manifest.quorum} of {len(manifest.validators)} validators is not a "
            "majority, so two disjoint quorums could certify different heads. Raise quorum "
            f"to at least {len(manifest.validators) // 2 + 1}, or pass --allow-minority-quorum."
        )
    signed = seal(identity, manifest)
    data = signed.envelope.encode()
    out = Path(args.out) if args.out else Path(args.toml).with_suffix(".experiment")
    write_atomically(out, data)
    with DataDir(args.dir) as store:
        store.state.put_record(
            signed.record_id,
            "experiment",
            data,
            experiment_id=signed.record_id,
            signer=identity.peer_id,
        )
    print(f"signed experiment written to {out}", file=sys.stderr)
    print(signed.record_id)
    return 0


def _hex_bytes(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hex_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_hex_bytes(v) for v in value]
    return value


def run_show(args: argparse.Namespace) -> int:
    try:
        signed = open_envelope(_read(args.manifest), ExperimentManifest)
    except ProtocolViolation as exc:
        raise LocalError(f"{args.manifest} is not a valid signed experiment: {exc}") from exc
    body = _hex_bytes(msgspec.to_builtins(signed.record, builtin_types=(bytes,)))
    print(
        json.dumps(
            {"experiment_id": signed.record_id, "signer": signed.signer_id, "manifest": body},
            indent=2,
        )
    )
    return 0
