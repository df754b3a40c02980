"""``p2ptrain status --watch``: the view of a status record, and the loop that reads it again."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from rich.console import Console, RenderableType

from p2ptrain.cli.node_commands import describe_status
from p2ptrain.cli.status_watch import render_status, render_waiting, watch_status
from p2ptrain.errors import LocalError
from p2ptrain.observe.status import (
    Connections,
    LastWindow,
    NodeStatus,
    OpenWindow,
    PeerReport,
    RoleError,
    RoleState,
    StorageProblem,
    TrainerWindow,
    ValidationMetrics,
    encode_status,
    read_status,
)

NOW = 1_700_000_000.0


def text_of(view: RenderableType) -> str:
    console = Console(record=True, width=100)
    console.print(view)
    return console.export_text()


def status(height: int = 7, **changes: object) -> NodeStatus:
    fields: dict[str, object] = {
        "peer_id": "ab" * 32,
        "roles": ("trainer", "validator"),
        "address": "http://127.0.0.1:7701",
        "experiment_id": "e1" * 32,
        "height": height,
        "head_id": "cd" * 32,
        "adopted_head_id": "cd" * 32,
        "peers": 6,
        "banned": 1,
        "connections": Connections(outbound=3, inbound=2),
        "last_window": LastWindow(
            height=height, head_id="cd" * 32, accepted=4, quarantined=1,
            reason="quorum of 2 attestations", seconds=12.5,
        ),
        "open_window": OpenWindow(window=height + 1, reason="waiting for updates"),
        "role_states": (
            RoleState(role="trainer", last_reason="published update", failures_in_a_row=0,
                      statistics={}),
            RoleState(role="validator", last_reason="recomputing the proposal",
                      failures_in_a_row=2, statistics={}),
        ),
        "errors": (
            RoleError(role="validator", window=height, step="recompute", error="RuntimeError",
                      message="out of memory", at=NOW - 5),
        ),
        "reports": (PeerReport(peer="ef" * 32, reason="update [red]too large[/red]"),),
        "trainer": TrainerWindow(
            window=height, loss_before=2.5, loss_after=2.25, seconds=9.0, blob_bytes=3 << 20,
            compute_utilisation=0.87,
        ),
        "bytes_sent": 5 << 20,
        "bytes_received": 12 << 20,
        "wire_measured": True,
        "store_blobs": 17,
        "store_bytes": 40 << 20,
        "keep_heads": 3,
        "validation": ValidationMetrics(
            height=height - 1, head_id="12" * 32, median_loss=1.2345, reports=2
        ),
    }  # fmt: skip
    fields.update(changes)
    return NodeStatus(**fields)  # type: ignore[arg-type]


def test_the_view_shows_every_fact_of_p2ptrain_status() -> None:
    text = text_of(render_status(status(), target="node-dir", now=NOW))
    for expected in (
        "p2ptrain status node-dir",
        "abababababababab",  # the peer id, shortened
        "trainer, validator",
        "http://127.0.0.1:7701",
        "height",
        "7  head cdcdcdcdcdcdcdcd",
        "4 accepted, 1 quarantined in 12.5 s (quorum of 2 attestations)",
        "8: waiting for updates",
        "6 known, 1 banned; connections 3 out, 2 in",
        "5.0 MiB sent, 12.0 MiB received (TCP, as the kernel counted it)",
        "1.2345 at height 6",
        "median of 2 reports",
        "loss 2.500 -> 2.250 in 9.0 s",
        "utilisation 87 %",
        "17 blobs, 40.0 MiB; keeps the last 3 heads' blobs",
        "published update",
        "recomputing the proposal",
        "window 7, recompute: RuntimeError: out of memory",
        "efefefefefefefef",
    ):
        assert expected in text, expected
    # a role's failures in a row sit on its row
    validator_row = next(line for line in text.splitlines() if "recomputing" in line)
    assert "2" in validator_row.split("recomputing the proposal")[1]
    # a peer's reason is shown as it was written, never read as markup
    assert "update [red]too large[/red]" in text
    assert "STORAGE" not in text
    assert "FAILED" not in text


def test_the_last_reduction_is_shown_in_seconds_with_its_window() -> None:
    timed = status(
        reduction_window=7,
        reduction_seconds=1.2345,
        reduction_accepted=4,
        reductions_timed=3,
        reduction_seconds_total=3.614,
        peak_rss_mib=812.25,
    )
    line = (
        "last took 1.234 s (window 7, 4 updates accepted); 3 reductions in 3.61 s since the "
        "node started"
    )
    watched = text_of(render_status(timed, target="n", now=NOW))
    assert "reduction    last took 1.234 s (window 7, 4 updates accepted); 3 reductions" in watched
    assert f"reduction  {line}" in describe_status(timed)
    assert any("peak memory 812.2 MiB" in shown for shown in describe_status(timed))
    once = status(
        reduction_window=1, reduction_seconds=0.5, reduction_accepted=1, reductions_timed=1,
        reduction_seconds_total=0.5,
    )  # fmt: skip
    assert (
        "reduction  last took 0.500 s (window 1, 1 update accepted); 1 reduction in 0.50 s "
        "since the node started"
    ) in describe_status(once)
    # a node that has not reduced (a trainer, or before its first reduction) says nothing
    assert not any(shown.startswith("reduction") for shown in describe_status(status()))
    assert "last took" not in text_of(render_status(status(), target="n", now=NOW))


def test_storage_problems_and_a_failed_node_are_shown() -> None:
    problem = StorageProblem(path="/data/blobs", message="the disk is full", since=NOW,
                             failures=3)  # fmt: skip
    text = text_of(
        render_status(
            status(storage=problem, failed="validator failed 3 times in a row", errors=()),
            target="http://10.0.0.1:7700",
            now=NOW,
        )
    )
    assert "STORAGE" in text
    assert "the disk is full (3 writes failed since" in text
    assert "FAILED" in text
    assert "validator failed 3 times in a row" in text
    assert "recent role errors" not in text


def test_a_node_without_roles_reports_or_trainer_shows_what_it_has() -> None:
    bare = status(
        role_states=(), errors=(), reports=(), trainer=None, validation=None,
        last_window=None, open_window=None, address=None, wire_measured=False, keep_heads=None,
    )  # fmt: skip
    text = text_of(render_status(bare, target="seed", now=NOW))
    assert "outbound only" in text
    assert "(node counters)" in text
    assert "every blob (archive)" in text
    for absent in ("last reason", "trained", "val loss", "recent peer reports", "last window"):
        assert absent not in text, absent


def test_waiting_says_for_what_and_why_and_keeps_the_last_status() -> None:
    text = text_of(render_waiting(target="http://s:7700", reason="connection refused", now=NOW))
    assert "waiting for http://s:7700: connection refused" in text
    last = status(height=41)
    text = text_of(render_waiting(target="node", reason="no status file", now=NOW, last=last))
    assert "waiting for node: no status file" in text
    assert "41  head cdcd" in text


def test_the_loop_reads_the_data_directory_again_each_interval(tmp_path: Path) -> None:
    """No status file yet (waiting, not fatal), then the node writes one, then a newer one:
    each round shows what the directory holds at that moment."""
    shown: list[str] = []
    slept: list[float] = []
    # what the node writes during each sleep, in order
    writes = [status(height=3), status(height=4)]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        (tmp_path / "status.json").write_bytes(encode_status(writes.pop(0)))

    watch_status(
        lambda: read_status(tmp_path),
        lambda view: shown.append(text_of(view)),
        target=str(tmp_path),
        interval_s=2.0,
        sleep=sleep,
        clock=lambda: NOW,
        stop=lambda: len(shown) == 3,
    )
    assert slept == [2.0, 2.0]
    assert f"waiting for {tmp_path}" in shown[0]
    assert "has no status file" in shown[0]
    assert "3  head cdcd" in shown[1]
    assert "4  head cdcd" in shown[2]
    assert "3  head cdcd" not in shown[2]


def test_a_target_that_goes_away_is_waited_for_with_its_last_status() -> None:
    answers: list[NodeStatus | Exception] = [
        status(height=9),
        LocalError("cannot get the status of http://s:7700: connection refused"),
        status(height=10),
    ]
    shown: list[str] = []

    def read() -> NodeStatus:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    watch_status(
        read,
        lambda view: shown.append(text_of(view)),
        target="http://s:7700",
        interval_s=1.0,
        sleep=lambda seconds: None,
        clock=lambda: NOW,
        stop=lambda: len(shown) == 3,
    )
    assert not answers  # asked three times
    assert "9  head cdcd" in shown[0]
    assert "waiting for http://s:7700: cannot get the status" in shown[1]
    assert "9  head cdcd" in shown[1]  # the last status read, below
    assert "10  head cdcd" in shown[2]


def _status_args(**given: object) -> argparse.Namespace:
    fields: dict[str, object] = {
        "target": "nowhere", "secret_file": None, "json": False, "watch": False,
        "interval": None,
    }  # fmt: skip
    fields.update(given)
    return argparse.Namespace(**fields)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"watch": True, "json": True}, "--watch shows a live view and --json prints one"),
        ({"watch": True, "interval": 0.5}, "--interval 0.5: use 1 second or more"),
        ({"watch": True, "interval": float("nan")}, "--interval nan: use 1 second or more"),
        ({"watch": True, "interval": float("inf")}, "--interval inf: use 1 second or more"),
        ({"interval": 3.0}, "add --watch"),
    ],
)
def test_status_refuses_watch_with_json_and_a_short_interval(
    given: dict[str, object], message: str
) -> None:
    from p2ptrain.cli.node_commands import run_status

    with pytest.raises(LocalError, match=message.replace(".", r"\.")):
        run_status(_status_args(**given))


def test_a_certificate_shows_who_it_names_its_renewal_and_why_a_renewal_fails() -> None:
    from p2ptrain.observe.status import Admission

    admission = Admission(
        issuer="7c" * 32, roles=("trainer",), not_after_ms=int(NOW * 1000) + 3_600_000,
        name="github:alice", renews_at="https://sign-in.example.org", renewed=2,
        renewal_problem="the issuer did not renew this node's certificate: sign in again",
    )  # fmt: skip
    text = text_of(render_status(status(admission=admission), target="node-dir", now=NOW))
    for expected in (
        "github:alice, trainer, expires",
        "at https://sign-in.example.org, renewed 2 time(s) since start",
        "FAILING: the issuer did not renew this node's certificate: sign in again",
    ):
        assert expected in text, expected
