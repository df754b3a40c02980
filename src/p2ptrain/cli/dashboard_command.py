"""``p2ptrain dashboard --dir D``: the live dashboard of any node's data directory.

It serves the same page a running node serves at ``/`` (:mod:`p2ptrain.observe.dashboard`),
built from what the node keeps in ``D``: its status file, its window history and the peers
it knew. The page follows the files as the node rewrites them (every two seconds while it
runs); a stopped node's directory shows where it stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from p2ptrain.cli.commands import add_command

__all__ = ["add_parsers"]


def add_parsers(commands: Any, data_dir: str) -> None:
    parser = add_command(
        commands,
        "dashboard",
        description="Serve the dashboard (peers, certified chain, window timeline, loss and "
        "bytes) of the node whose data directory is given, read from the files it keeps; "
        "open the printed address in a browser.",
    )
    parser.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8450",
        help="HOST:PORT to serve on (default 127.0.0.1:8450; port 0: any free port)",
    )
    parser.set_defaults(handler=run_dashboard)


def run_dashboard(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_serve(Path(args.dir), args.listen))


async def _serve(data_dir: Path, where: str) -> int:
    import asyncio
    import contextlib
    import signal

    from p2ptrain.observe.dashboard import DataDirSnapshots, start_listener

    snapshots = DataDirSnapshots(data_dir)
    listener = await start_listener(where, snapshots, snapshots.metrics, option="--listen")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"dashboard of {data_dir} at {listener.address}/ (Ctrl-C to stop)", flush=True)
    try:
        await stop.wait()
    finally:
        await listener.stop()
    return 0
