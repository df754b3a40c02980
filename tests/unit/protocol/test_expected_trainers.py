"""A window closes early once every expected trainer reported (at or above min_updates),
and says what it waits for: the participant driven by hand, with its own clock."""

from __future__ import annotations

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.core.envelope import Signed
from p2ptrain.core.records import Update
from p2ptrain.core.tensors import schema_of
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.policy import ParticipantPolicy
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from tests.support.builders import identity, synthetic_experiment

WORKLOAD = SyntheticWorkload(seed=3)
VALIDATOR = identity(0)
MANIFEST = synthetic_experiment(WORKLOAD, VALIDATOR.public_key, max_updates=3, min_updates=2)
GENESIS = WORKLOAD.genesis()
TRAINERS = [identity(20 + n) for n in range(3)]
TIMEOUT_S = 5.0


def _update(n: int) -> tuple[Signed[Update], bytes]:
    machine = TrainerMachine(MANIFEST, TRAINERS[n], GENESIS)
    (train,) = machine.start(0.0)
    assert isinstance(train, act.Train)
    delta, before, after = WORKLOAD.train(GENESIS, machine.lease(1), n, 1)
    blob = bytes(make_encoder(MANIFEST.codec, schema_of(GENESIS)).encode(delta))
    sent = machine.finish(train.window, train.base_head, blob, before, after, now=0.5)
    (update,) = [a for a in sent if isinstance(a, act.SendUpdate)]
    return update.update, blob


UPDATES = [_update(n) for n in range(3)]


def _validator(
    presence_timeout_s: float | None = TIMEOUT_S, reducers: tuple[bytes, ...] = ()
) -> Participant:
    machine = Participant(
        MANIFEST,
        VALIDATOR,
        GENESIS,
        validator=True,
        reducers=reducers,
        now=0.0,
        presence_timeout_s=presence_timeout_s,
    )
    for trainer in TRAINERS:
        machine.heard_from(trainer.public_key, 0.0)
    # as if all three reported in the window before (here: the first has none)
    machine.presence.reporters_before = {t.public_key for t in TRAINERS}
    return machine


def _proposed(actions: list[act.Action]) -> bool:
    return any(isinstance(a, act.SendProposal) for a in actions)


def _deliver(machine: Participant, n: int, now: float) -> list[act.Action]:
    signed, blob = UPDATES[n]
    return machine.receive_update(now, signed, blob)


def test_a_window_closes_once_the_silent_trainer_is_no_longer_expected() -> None:
    machine = _validator()
    assert not _proposed(_deliver(machine, 0, 1.0) + _deliver(machine, 1, 2.0))
    silent = TRAINERS[2].peer_id[:12]
    line = machine.waiting_for(2.0)
    # the deadline runs from the first update (at 1.0)
    assert line.startswith("window 1: 2 of 3 expected updates (min 2), deadline in 99 s")
    assert line.endswith(f"waiting for trainers {silent}")
    # it wakes when the silent trainer's presence lapses, long before the deadline
    wakeup = machine.next_wakeup(2.0)
    assert TIMEOUT_S < wakeup < TIMEOUT_S + 0.1
    assert not _proposed(machine.tick(4.0))  # still expected
    assert _proposed(machine.tick(wakeup))
    assert machine.window == 2  # one validator: its own vote certified window 1


def test_a_live_trainer_keeps_the_window_open_until_its_deadline() -> None:
    machine = _validator()
    _deliver(machine, 0, 1.0)
    _deliver(machine, 1, 2.0)
    for now in (4.0, 8.0, 12.0, 50.0, 99.0, 100.0):
        machine.heard_from(TRAINERS[2].public_key, now)  # alive, but slow
        assert not _proposed(machine.tick(now + 0.5)), now
    assert _proposed(machine.tick(101.0))  # the deadline: 100 s after the first update


def test_the_last_expected_update_closes_the_window_at_once() -> None:
    machine = _validator()
    _deliver(machine, 0, 1.0)
    _deliver(machine, 1, 2.0)
    assert _proposed(_deliver(machine, 2, 3.0))  # also full, but not only: see below
    machine = _validator()
    machine.presence.heard.pop(TRAINERS[2].public_key)  # only two trainers were ever heard from
    _deliver(machine, 0, 1.0)
    assert _proposed(_deliver(machine, 1, 2.0))


def test_a_trainer_nobody_saw_report_before_is_not_waited_for() -> None:
    machine = _validator()
    stranger = identity(40).public_key  # a peer record says "trainer", nothing more
    machine.heard_from(stranger, 1.0)
    _deliver(machine, 0, 1.0)
    _deliver(machine, 1, 2.0)
    line = machine.waiting_for(2.0)
    assert line.endswith(f"waiting for trainers {TRAINERS[2].peer_id[:12]}"), line
    assert _proposed(machine.tick(TIMEOUT_S + 0.1))  # the silent third lapsed; not the stranger
    nobody_before = _validator()
    nobody_before.presence.reporters_before = set()  # the first window, or just restarted
    _deliver(nobody_before, 0, 1.0)
    _deliver(nobody_before, 1, 2.0)
    assert not _proposed(nobody_before.tick(50.0))


def test_no_early_close_below_min_updates_or_without_presence() -> None:
    lone = _validator()
    for trainer in TRAINERS[1:]:
        lone.presence.heard.pop(trainer.public_key)
    _deliver(lone, 0, 1.0)  # the only expected trainer reported, but min_updates is 2
    assert not _proposed(lone.tick(10.0))
    assert lone.waiting_for(10.0).startswith("window 1: 1 of 1 expected updates (min 2)")
    blind = _validator(presence_timeout_s=None)
    _deliver(blind, 0, 1.0)
    _deliver(blind, 1, 2.0)
    assert not _proposed(blind.tick(50.0))
    assert blind.waiting_for(50.0) == "window 1: 2 updates (min 2, max 3), deadline in 51 s"
    assert _proposed(blind.tick(101.0))


def test_after_the_deadline_it_names_the_proposal_it_waits_for() -> None:
    reducer = identity(1)  # reducers propose first, validators after them
    machine = _validator(reducers=(reducer.public_key,))
    _deliver(machine, 0, 1.0)
    _deliver(machine, 1, 2.0)
    assert not _proposed(machine.tick(101.0))
    assert machine.waiting_for(101.5) == (
        f"window 1: waiting for a proposal from {reducer.peer_id[:12]}"
    )
    empty = _validator(reducers=(reducer.public_key,))
    empty.tick(100.0)
    assert empty.waiting_for(100.5).startswith("window 1: no update arrived by the deadline")


def test_a_trainer_whose_update_came_after_its_window_closed_is_expected_next() -> None:
    machine = _validator()
    newcomer = TRAINERS[2]
    machine.presence.reporters_before = {t.public_key for t in TRAINERS[:2]}  # it just joined
    machine.presence.heard.pop(newcomer.public_key)
    _deliver(machine, 0, 1.0)
    assert _proposed(_deliver(machine, 1, 2.0))  # every expected trainer reported
    assert machine.window == 2
    # its update for window 1 came late: announced (the policy fetches no blob for it)
    effects = ParticipantPolicy(machine).record(2.5, UPDATES[2][0], len(UPDATES[2][1]))
    assert effects == []
    line = machine.waiting_for(2.5)
    assert line.startswith("window 2: 0 of 3 expected updates"), line
    assert newcomer.peer_id[:12] in line
