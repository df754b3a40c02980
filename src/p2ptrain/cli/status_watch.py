"""``p2ptrain status --watch``: the facts of ``p2ptrain status`` as a live terminal view.

:func:`render_status` turns a :class:`NodeStatus` into a rich renderable and
:func:`render_waiting` says why there is none (yet); both are pure. :func:`watch_status`
is the loop: read the status (a data directory's ``status.json`` or a node's
``/v1/status``, whatever ``read`` does), show it, sleep, again. A target that cannot be read
(the node is not up yet, is unreachable, or is writing its file) is shown inside the view
and asked again at the next interval; it never ends the loop. :func:`run_watch` runs the
loop in a :class:`rich.live.Live` until Ctrl-C.

Every text a node or its peers wrote (reasons, error messages, peer ids) is shown as plain
text, never read as rich markup: a peer's reason "[red]..." is printed as it is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from p2ptrain.cli.status_text import (
    admission_rows,
    mib,
    store_text,
    tallies,
    validation_text,
)
from p2ptrain.errors import P2PTrainError
from p2ptrain.observe.status import NodeStatus

__all__ = ["MIN_INTERVAL_S", "render_status", "render_waiting", "run_watch", "watch_status"]

#: The shortest interval between two reads of the target.
MIN_INTERVAL_S = 1.0
#: How many recent role errors and peer reports the view lists.
RECENT = 5


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def _facts(status: NodeStatus) -> Table:
    """The one-line facts, as a two-column grid: a label, then plain text."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")

    def row(label: str, text: str, style: str = "") -> None:
        grid.add_row(label, Text(text, style=style))

    row("peer", f"{status.peer_id[:16]}  roles {', '.join(status.roles)}  pid {status.pid}")
    row("address", status.address or "outbound only")
    row("experiment", status.experiment_id)
    adopting = ""
    if status.adopted_head_id != status.head_id:
        adopting = f" (roles still on {status.adopted_head_id[:12]}: fetching its weights)"
    row("height", f"{status.height}  head {status.head_id[:16]}{adopting}")
    last = status.last_window
    if last is not None:
        row(
            "last window",
            f"{last.height}: {last.accepted} accepted, {last.quarantined} quarantined in "
            f"{last.seconds:.1f} s ({last.reason})",
        )
    if status.open_window is not None:
        row("open window", f"{status.open_window.window}: {status.open_window.reason or '-'}")
    links = status.connections
    row(
        "peers",
        f"{status.peers} known, {status.banned} banned; connections {links.outbound} out, "
        f"{links.inbound} in",
    )
    for label, text in admission_rows(status):
        row(label, text)
    counted = "TCP, as the kernel counted it" if status.wire_measured else "node counters"
    row(
        "traffic",
        f"{mib(status.bytes_sent)} sent, {mib(status.bytes_received)} received ({counted})",
    )
    if status.validation is not None:
        row("val loss", validation_text(status.validation))
    if status.trainer is not None:
        t = status.trainer
        busy = ""
        if t.compute_utilisation is not None:
            busy = f"; utilisation {100 * t.compute_utilisation:.0f} %"
        row(
            "trained",
            f"window {t.window}: loss {t.loss_before:.3f} -> {t.loss_after:.3f} in "
            f"{t.seconds:.1f} s; update {mib(t.blob_bytes)}{busy}",
        )
    if status.data is not None:
        d = status.data
        held = f"; {d.shards_held} shards held ({mib(d.bytes_held)})" if d.shards_held else ""
        row("data", f"{d.kind}: {d.descriptor}{held}")
    row("store", store_text(status), "yellow" if status.collect_failures else "")
    for label, text in tallies(status):
        row(label, text)
    return grid


def _roles(status: NodeStatus) -> Table:
    table = Table(title="roles", title_justify="left", expand=True)
    table.add_column("role", no_wrap=True)
    table.add_column("last reason", overflow="fold", ratio=1)
    table.add_column("failures in a row", justify="right", no_wrap=True)
    for role in status.role_states:
        failing = role.failures_in_a_row
        table.add_row(
            Text(role.role),
            Text(role.last_reason),
            Text(str(failing), style="bold red" if failing else "green"),
        )
    return table


def _errors(status: NodeStatus) -> Table:
    table = Table(title="recent role errors", title_justify="left", expand=True)
    table.add_column("at", no_wrap=True)
    table.add_column("role", no_wrap=True)
    table.add_column("error", overflow="fold", ratio=1)
    for error in status.errors[-RECENT:]:
        table.add_row(Text(_clock(error.at)), Text(error.role), Text(error.describe(), "red"))
    return table


def _reports(status: NodeStatus) -> Table:
    table = Table(title="recent peer reports", title_justify="left", expand=True)
    table.add_column("peer", no_wrap=True)
    table.add_column("reason", overflow="fold", ratio=1)
    for report in status.reports[-RECENT:]:
        table.add_row(Text(report.peer[:16]), Text(report.reason, "yellow"))
    return table


def render_status(status: NodeStatus, *, target: str, now: float) -> RenderableType:
    """The live view of ``status``, read from ``target`` at unix time ``now``."""
    parts: list[RenderableType] = [_facts(status)]
    if status.role_states:
        parts.append(_roles(status))
    if status.errors:
        parts.append(_errors(status))
    if status.reports:
        parts.append(_reports(status))
    if status.storage is not None:
        storage = status.storage
        parts.append(
            Panel(
                Text(
                    f"{storage.message} ({storage.failures} writes failed since "
                    f"{_clock(storage.since)}; at {storage.path})"
                ),
                title="STORAGE",
                border_style="red",
            )
        )
    if status.failed:
        parts.append(Panel(Text(status.failed), title="FAILED", border_style="red"))
    title = Text(f"p2ptrain status {target}", style="bold")
    return Panel(Group(*parts), title=title, subtitle=_subtitle(now), title_align="left")


def render_waiting(
    *, target: str, reason: str, now: float, last: NodeStatus | None = None
) -> RenderableType:
    """What the view shows while ``target`` cannot be read: why, and the last status it
    read (if any) below it."""
    waiting = Text(f"waiting for {target}: {reason}", style="yellow")
    if last is None:
        body: RenderableType = waiting
    else:
        body = Group(waiting, Text("last status read:", style="dim"), _facts(last))
    title = Text(f"p2ptrain status {target}", style="bold")
    return Panel(body, title=title, subtitle=_subtitle(now), title_align="left")


def _subtitle(now: float) -> Text:
    return Text(f"at {_clock(now)}; Ctrl-C to stop", style="dim")


def watch_status(
    read: Callable[[], NodeStatus],
    show: Callable[[RenderableType], None],
    *,
    target: str,
    interval_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Read ``target`` with ``read`` and ``show`` its view, every ``interval_s`` seconds,
    until ``stop()`` is true after a round (never, by default: Ctrl-C ends it). A read
    that fails is shown as waiting, with the last status read, and tried again."""
    last: NodeStatus | None = None
    while True:
        try:
            last = read()
        except (P2PTrainError, OSError) as exc:
            show(render_waiting(target=target, reason=str(exc), now=clock(), last=last))
        else:
            show(render_status(last, target=target, now=clock()))
        if stop():
            return
        sleep(interval_s)


def run_watch(
    read: Callable[[], NodeStatus], *, target: str, interval_s: float, console: Console
) -> int:
    """Run :func:`watch_status` in a live view on ``console`` until Ctrl-C; exit code 0."""
    from rich.live import Live

    first = render_waiting(target=target, reason="reading it...", now=time.time())
    # Ctrl-C is the way to stop watching: not an error
    with (
        Live(first, console=console, auto_refresh=False) as live,
        contextlib.suppress(KeyboardInterrupt),
    ):
        watch_status(
            read,
            lambda view: live.update(view, refresh=True),
            target=target,
            interval_s=interval_s,
        )
    return 0
