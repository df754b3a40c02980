"""A full disk under a viewer: it keeps running, says so once, and resumes by itself.

A real network (a seed, a reducer, two validators with quorum 2, two trainers) certifies a
window every :data:`DEADLINE_S` seconds or so. A viewer runs with its data directory on a
small tmpfs the test mounts (as root; skipped otherwise). Once it follows the network, the
test fills the tmpfs with a file until a write fails. The viewer must keep running, report
the fault once in its log (no storm of tracebacks) and in ``p2ptrain status --json`` as
``storage``: an object with the ``path`` that failed and a ``message`` saying what to do
(``null`` while storage is fine). Once the file is deleted the viewer must resume by itself
and hold the network's height within two window deadlines. At the end every node, the
viewer included, holds one head with the same weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import NetworkManifest
from p2ptrain.errors import ProtocolViolation, TransportError
from p2ptrain.net.auth import ClientCredentials
from p2ptrain.net.client import PeerClient, fetch_network_manifest
from tests.support.liveness import certify, end_on_one_head, launch_paced
from tests.support.local_net import Net, new_net

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

DEADLINE_S = 4.0
TMPFS_SIZE = "8m"
#: Windows the network certifies while the viewer's disk is full.
FULL_WINDOWS = 2
#: Log lines that report the storage fault, and how many of them (and of tracebacks) a
#: viewer may write while its disk stays full.
FAULT_LINE = re.compile(r"no space|space left|enospc|errno 28|disk (is )?full|storage", re.I)
MAX_FAULT_LINES = 2
MAX_TRACEBACKS = 2


def _mount_tmpfs(path: Path) -> str | None:
    """Mount a small tmpfs at ``path``; return why not, or None when it is mounted."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    path.mkdir(parents=True, exist_ok=True)
    argv = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(path)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot mount a tmpfs: {exc}"
    return None if done.returncode == 0 else f"cannot mount a tmpfs: {done.stderr.strip()}"


def _unmount(path: Path) -> None:
    done = subprocess.run(["umount", str(path)], capture_output=True, check=False, timeout=30)
    if done.returncode != 0:  # still busy: detach it now, the kernel frees it when it can
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=30)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    net = new_net(tmp_path_factory.mktemp("full-disk"))
    disk = net.data_dir("viewer")
    reason = _mount_tmpfs(disk)
    if reason is not None:
        pytest.skip(reason)
    try:
        launch_paced(net, validators=2, deadline_s=DEADLINE_S)
        yield net
    finally:
        try:
            net.close()
        finally:
            _unmount(disk)


def fill(path: Path) -> int:
    """Write ``path`` until its file system is full; return the bytes written."""
    written = 0
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            while True:
                try:
                    written += os.write(descriptor, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(descriptor)
    return written


async def _ask_status(address: str) -> dict[str, Any]:
    network = open_envelope(await fetch_network_manifest(address), NetworkManifest)
    client = PeerClient(
        ClientCredentials(network.record, Identity.generate(), secret=None), timeout_s=5
    )
    try:
        async with client.request("GET", address, "/v1/status") as response:
            data: dict[str, Any] = json.loads(await response.read())
            return data
    finally:
        await client.close()


def asked_status(address: str) -> dict[str, Any] | None:
    """The node's status as it answers ``GET /v1/status`` (None if it does not answer)."""
    with contextlib.suppress(TransportError, ProtocolViolation, TimeoutError):
        return asyncio.run(asyncio.wait_for(_ask_status(address), 10))
    return None


def cli_status(net: Net, address: str) -> dict[str, Any]:
    """``p2ptrain status --json ADDRESS``."""
    argv = [sys.executable, "-m", "p2ptrain", "status", "--json", address]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    net.check(done.returncode == 0, f"{' '.join(argv)} failed: {done.stderr.strip()[-2000:]}")
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def test_a_full_disk_stops_a_viewer_for_as_long_as_it_is_full(net: Net) -> None:
    disk = net.data_dir("viewer")
    net.wait_height("seed", 1, 60)  # window 1 waits for the slow-starting trainers
    certify(net, net.names(), 1, 30, "everyone in step")
    net.start("viewer", "viewer", args=["--listen", "127.0.0.1:0"])
    net.wait_ready(["viewer"])
    address = net.network.nodes["viewer"].address
    assert address is not None
    net.wait_height("viewer", net.heights["seed"], 4 * DEADLINE_S)

    fine = asked_status(address) or {}  # checked last: what the fault does matters more

    filler = disk / "filler"
    written = fill(filler)
    full_at = net.heights["seed"]
    net.note(f"{disk} ({TMPFS_SIZE} tmpfs) filled with {written} bytes at height {full_at}")
    log_before = len(net.log("viewer"))

    said: dict[str, Any] = {}

    def storage_is(expected: type) -> bool:
        """Whether the viewer answers its status with a ``storage`` of that type."""
        status = asked_status(address)
        said.clear()
        said.update(status or {"no answer": None})
        return status is not None and "storage" in status and type(status["storage"]) is expected

    try:
        net.wait_until(
            f"the viewer's status to report its full disk as `storage` while the network "
            f"certifies {FULL_WINDOWS} windows",
            2 * DEADLINE_S + FULL_WINDOWS * 3 * DEADLINE_S,
            lambda: storage_is(dict) and net.heights["seed"] >= full_at + FULL_WINDOWS,
            poll_s=1.0,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nthe viewer's last status: {json.dumps(said)}") from None
    fault = cli_status(net, address).get("storage")
    net.check(
        isinstance(fault, dict)
        and str(fault.get("path", "")).startswith(str(disk))
        and bool(fault.get("message")),
        f"`p2ptrain status --json` should name the path that failed under {disk} and say what "
        f"to do: storage = {fault!r}",
    )
    lines = net.log("viewer")[log_before:]
    reports = [line for line in lines if FAULT_LINE.search(line)]
    tracebacks = [line for line in lines if "Traceback" in line]
    net.check(
        1 <= len(reports) <= MAX_FAULT_LINES and len(tracebacks) <= MAX_TRACEBACKS,
        f"over {net.heights['seed'] - full_at} windows with a full disk the viewer should log "
        f"the fault once (at most {MAX_FAULT_LINES} lines) and at most {MAX_TRACEBACKS} "
        f"tracebacks; it logged {len(reports)} and {len(tracebacks)}:\n" + "\n".join(reports[:10]),
    )

    filler.unlink()
    freed_at = time.monotonic()
    height = net.heights["seed"]
    net.note(f"filler deleted with the network at height {height}")
    net.wait(
        f"the viewer to resume by itself and adopt height {height} within two deadlines",
        2 * DEADLINE_S,
        lambda: net.heights.get("viewer", 0) >= height,
    )
    try:
        net.wait_until(
            "the viewer's status to say `storage: null` again",
            max(0.0, freed_at + 2 * DEADLINE_S - time.monotonic()),
            lambda: storage_is(type(None)),
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nthe viewer's last status: {json.dumps(said)}") from None
    net.check(
        "storage" in fine and fine["storage"] is None,
        f"the viewer's status should say `storage: null` before its disk filled: {fine}",
    )
    end_on_one_head(net, timeout_s=4 * DEADLINE_S)
