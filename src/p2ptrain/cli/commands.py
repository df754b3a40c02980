"""Every command: the module that defines its options and runs it, and its summary.

``p2ptrain COMMAND`` imports only COMMAND's module; the other commands are listed by name
and summary (pip keeps its commands the same way). ``--version`` and ``--help`` therefore
import no command module at all, and ``status --help`` only the node commands'.
A module's commands are consecutive here: ``--help`` lists them in this order.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple


class Command(NamedTuple):
    module: str
    summary: str


_NODE = "node_commands"
COMMANDS: dict[str, Command] = {
    "demo": Command(
        "demo_command", "run a whole local network training a real model (about 5 minutes)"
    ),
    "init": Command("identity_commands", "create a data directory with a new identity"),
    "identity": Command(
        "identity_commands", "print the peer id and public key of a data directory"
    ),
    "node": Command(
        _NODE, "run a node holding one or more roles (--role trainer --role validator)"
    ),
    "seed": Command(_NODE, "run a seed: entry point, relay and blob cache; creates a network"),
    "train": Command(_NODE, "train windows of an experiment and publish updates"),
    "validate": Command(_NODE, "re-check every window and attest the next canonical head"),
    "reduce": Command(_NODE, "aggregate each window's updates and propose the next head"),
    "view": Command(_NODE, "follow the certified chain and keep the canonical model (to export)"),
    "status": Command(_NODE, "show a node's peers, head height and last window"),
    "export": Command(_NODE, "write the canonical model as safetensors with its config"),
    "evaluate": Command(
        _NODE, "evaluate a certified head locally and compare with the evaluators' reports"
    ),
    "admit": Command(
        "admission_commands", "sign a peer's admission certificate to a certificate network"
    ),
    "revoke": Command("admission_commands", "withdraw a peer's admission: every node cuts it off"),
    "issuer": Command(
        "issuer_commands",
        "run a certificate network's issuing service (OIDC, OAuth, GitHub sign-in)",
    ),
    "sign-in": Command(
        "issuer_commands", "sign in at a network's issuer: this node's key gets its certificate"
    ),
    "invite": Command("issuer_commands", "print an invite that admits newcomers in one command"),
    "join": Command("issuer_commands", "join a certificate network with an invite and train"),
    "dashboard": Command(
        "dashboard_command", "serve the live dashboard of a node's data directory"
    ),
    "experiment": Command("experiment_commands", "create and inspect signed experiment manifests"),
    "bench": Command("bench_commands", "run a benchmark"),
    "sim": Command(
        "sim_commands", "simulate a whole network (virtual time) on the real protocol code"
    ),
    "data": Command("data_commands", "prepare a dataset as shard files that peers fetch by hash"),
    "cluster": Command(
        "cluster_command",
        "train with the machines of your LAN as one synchronous cluster (mDNS, DDP)",
    ),
}


def add_command(commands: Any, name: str, **options: Any) -> argparse.ArgumentParser:
    """The parser of command ``name``, its help the summary above."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=COMMANDS[name].summary, **options
    )
    return parser


def summary(name: str) -> str:
    return COMMANDS[name].summary
