"""Crashes in a running network of real processes: a seed, a reducer, 3 validators (quorum 2)
and 3 trainers lose a validator, then the reducer, then a trainer, each SIGKILLed in the
middle of a window, and certify the next windows without it; each killed node, started again
on its data directory, rejoins (it adopts heads certified after it came back), and at the end
every node holds the same head and weights.

One network plays the whole story (starting one costs some 20 s of a 2-core machine): the
module-scoped :class:`Story` plays its acts in order, each once, when a test first asks for
it, so each test checks one act and can run alone (it then plays the acts before its own).
An act that failed fails the tests of the acts after it, naming it. A killed node is started
again during the next outage, while windows are still being certified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from p2ptrain.core.identity import peer_id_of
from p2ptrain.core.records import Head, Proposal, Update
from tests.support.local_net import Net, check_one_tip, new_net, stored_chain, stored_records

pytestmark = pytest.mark.integration

#: Every trainer stops once it adopted this height, and the others are stopped there.
WINDOWS = 14
#: Windows left after the trainer came back, for it to train again.
TRAINER_WINDOWS_LEFT = 3
#: Two windows that wait for a killed trainer last the deadline (20 s) each.
TRAINER_OUTAGE_S = 75.0
OUTAGE_S = 40.0


@dataclass
class Outage:
    """One victim's time down and back, in heights the seed adopted."""

    victim: str
    #: the seed's height when the victim was killed
    killed_at: int
    #: the last height the victim adopted before it died
    victim_height: int
    #: the last window the victim published an update for (trainers)
    last_published: int = 0
    #: the seed's height when the victim was started again
    restarted_at: int = -1
    #: the seed's height when the restarted victim was ready
    ready_at: int = -1
    #: the first height the restarted victim adopted once ready
    rejoined_at: int = -1

    @property
    def down_from(self) -> int:
        """The first height certified surely without the victim: it could still vote on or
        propose (or, a trainer, publish an update for) the window after its last height."""
        return max(self.killed_at, self.victim_height) + 2

    def down(self) -> range:
        """The heights certified surely while the victim was down."""
        return range(self.down_from, self.restarted_at + 1)


@dataclass
class Story:
    net: Net
    outages: dict[str, Outage] = field(default_factory=dict)
    height: int = 0
    failed: str | None = None
    played: set[str] = field(default_factory=set)

    def play(self, act: str) -> None:
        """Play the acts up to ``act`` that were not played yet."""
        for name, run in ACTS:
            if self.failed is not None:
                pytest.fail(f"act {self.failed!r} failed before act {act!r}", pytrace=False)
            if name not in self.played:
                try:
                    run(self)
                except BaseException:
                    self.failed = name
                    raise
                self.played.add(name)
            if name == act:
                return

    def seed_height(self) -> int:
        return self.net.heights.get("seed", 0)

    def kill_mid_window(self, victim: str, publisher: Callable[[str], bool]) -> Outage:
        """Wait until a trainer that ``publisher(name)`` accepts publishes an update for the
        window after the seed's head, and kill ``victim`` then, with that window open."""
        net = self.net
        net.wait_event(
            f"an update for window {self.seed_height() + 1}",
            30,
            lambda name, e: (
                e["event"] == "published" and publisher(name) and e["window"] > self.seed_height()
            ),
        )
        killed_at = self.seed_height()
        net.kill(victim)
        # its events up to its end are in: every update it published is known
        last = max((int(e["window"]) for e in net.events("published", victim)), default=0)
        outage = Outage(victim, killed_at, net.heights.get(victim, 0), last)
        self.outages[victim] = outage
        return outage

    def wait_certified_without(self, outage: Outage, timeout_s: float) -> None:
        """Wait until the seed adopted the next windows: two more heights at least."""
        self.net.wait_height("seed", outage.down_from, timeout_s)

    def restart(self, victim: str) -> None:
        outage = self.outages[victim]
        outage.restarted_at = self.seed_height()
        self.net.restart(victim)
        outage.ready_at = self.seed_height()

    def wait_rejoined(self, victim: str, timeout_s: float) -> None:
        """Wait until the restarted victim adopts a head certified after it was ready."""
        outage = self.outages[victim]
        self.net.wait_height(victim, outage.ready_at + 1, timeout_s)
        outage.rejoined_at = self.net.heights[victim]


def act_validator(story: Story) -> None:
    net = story.net
    # a window without a trainer's update waits for its deadline (--no-early-close): the
    # killed trainer comes back before the others run out of windows
    net.launch(
        validators=3,
        reducers=1,
        trainers=3,
        quorum=2,
        min_updates=2,
        windows=WINDOWS,
        extra_args=["--no-early-close"],
    )
    net.wait_height("seed", 1, 40)
    outage = story.kill_mid_window("validator-0", lambda name: True)
    story.wait_certified_without(outage, OUTAGE_S)


def act_reducer(story: Story) -> None:
    outage = story.kill_mid_window("reducer-0", lambda name: True)
    story.restart("validator-0")
    story.wait_certified_without(outage, OUTAGE_S)
    story.wait_rejoined("validator-0", OUTAGE_S)


def act_trainer(story: Story) -> None:
    # the windows without its update close at their deadline
    outage = story.kill_mid_window("trainer-0", lambda name: name != "trainer-0")
    story.restart("reducer-0")
    story.wait_certified_without(outage, TRAINER_OUTAGE_S)
    story.wait_rejoined("reducer-0", TRAINER_OUTAGE_S)
    story.net.check(
        story.seed_height() <= WINDOWS - TRAINER_WINDOWS_LEFT,
        f"height {story.seed_height()} leaves too few windows for trainer-0: raise WINDOWS",
    )
    story.restart("trainer-0")
    story.wait_rejoined("trainer-0", OUTAGE_S)


def act_end(story: Story) -> None:
    story.height = story.net.finish(timeout_s=60)


ACTS: list[tuple[str, Callable[[Story], None]]] = [
    ("validator", act_validator),
    ("reducer", act_reducer),
    ("trainer", act_trainer),
    ("end", act_end),
]


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    net = new_net(Path(tmp_path_factory.mktemp("crashes")))
    played = Story(net)
    try:
        yield played
    finally:
        net.close()
        if played.failed is not None:
            print(f"act {played.failed!r} failed; the network:\n{net.diagnosis()}")


def accepted_at(net: Net, height: int) -> int:
    """How many updates the head certified at ``height`` accepts (as its adopters said)."""
    said = {int(e["accepted"]) for e in net.events("adopted") if e["height"] == height}
    net.check(len(said) == 1, f"the nodes that adopted height {height} said {said} updates")
    return said.pop()


def trainers_of(net: Net, head: Head, updates: dict[str, Update]) -> set[str]:
    """The peer ids of the trainers whose updates ``head`` accepts (the seed keeps every
    update it relayed)."""
    missing = [u[:12] for u in head.accepted if u not in updates]
    net.check(not missing, f"the seed lacks updates {missing} accepted at height {head.height}")
    return {peer_id_of(updates[u].trainer) for u in head.accepted}


def test_a_killed_validator_leaves_a_quorum(story: Story) -> None:
    story.play("validator")
    outage = story.outages["validator-0"]
    assert story.seed_height() >= outage.down_from >= outage.killed_at + 2
    # that validator-0 signed no certificate meanwhile: test_the_stored_chain_shows_who_...


def test_a_killed_reducer_leaves_the_proposing_to_the_validators(story: Story) -> None:
    story.play("reducer")
    outage = story.outages["reducer-0"]
    assert story.seed_height() >= outage.down_from >= outage.killed_at + 2
    # who proposed which head: test_the_stored_chain_shows_who_was_missing


def test_a_killed_trainer_does_not_stop_the_network(story: Story) -> None:
    story.play("trainer")
    net, outage = story.net, story.outages["trainer-0"]
    assert outage.restarted_at >= outage.down_from >= outage.killed_at + 2
    # the first window the victim had no update for closed at its deadline, without it
    first_without = outage.last_published + 1
    accepted = accepted_at(net, first_without)
    net.check(accepted == 2, f"window {first_without} accepted {accepted} updates, not 2")


def test_restarted_nodes_rejoin_and_every_node_ends_on_the_same_head(story: Story) -> None:
    story.play("end")
    net, height = story.net, story.height
    check_one_tip(net, height)
    # the restarted trainer trained again: heads after its restart accept its updates
    trainer = net.peer_ids["trainer-0"]
    updates = stored_records(net.data_dir("seed"), "update", Update)
    restarted_at = story.outages["trainer-0"].restarted_at
    rejoined = [
        head.height
        for head, _ in stored_chain(net.data_dir("seed"))
        if head.height > restarted_at and trainer in trainers_of(net, head, updates)
    ]
    net.check(bool(rejoined), f"no head after height {restarted_at} accepts trainer-0's update")


def test_the_stored_chain_shows_who_was_missing(story: Story) -> None:
    story.play("end")
    net = story.net
    seed = net.data_dir("seed")
    chain = {head.height: (head, certificate) for head, certificate in stored_chain(seed)}
    updates = stored_records(seed, "update", Update)
    proposals = list(stored_records(seed, "proposal", Proposal).values())
    key = {name: bytes.fromhex(net.network.identity(name)) for name in net.names("validator")}
    key["reducer-0"] = bytes.fromhex(net.network.identity("reducer-0"))

    trainer = net.peer_ids["trainer-0"]
    for height in story.outages["trainer-0"].down():
        head = chain[height][0]
        net.check(
            trainer not in trainers_of(net, head, updates),
            f"head {height} accepts an update of trainer-0, which was down",
        )
    for height in story.outages["reducer-0"].down():
        head = chain[height][0]
        proposers = {p.reducer for p in proposals if p.head.id == head.id}
        net.check(
            bool(proposers) and proposers <= {key[v] for v in net.names("validator")},
            f"head {height} was not proposed by validators alone while the reducer was down",
        )
    reducer_heads = [
        height
        for height, (head, _) in chain.items()
        if any(p.head.id == head.id and p.reducer == key["reducer-0"] for p in proposals)
    ]
    net.check(
        bool(reducer_heads) and min(reducer_heads) <= story.outages["reducer-0"].killed_at + 1,
        f"the reducer should propose the heads before it was killed: it proposed {reducer_heads}",
    )
    for height in story.outages["validator-0"].down():
        signers = {s.validator for s in chain[height][1].signatures}
        net.check(
            key["validator-0"] not in signers,
            f"validator-0 signed the certificate of height {height} while it was down",
        )
