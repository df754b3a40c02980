"""What a command group does when it is called without a subcommand."""

from __future__ import annotations

import argparse
import sys


def show_usage(parser: argparse.ArgumentParser) -> int:
    """Print the group's help to stderr; exit code 2, as for any usage error."""
    parser.print_help(sys.stderr)
    return 2
