"""The ``p2ptrain`` command. Only this package reads argv and the environment.

Only the module of the command being run is imported (:mod:`p2ptrain.cli.commands`); the
others are listed by name and summary, so ``--version`` and ``--help`` import no command
module. The command modules define their options with light imports only; torch, the
node's runtime, the simulator and the benchmarks are imported by the handlers that use them,
so the commands that only read files or ask a node (``status``, ``identity``,
``dashboard``, ``experiment show``, ``data show``) import none of them
(``tests/unit/cli/test_no_torch.py``). The handlers that aggregate install the C kernel
themselves (:func:`p2ptrain.store.kernel_build.ensure_kernel`). Where the log goes (stderr;
a node command's ``--log-file``) is set up by :mod:`p2ptrain.cli.logs` before a command runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from p2ptrain import __version__
from p2ptrain.cli.commands import COMMANDS
from p2ptrain.cli.logs import configure_logging
from p2ptrain.errors import LocalError, P2PTrainError

DEFAULT_DATA_DIR = "p2ptrain-data"


def default_data_dir() -> str:
    """``$P2PTRAIN_DIR`` if set, else ./p2ptrain-data."""
    return os.environ.get("P2PTRAIN_DIR") or DEFAULT_DATA_DIR


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of the command ``argv`` names, every other command only listed; without
    ``argv``, of every command."""
    parser = argparse.ArgumentParser(
        prog="p2ptrain",
        description="Train one PyTorch model together on many untrusted computers.",
        epilog="Run `p2ptrain COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log debug messages, and print the traceback of an error",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    data_dir = default_data_dir()
    named = COMMANDS.get(_command_named(argv) or "")
    for name, command in COMMANDS.items():
        if name in commands.choices:
            continue  # its module defined it with the command before
        if argv is None or (named is not None and command.module == named.module):
            module = importlib.import_module(f"p2ptrain.cli.{command.module}")
            module.add_parsers(commands, data_dir)
        else:
            commands.add_parser(name, help=command.summary)
    return parser


def _command_named(argv: Sequence[str] | None) -> str | None:
    """The command in ``argv``: its first word that is not an option (p2ptrain's own
    options take no value)."""
    return next((word for word in argv or () if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        configure_logging(args)  # stderr; and a node command's --log-file
        args.argv = list(argv)  # what a command that runs itself again (a pod) repeats
        code: int = handler(args)
    except P2PTrainError as exc:
        _report(exc, verbose=args.verbose)
        return exc.exit_code if isinstance(exc, LocalError) else 1
    except KeyboardInterrupt:
        print("p2ptrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `p2ptrain status | head`
        sys.stderr.close()
        return 0
    return code


def _report(exc: P2PTrainError, *, verbose: bool) -> None:
    """One plain line; under ``-v`` the traceback first (of the cause too: a workload
    factory's own file and line)."""
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"p2ptrain: error: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
