"""A child process running LanDiscovery and reporting on stdout as JSON lines.

Usage: ``python mdns_child.py NETWORK_ID PEER_ID [--interface IP]... [--tls] [--browse-only]``

It listens on a TCP port chosen by the kernel (port 0) so the announced port is real
(``--browse-only`` announces nothing: port 0), then prints ``{"event": "ready", "port": P}``,
``{"event": "found", "peer_id", "network_id", "address"}`` for every report, and
``{"event": "statistics", ...}`` whenever the statistics change. It stops cleanly (sending
mDNS goodbyes) when stdin closes or on SIGTERM, printing ``{"event": "stopped", ...}`` with
the final statistics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import socket

from p2ptrain.net.mdns import LanDiscovery, LanPeer
from tests.support.child_io import emit, wait_for_stdin_eof

STATISTICS_POLL_S = 0.05


async def report_statistics(discovery: LanDiscovery) -> None:
    last = None
    while True:
        statistics = discovery.statistics()
        if statistics != last:
            emit("statistics", **dataclasses.asdict(statistics))
            last = statistics
        await asyncio.sleep(STATISTICS_POLL_S)


async def main(args: argparse.Namespace) -> None:
    listener = socket.create_server(("0.0.0.0", 0))
    port = 0 if args.browse_only else listener.getsockname()[1]

    def found(peer: LanPeer) -> None:
        emit("found", **dataclasses.asdict(peer))

    discovery = LanDiscovery(
        network_id=args.network_id,
        peer_id=args.peer_id,
        port=port,
        interfaces=args.interface or None,
        tls=args.tls,
        on_found=found,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await discovery.start()
    emit("ready", port=port)
    async with asyncio.TaskGroup() as group:
        stdin_closed = group.create_task(wait_for_stdin_eof())
        stop_requested = group.create_task(stop.wait())
        reporter = group.create_task(report_statistics(discovery))
        await asyncio.wait([stdin_closed, stop_requested], return_when=asyncio.FIRST_COMPLETED)
        for task in (stdin_closed, stop_requested, reporter):
            task.cancel()
    await discovery.stop()
    listener.close()
    emit("stopped", **dataclasses.asdict(discovery.statistics()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("network_id")
    parser.add_argument("peer_id")
    parser.add_argument("--interface", action="append", default=[])
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--browse-only", action="store_true", help="announce nothing (port 0)")
    asyncio.run(main(parser.parse_args()))
