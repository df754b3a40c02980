"""The role runners without a network: failures that show (recorded per window, a
role error event each, the node ended after N in a row, the cause kept), the typed events
and status records, and the role interface every machine offers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from p2ptrain.core.manifests import ExperimentManifest, NetworkManifest
from p2ptrain.driver.failures import FailureBook, RoleFailed
from p2ptrain.driver.runner import RoleRunner
from p2ptrain.driver.services import PeerServices
from p2ptrain.driver.storage import StorageHealth
from p2ptrain.errors import LocalError, ProtocolViolation, TransportError
from p2ptrain.net.node import NetNode
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.transport import NetTransport
from p2ptrain.observe.events import (
    HeadAdopted,
    NodeEvent,
    Ready,
    RoleFailure,
    decode_event,
    encode_event,
)
from p2ptrain.observe.status import (
    NodeStatus,
    RoleError,
    decode_status,
    encode_status,
    read_status,
)
from p2ptrain.protocol.follower import Follower, FollowerStatistics
from p2ptrain.protocol.intake import ACCEPTED
from p2ptrain.protocol.participant import Participant, ParticipantStatistics
from p2ptrain.protocol.role import RoleMachine
from p2ptrain.protocol.trainer import TrainerMachine, TrainerStatistics
from p2ptrain.sim.workloads import SyntheticWorkload
from p2ptrain.store.datadir import DataDir
from tests.support.builders import h, identity, synthetic_experiment


def _manifest(workload: SyntheticWorkload) -> ExperimentManifest:
    return synthetic_experiment(workload, identity(0).public_key, max_updates=2)


def test_every_machine_offers_the_role_interface() -> None:
    workload = SyntheticWorkload(seed=1)
    manifest, genesis = _manifest(workload), workload.genesis()
    machines: list[tuple[RoleMachine, type]] = [
        (Follower(manifest, identity(5), genesis), FollowerStatistics),
        (TrainerMachine(manifest, identity(6), genesis), TrainerStatistics),
        (
            Participant(manifest, identity(0), genesis, validator=True, reducers=(), now=0.0),
            ParticipantStatistics,
        ),
    ]
    for machine, statistics in machines:
        stats = machine.statistics()
        assert isinstance(stats, statistics) and stats.last_reason == machine.last_reason
        assert machine.tick(1.0) == [] or isinstance(machine, Participant)
    assert machines[0][0].next_wakeup(1.0) is None  # a follower only moves on inputs
    assert machines[2][0].next_wakeup(1.0) == pytest.approx(100.0)  # the deadline


def test_failures_in_a_row_end_a_role_and_a_success_clears_them() -> None:
    book = FailureBook(limit=3)
    book.failed("trainer", 4, "training", TypeError("bad batch"))
    book.failed("trainer", 5, "training", TypeError("bad batch"))
    assert book.in_a_row("trainer") == 2 and book.exhausted("trainer") is None
    book.succeeded("trainer")
    assert book.in_a_row("trainer") == 0
    book.failed("validator", 6, "tick", KeyError("x"))  # another role counts apart
    for window in (7, 8, 9):
        book.failed("trainer", window, "training", ValueError(f"loss in {window}"))
    fatal = book.exhausted("trainer")
    assert isinstance(fatal, RoleFailed) and isinstance(fatal, LocalError)
    message = str(fatal)
    assert "the trainer role failed 3 times in a row (windows 7, 8, 9)" in message
    assert "last error in window 9 while training: ValueError: loss in 9" in message
    assert "--max-role-failures" in message and fatal.exit_code == 3
    assert [e.window for e in book.recent] == [4, 5, 6, 7, 8, 9]
    with pytest.raises(LocalError, match="use 1 or more"):
        FailureBook(limit=0)


def _runner(tmp_path: Path, events: list[NodeEvent]) -> tuple[RoleRunner, DataDir]:
    workload = SyntheticWorkload(seed=1)
    manifest = _manifest(workload)
    datadir = DataDir(tmp_path).__enter__()
    store = NodeStore(datadir)
    network = NetworkManifest(name="roles-test", authority=identity(5).public_key)
    net = NetNode(identity=identity(5), network=network, blobs=store.blobs)
    services = PeerServices(
        net=NetTransport(net, store.blobs, fetch_timeout_s=5.0),
        identity=identity(5),
        store=store,
        storage=StorageHealth(str(tmp_path)),
        experiment_id=manifest.id,
        bootstrap=(),
        keeps_records=True,
        emit=events.append,
        admit=lambda signed: ACCEPTED,
        on_adopted=lambda machine, adopted: None,
    )
    follower = Follower(manifest, identity(5), workload.genesis())
    return RoleRunner("viewer", follower, services, FailureBook(limit=3), events.append), datadir


def test_a_role_records_each_failure_and_ends_after_three_in_a_row(tmp_path: Path) -> None:
    events: list[NodeEvent] = []
    runner, datadir = _runner(tmp_path, events)

    async def failing_steps() -> None:
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(0)  # the runner's task group is open
        with runner.guard("a flaky step"):
            raise TransportError("reset by peer")  # a network fault: not the role's failure
        with runner.guard("checking a blob"):
            raise ProtocolViolation("bad hash")  # a peer's bad bytes: not the role's either
        assert runner.failures.in_a_row("viewer") == 0
        for n in range(3):
            with runner.guard("handling a certificate"):
                raise RuntimeError(f"bug {n}")
        with pytest.raises(RoleFailed) as caught:
            await asyncio.wait_for(task, 5)
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert str(caught.value.__cause__) == "bug 2"

    try:
        asyncio.run(failing_steps())
    finally:
        datadir.__exit__(None, None, None)
    failures = [e for e in events if isinstance(e, RoleFailure)]
    assert [(f.failures, f.limit, f.window, f.role) for f in failures] == [
        (1, 3, 1, "viewer"),
        (2, 3, 1, "viewer"),
        (3, 3, 1, "viewer"),
    ]
    assert failures[0].error == "RuntimeError" and failures[0].message == "bug 0"
    state = runner.state()
    assert state.failures_in_a_row == 3 and state.statistics["height"] == 0


def test_a_role_goes_on_after_a_failure_and_stops_when_cancelled(tmp_path: Path) -> None:
    events: list[NodeEvent] = []
    runner, datadir = _runner(tmp_path, events)

    async def one_failure() -> None:
        early_ran = asyncio.Event()

        async def early() -> None:
            early_ran.set()

        runner.spawn(early(), "before the start")  # kept until the role runs
        task = asyncio.create_task(runner.run())
        await asyncio.wait_for(early_ran.wait(), 5)
        with runner.guard("handling a certificate"):
            raise RuntimeError("once")
        with runner.guard("handling a certificate"):
            pass  # a success clears the count (a follower has no main step)
        assert runner.failures.in_a_row("viewer") == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        step_ran = []

        async def late() -> None:
            step_ran.append(True)

        runner.spawn(late(), "after the end")  # nothing new starts once the role ended
        await asyncio.sleep(0)
        assert not step_ran

    try:
        asyncio.run(one_failure())
    finally:
        datadir.__exit__(None, None, None)
    assert len([e for e in events if isinstance(e, RoleFailure)]) == 1


def test_events_and_status_are_typed_records_on_the_wire(tmp_path: Path) -> None:
    ready = Ready(peer_id="p" * 64, address=None, experiment_id=h("e"), height=3, roles=("seed",))
    line = encode_event(ready)
    assert line.startswith(b'{"event":"ready"') and decode_event(line) == ready
    adopted = HeadAdopted(
        peer_id="p", height=4, head_id=h("x"), accepted=2, quarantined=0, reason="r", seconds=1.5
    )
    assert decode_event(encode_event(adopted)) == adopted
    assert decode_event(b"not json") is None and decode_event(b'{"event":"nope"}') is None
    status = NodeStatus(
        peer_id="p",
        roles=("trainer", "validator"),
        address=None,
        experiment_id=h("e"),
        height=2,
        head_id=h("head"),
        adopted_head_id=h("head"),
        errors=(
            RoleError(
                role="trainer", window=2, step="training", error="TypeError", message="m", at=1.0
            ),
        ),
    )
    assert decode_status(encode_status(status), "here") == status
    assert status.errors[0].describe() == "window 2, training: TypeError: m"
    timed = msgspec.structs.replace(
        status,
        reduction_window=2,
        reduction_seconds=1.25,
        reduction_accepted=3,
        reductions_timed=4,
        reduction_seconds_total=5.5,
        peak_rss_mib=321.5,
    )
    assert decode_status(encode_status(timed), "here") == timed
    # a status written before the reduction's timing was kept reads without it
    older = {k: v for k, v in msgspec.to_builtins(timed).items() if "reduction" not in k}
    again = decode_status(msgspec.json.encode(older), "an older node")
    assert (again.reduction_seconds, again.reduction_window, again.reductions_timed) == (
        None,
        None,
        0,
    )
    with pytest.raises(LocalError, match="has no status file"):
        read_status(tmp_path)
    (tmp_path / "status.json").write_text('{"peer_id": 3}')
    with pytest.raises(LocalError, match="does not read as a p2ptrain node status"):
        read_status(tmp_path)
