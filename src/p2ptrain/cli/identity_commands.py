"""``p2ptrain init`` and ``p2ptrain identity``: a node's data directory and key."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from p2ptrain.cli.commands import add_command
from p2ptrain.store.keyfile import create_identity, load_identity

if TYPE_CHECKING:
    from p2ptrain.core.identity import Identity


def add_parsers(commands: Any, data_dir: str) -> None:
    init = add_command(
        commands,
        "init",
        description="Create a data directory with a new Ed25519 identity (identity.key, "
        "mode 0600), an empty blob store and state database, and print the peer id. "
        "An existing identity is never overwritten.",
    )
    init.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    init.add_argument("--json", action="store_true", help="print JSON")
    init.set_defaults(handler=run_init)

    show = add_command(
        commands,
        "identity",
        description="Print the peer id and public key of an existing data directory.",
    )
    show.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(handler=run_identity)


def _print_identity(identity: Identity, data_dir: str, as_json: bool) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "peer_id": identity.peer_id,
                    "public_key": identity.public_key.hex(),
                    "data_dir": data_dir,
                }
            )
        )
    else:
        print(f"peer id:    {identity.peer_id}")
        print(f"public key: {identity.public_key.hex()}")
        print(f"data dir:   {data_dir}")


def run_init(args: argparse.Namespace) -> int:
    from p2ptrain.store.datadir import DataDir  # sqlite, for the new directory's layout

    identity = create_identity(args.dir)
    DataDir(args.dir).close()  # lay out blobs/ and node.db
    _print_identity(identity, args.dir, args.json)
    return 0


def run_identity(args: argparse.Namespace) -> int:
    _print_identity(load_identity(args.dir), args.dir, args.json)
    return 0
