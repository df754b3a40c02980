"""The pure parts of ``p2ptrain bench chaos``: the fault plan drawn from a seed, the store
verdicts, and the summary's arithmetic (hand-computed values)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from p2ptrain.bench.chaos import ChaosConfig, RunLog, play_fault
from p2ptrain.bench.chaos_plan import (
    AFTER_S,
    HOLD_S,
    JOINER,
    KINDS,
    LONG_RUN_BUDGET_S,
    MAX_FAULTS,
    NODES,
    REFERENCE_BUDGET_S,
    Fault,
    LongFaults,
    plan_faults,
    planned_seconds,
)
from p2ptrain.bench.chaos_report import (
    FaultOutcome,
    Replica,
    RunOutcome,
    diverged_replicas,
    lost_heads,
    percentile,
    summarize,
    summary_lines,
)

SEEDS = range(300)
WITHOUT_PARTITIONS = ("kill", "pause")


# -- the plan --------------------------------------------------------------------------------


def test_a_plan_is_a_function_of_its_seed() -> None:
    for seed in (0, 1, 17, 2**40):
        assert plan_faults(seed, kinds=KINDS) == plan_faults(seed, kinds=KINDS)
    plans = {plan_faults(seed, kinds=KINDS) for seed in range(20)}
    assert len(plans) == 20, "different seeds should draw different faults"


@pytest.mark.parametrize("kinds", [KINDS, WITHOUT_PARTITIONS, ("pause",), ("partition",)])
def test_every_plan_has_two_faults_or_more_of_the_kinds_given(kinds: tuple[str, ...]) -> None:
    for seed in SEEDS:
        faults = plan_faults(seed, kinds=kinds)
        assert 2 <= len(faults) <= MAX_FAULTS, (seed, faults)
        assert {f.kind for f in faults} == set(kinds), (seed, faults)


def test_every_kind_occurs_over_runs_even_short_ones() -> None:
    for seed in SEEDS:
        for budget in (1.0, 12.0, REFERENCE_BUDGET_S):
            assert {f.kind for f in plan_faults(seed, kinds=KINDS, budget_s=budget)} == set(KINDS)
    # without namespaces: never a partition
    assert all(
        f.kind != "partition" for seed in SEEDS for f in plan_faults(seed, kinds=WITHOUT_PARTITIONS)
    )


def test_victims_holds_and_gaps_stay_in_their_ranges() -> None:
    kinds_seen: dict[str, set[int]] = {kind: set() for kind in KINDS}
    for seed in SEEDS:
        for fault in plan_faults(seed, kinds=KINDS):
            assert fault.victims, fault
            assert len(fault.victims) < len(NODES), "a partition leaves someone on the other side"
            assert list(fault.victims) == [n for n in NODES if n in fault.victims], "node order"
            low, high = HOLD_S[fault.kind]
            assert low <= fault.hold_s <= high, fault
            assert AFTER_S[0] <= fault.after_s <= AFTER_S[1], fault
            kinds_seen[fault.kind].add(len(fault.victims))
    assert kinds_seen["kill"] == {1, 2}
    assert kinds_seen["pause"] == {1, 2}
    assert kinds_seen["partition"] == {1, 2, 3}


def test_the_budget_bounds_extra_faults_and_shortens_holds() -> None:
    for seed in SEEDS:
        faults = plan_faults(seed, kinds=KINDS, budget_s=40.0)
        # the three mandatory faults may exceed the budget; the extra ones may not
        if len(faults) > len(KINDS):
            assert planned_seconds(faults) <= 40.0, (seed, faults)
        short = plan_faults(seed, kinds=KINDS, budget_s=REFERENCE_BUDGET_S / 4)
        for fault in short:
            low, high = HOLD_S[fault.kind]
            assert fault.hold_s <= low + (high - low) / 4 + 0.01, fault


LONG = LongFaults(every=5, heights=300, victims=("validator-1", "trainer-0"))


def test_seeds_that_are_multiples_of_every_are_long_runs() -> None:
    assert [seed for seed in range(11, 21) if LONG.plays(seed)] == [15, 20]
    assert all(LongFaults(every=1).plays(seed) for seed in range(11, 21))
    assert not any(LongFaults(every=0).plays(seed) for seed in range(11, 21))
    assert not any(LongFaults(every=1, heights=0).plays(seed) for seed in range(11, 21))


def test_a_long_run_adds_one_outage_then_one_joiner_to_its_short_faults() -> None:
    for seed in SEEDS:
        faults = plan_faults(seed, kinds=KINDS, long=LONG)
        kinds = [f.kind for f in faults]
        if seed % 5:
            assert faults == plan_faults(seed, kinds=KINDS), "a short run's plan is unchanged"
            assert "outage" not in kinds and "join" not in kinds
            continue
        assert kinds.count("outage") == kinds.count("join") == 1, (seed, kinds)
        assert kinds.index("outage") < kinds.index("join"), "the joiner comes after the outage"
        short = [f for f in faults if f.kind in KINDS]
        assert 2 <= len(short) <= MAX_FAULTS and {f.kind for f in short} == set(KINDS)
        (outage,) = [f for f in faults if f.kind == "outage"]
        (join,) = [f for f in faults if f.kind == "join"]
        assert outage.victims in {("validator-1",), ("trainer-0",)}, outage
        assert join.victims == (JOINER,)
        assert outage.heights == join.heights == 300
        assert outage.hold_s == join.hold_s == 0.0
        assert AFTER_S[0] <= outage.after_s <= AFTER_S[1]
    long_seeds = [seed for seed in SEEDS if seed % 5 == 0]
    outages = {plan_faults(s, kinds=KINDS, long=LONG)[0].kind for s in long_seeds}
    assert "outage" in outages and "kill" in outages, "the outage goes anywhere in the run"
    victims = {f.victims for s in long_seeds for f in plan_faults(s, kinds=KINDS, long=LONG)
               if f.kind == "outage"}  # fmt: skip
    assert victims == {("validator-1",), ("trainer-0",)}


def test_a_long_runs_short_faults_fit_the_long_run_budget() -> None:
    for seed in range(0, 300, 5):
        short = [f for f in plan_faults(seed, kinds=KINDS, long=LONG) if f.kind in KINDS]
        for fault in short:
            low, high = HOLD_S[fault.kind]
            scale = LONG_RUN_BUDGET_S / REFERENCE_BUDGET_S
            assert fault.hold_s <= low + (high - low) * scale + 0.01, fault
        if len(short) > len(KINDS):
            assert planned_seconds(short) <= LONG_RUN_BUDGET_S


def test_long_faults_describe_themselves_in_heights() -> None:
    assert Fault("outage", ("validator-0",), 1.0, 0.0, heights=300).describe() == (
        "outage validator-0 for more than 300 heights"
    )
    assert Fault("join", (JOINER,), 1.0, 0.0, heights=300).describe() == (
        f"join {JOINER} after height 300"
    )
    assert Fault("kill", ("seed", "trainer-1"), 1.0, 2.25).describe() == (
        "kill seed+trainer-1 for 2.2 s"
    )


def test_a_plan_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="kinds"):
        plan_faults(0, kinds=())
    with pytest.raises(ValueError, match="kinds"):
        plan_faults(0, kinds=("flood",))
    with pytest.raises(ValueError, match="budget"):
        plan_faults(0, kinds=KINDS, budget_s=0)
    with pytest.raises(ValueError, match="0 or more"):
        LongFaults(every=-1)
    with pytest.raises(ValueError, match="victim"):
        LongFaults(victims=())


def test_planned_seconds_adds_gaps_and_holds() -> None:
    faults = plan_faults(3, kinds=KINDS)
    assert planned_seconds(faults) == pytest.approx(sum(f.after_s + f.hold_s for f in faults))
    assert planned_seconds(()) == 0


# -- percentiles ---------------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 50) == 5.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    # position (4 - 1) * 0.99 = 2.97: 3 + 0.97 * (4 - 3)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([10.0, 0.0], 25) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0], 100) == 3.0
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


# -- store verdicts ------------------------------------------------------------------------


def _replica(name: str, heads: dict[int, str], weights: str | None = "w") -> Replica:
    return Replica(name, heads, weights)


def test_a_chain_that_disagrees_at_a_common_height_diverges() -> None:
    replicas = [
        _replica("seed", {1: "a", 2: "b", 3: "c"}),
        _replica("validator-0", {1: "a", 2: "b"}),  # shorter: not diverged
        _replica("validator-1", {1: "a", 2: "x", 3: "y"}),
        Replica("validator-2", {}, None, problem="does not open"),  # left to corrupt stores
    ]
    assert diverged_replicas(replicas) == ["validator-1"]
    assert diverged_replicas(replicas[:2]) == []


def test_other_weights_at_the_same_tip_diverge() -> None:
    replicas = [
        _replica("seed", {1: "a", 2: "b"}, "w1"),
        _replica("reducer-0", {1: "a", 2: "b"}, "w1"),
        _replica("trainer-0", {1: "a", 2: "b"}, "w2"),
        _replica("trainer-1", {1: "a", 2: "b"}, None),  # weights not held: no verdict
        _replica("validator-0", {1: "a"}, "w0"),  # another tip: compared with nobody
    ]
    assert diverged_replicas(replicas) == ["trainer-0"]


def test_a_tie_picks_the_same_replica_whatever_the_order() -> None:
    one, other = _replica("a", {1: "h1"}), _replica("b", {1: "h2"})
    assert diverged_replicas([one, other]) == diverged_replicas([other, one]) == ["b"]


def test_heads_adopted_but_stored_nowhere_are_lost() -> None:
    replicas = [
        _replica("seed", {1: "a", 2: "b"}),
        _replica("validator-0", {1: "a", 2: "b", 3: "c"}),
        Replica("validator-1", {}, None, problem="does not open"),
    ]
    adopted = {
        "seed": {(1, "a"), (2, "b"), (3, "c")},  # its store ends at 2: lost for it
        "validator-0": {(3, "c")},
        "validator-1": {(4, "d")},  # nobody's store holds d
    }
    found = lost_heads(replicas, adopted)
    assert len(found) == 2, found
    assert "height 4" in found[0] and "validator-1" in found[0]
    assert found[1].startswith("seed adopted height 3")
    assert lost_heads(replicas, {"seed": {(1, "a"), (2, "b")}}) == []


# -- the summary ---------------------------------------------------------------------------


def _fault(kind: str, recovery: float | None, rejoin: float | None = None) -> FaultOutcome:
    stalled = recovery is None or recovery > 20.0
    return FaultOutcome(kind, ("seed",), 5.0, recovery, stalled, rejoin)


def test_the_summary_counts_and_percentiles() -> None:
    outcomes = [
        RunOutcome(
            seed=7,
            wall_s=90,
            faults=(_fault("kill", 1.0, 2.0), _fault("pause", 3.0)),
            strikes={"socket error: no PONG": 3, "bad bytes": 1},
            bans=1,
        ),
        RunOutcome(
            seed=5,
            wall_s=80,
            faults=(_fault("partition", 30.0, 31.0), _fault("kill", None)),
            diverged=("trainer-1",),
        ),
        RunOutcome(
            seed=6,
            wall_s=70,
            faults=(_fault("pause", 2.0, 2.0),),
            corrupt_stores=("seed: damaged", "reducer-0: damaged"),
            lost_heads=("head gone",),
        ),
        RunOutcome(seed=8, wall_s=10, faults=(), error="no head certified"),
        RunOutcome(seed=9, wall_s=10, faults=(_fault("kill", 1.0, 1.0),), crashed=("x",)),
    ]
    summary = summarize(outcomes, netns=False, partitions_skipped="needs root")
    assert summary["runs"] == 5
    assert summary["corrupt_stores"] == 2
    assert summary["lost_certified_heads"] == 1
    assert summary["diverged_replicas"] == 1
    assert summary["stalled_runs"] == 1  # seed 5: one fault over 20 s, one never recovered
    assert summary["crashed_nodes"] == 1
    assert summary["broken_runs"] == 1
    assert summary["unrecovered_faults"] == 1
    # recoveries 1, 3, 30, 2, 1 -> sorted 1, 1, 2, 3, 30: p50 = 2; p99 at 3.96 = 3 + 0.96 * 27
    assert summary["recovery_seconds_p50"] == 2.0
    assert summary["recovery_seconds_p99"] == pytest.approx(28.92)
    # rejoins 2, 31, 2, 1 -> sorted 1, 2, 2, 31: p50 = 2; p99 at 2.97 = 2 + 0.97 * 29
    assert summary["rejoin_seconds_p50"] == 2.0
    assert summary["rejoin_seconds_p99"] == pytest.approx(30.13)
    assert summary["faults_not_rejoined"] == 2
    assert summary["faults"] == {"kill": 3, "pause": 2, "partition": 1, "outage": 0, "join": 0}
    assert summary["not_caught_up"] == 0
    assert summary["catch_up_seconds_p50"] is None
    assert summary["logged_strikes"] == 4
    assert summary["logged_bans"] == 1
    assert summary["failing_seeds"] == [5, 6, 8, 9]
    assert summary["netns"] is False
    assert summary["partitions_skipped"] == "needs root"
    assert [run["seed"] for run in summary["details"]] == [7, 5, 6, 8, 9]
    assert [run["failed"] for run in summary["details"]] == [False, True, True, True, True]


def _long(kind: str, catch_up: float | None, behind: int) -> FaultOutcome:
    victim = JOINER if kind == "join" else "validator-0"
    return FaultOutcome(kind, (victim,), 0.0, 1.0, catch_up is None, catch_up, behind=behind)


def test_long_faults_are_counted_apart_and_one_not_caught_up_stalls_its_run() -> None:
    first = (_fault("kill", 1.0, 2.0), _long("outage", 4.0, 310), _long("join", 6.0, 330))
    second = (_long("outage", None, 305), _long("join", 2.0, 340), _fault("pause", 1.0, 3.0))
    outcomes = [
        RunOutcome(seed=15, wall_s=300, faults=first),
        RunOutcome(seed=20, wall_s=300, faults=second),
    ]
    summary = summarize(outcomes, netns=True, partitions_skipped=None)
    assert summary["faults"] == {"kill": 1, "pause": 1, "partition": 0, "outage": 2, "join": 2}
    assert summary["stalled_runs"] == 1
    assert summary["failing_seeds"] == [20]
    assert summary["not_caught_up"] == 1
    # catch-ups 4, 6, 2 -> sorted 2, 4, 6: p50 = 4, max 6; the heights of those caught up
    assert summary["catch_up_seconds_p50"] == 4.0
    assert summary["catch_up_seconds_max"] == 6.0
    assert summary["caught_up_heights_max"] == 340
    # the short faults' rejoins alone: 2 and 3
    assert summary["rejoin_seconds_p50"] == 2.5
    assert summary["faults_not_rejoined"] == 0
    # every fault's recovery (1.0 each)
    assert summary["recovery_seconds_p99"] == 1.0
    assert summary["details"][1]["faults"][0]["behind"] == 305
    text = "\n".join(summary_lines(summary | {"seed": 15}))
    assert "not caught up           1" in text
    assert "caught up (long faults) p50 4.0 s, max 6.0 s, up to 340 heights" in text


def test_an_empty_summary_has_no_percentiles() -> None:
    summary = summarize([], netns=True, partitions_skipped=None)
    assert summary["runs"] == 0
    assert summary["recovery_seconds_p50"] is None
    assert summary["recovery_seconds_p99"] is None
    assert summary["failing_seeds"] == []
    assert summary["faults"] == {"kill": 0, "pause": 0, "partition": 0, "outage": 0, "join": 0}
    assert summary["catch_up_seconds_max"] is None
    assert summary["caught_up_heights_max"] is None


def test_the_summary_for_people_names_the_failing_seeds_and_how_to_replay() -> None:
    outcomes = [
        RunOutcome(seed=3, wall_s=60, faults=(_fault("kill", 1.0, 1.0),)),
        RunOutcome(seed=4, wall_s=60, faults=(_fault("pause", None),), kept="/tmp/run-4"),
    ]
    summary = summarize(outcomes, netns=False, partitions_skipped="needs root")
    summary |= {"seed": 3, "replay_flags": "--duration-s 12.0 --no-netns"}
    text = "\n".join(summary_lines(summary))
    assert "partitions skipped: needs root" in text
    assert "stalled runs            1" in text
    assert "replay: p2ptrain bench chaos --runs 1 --seed 4 --duration-s 12.0 --no-netns" in text
    assert "seed 4: data directories and logs in /tmp/run-4" in text
    passing = summarize(outcomes[:1], netns=True, partitions_skipped=None) | {"seed": 3}
    assert summary_lines(passing)[-1] == "failing seeds: none"


# -- one fault against a scripted network ---------------------------------------------------


class ScriptedNetwork:
    """A network (:class:`~p2ptrain.bench.chaos.FaultTarget`) at height 7 that, until a
    heal, certifies one more height per wait (up to ``stops_at``: None, no end), certifies
    again ``certify_s`` after a heal (None: never) and whose victims are back ``rejoin_s``
    after it (each victim at height 3 when back, the joiner at 0); waiting takes no time,
    it only adds up what was waited."""

    def __init__(
        self, certify_s: float | None, rejoin_s: float | None = 1.0, stops_at: int | None = None
    ) -> None:
        self.certify_s = certify_s
        self.rejoin_s = rejoin_s
        self.stops_at = stops_at
        self.calls: list[str] = []
        self.healed: int | None = None  # the height at the heal
        self.healed_at = 0.0
        self.waited_s = 0.0
        self.lost_on_restart = ["validator-0 came back at height 1"]
        self._height = 7

    @property
    def height(self) -> int:
        return self._height

    def height_of(self, name: str) -> int:
        return 0 if name == JOINER else 3

    def pump(self, timeout_s: float, until: Callable[[], bool] | None = None) -> bool:
        self.calls.append(f"pump {timeout_s}")
        return False

    def _healed(self, call: str) -> None:
        self.calls.append(call)
        self.healed, self.healed_at, self.waited_s = self._height, time.monotonic(), 0.0

    def kill(self, names: Sequence[str]) -> None:
        self.calls.append(f"kill {'+'.join(names)}")

    def restart(self, names: Sequence[str]) -> list[str]:
        self._healed(f"restart {'+'.join(names)}")
        return self.lost_on_restart

    def join(self, names: Sequence[str]) -> None:
        self._healed(f"join {'+'.join(names)} at {self._height}")

    def pause(self, names: Sequence[str]) -> None:
        self.calls.append(f"pause {'+'.join(names)}")

    def resume(self, names: Sequence[str]) -> None:
        self._healed(f"resume {'+'.join(names)}")

    def cut(self, names: Sequence[str]) -> None:
        self.calls.append(f"cut {'+'.join(names)}")

    def heal(self) -> None:
        self._healed("heal")

    def wait_certified_above(self, height: int, timeout_s: float) -> float | None:
        if self.healed is None:  # an outage or a joiner waits for heights
            assert height == self._height
            if self.stops_at is not None and height >= self.stops_at:
                return None
            self._height += 1
            return time.monotonic()
        assert height == self.healed
        self.waited_s += timeout_s
        if self.certify_s is None or self.certify_s > self.waited_s:
            return None
        return self.healed_at + self.certify_s

    def wait_rejoined(
        self, names: Sequence[str], height: int, since: float, timeout_s: float
    ) -> dict[str, float | None]:
        assert height == self.healed
        late = self.rejoin_s is None or self.rejoin_s > timeout_s
        at = None if late or self.rejoin_s is None else self.healed_at + self.rejoin_s
        return {name: at for name in names}

    def diagnose(self, title: str) -> str:
        return f"diagnosis: {title}"


CONFIG = ChaosConfig(deadline_s=10.0)  # stall after 20 s, give up after 40 s


def test_a_fault_strikes_holds_and_heals_in_order() -> None:
    net, log = ScriptedNetwork(certify_s=2.0), RunLog(seed=1)
    play_fault(net, Fault("kill", ("validator-0",), after_s=1.5, hold_s=3.0), CONFIG, log)
    assert net.calls == ["pump 1.5", "kill validator-0", "pump 3.0", "restart validator-0"]
    assert log.lost == net.lost_on_restart
    net = ScriptedNetwork(certify_s=2.0)
    play_fault(net, Fault("pause", ("seed", "trainer-0"), 1.0, 4.0), CONFIG, log)
    assert net.calls == ["pump 1.0", "pause seed+trainer-0", "pump 4.0", "resume seed+trainer-0"]
    net = ScriptedNetwork(certify_s=2.0)
    play_fault(net, Fault("partition", ("reducer-0",), 1.0, 5.0), CONFIG, log)
    assert net.calls == ["pump 1.0", "cut reducer-0", "pump 5.0", "heal"]


def test_a_quick_recovery_is_timed_and_not_a_stall() -> None:
    log = RunLog(seed=1)
    outcome = play_fault(ScriptedNetwork(certify_s=5.0, rejoin_s=6.0),
                         Fault("pause", ("validator-1",), 1.0, 4.0), CONFIG, log)  # fmt: skip
    assert outcome.recovery_s == pytest.approx(5.0, abs=0.05)
    assert outcome.rejoin_s == pytest.approx(6.0, abs=0.05)
    assert not outcome.stalled
    assert log.diagnoses == []


def test_a_late_recovery_is_a_stall_with_a_diagnosis() -> None:
    log = RunLog(seed=4)
    fault = Fault("partition", ("validator-0", "validator-1"), 1.0, 30.0)
    outcome = play_fault(ScriptedNetwork(certify_s=30.0, rejoin_s=None), fault, CONFIG, log)
    assert outcome.recovery_s == pytest.approx(30.0, abs=0.05)
    assert outcome.stalled
    assert outcome.rejoin_s is None
    assert outcome.note == "not back at height 7: validator-0 at 3, validator-1 at 3"
    (diagnosis,) = log.diagnoses
    assert "seed 4: no head certified within 20 s" in diagnosis
    assert "partition validator-0+validator-1" in diagnosis


def test_no_recovery_at_all_is_a_stall_without_a_time() -> None:
    log = RunLog(seed=4)
    outcome = play_fault(ScriptedNetwork(certify_s=None), Fault("kill", ("seed",), 1.0, 2.0),
                         CONFIG, log)  # fmt: skip
    assert outcome.recovery_s is None
    assert outcome.stalled
    assert len(log.diagnoses) == 1


def test_an_outage_holds_for_more_than_its_heights_and_times_the_catch_up() -> None:
    net, log = ScriptedNetwork(certify_s=1.0, rejoin_s=4.0), RunLog(seed=5)
    fault = Fault("outage", ("validator-0",), after_s=1.0, hold_s=0.0, heights=5)
    outcome = play_fault(net, fault, CONFIG, log)
    assert net.calls == ["pump 1.0", "kill validator-0", "restart validator-0"]
    assert net.healed == 13  # 7 + more than 5
    assert outcome.behind == 10  # back at 3
    assert outcome.rejoin_s == pytest.approx(4.0, abs=0.05)
    assert not outcome.stalled and outcome.note == ""
    assert log.lost == net.lost_on_restart and log.diagnoses == []


def test_a_node_not_at_the_tip_within_the_bound_stalls_the_run() -> None:
    log = RunLog(seed=5)
    fault = Fault("outage", ("trainer-1",), after_s=1.0, hold_s=0.0, heights=5)
    outcome = play_fault(ScriptedNetwork(certify_s=1.0, rejoin_s=None), fault, CONFIG, log)
    assert outcome.stalled and outcome.rejoin_s is None
    assert outcome.note == "not at the tip (height 13) within 30 s of ready: trainer-1 at 3"
    (diagnosis,) = log.diagnoses
    assert diagnosis.startswith("diagnosis: seed 5: outage trainer-1 for more than 5 heights")
    # a catch-up slower than the bound is as late as none
    late = play_fault(ScriptedNetwork(certify_s=1.0, rejoin_s=31.0), fault, CONFIG, RunLog(5))
    assert late.stalled and late.rejoin_s is None


def test_a_network_that_stops_during_an_outage_stalls_the_run_and_the_victim_restarts() -> None:
    net, log = ScriptedNetwork(certify_s=1.0, stops_at=10), RunLog(seed=6)
    fault = Fault("outage", ("validator-2",), after_s=1.0, hold_s=0.0, heights=5)
    outcome = play_fault(net, fault, CONFIG, log)
    assert net.calls[-1] == "restart validator-2" and net.healed == 10
    assert outcome.stalled
    assert outcome.rejoin_s == pytest.approx(1.0, abs=0.05)
    assert outcome.note == "no head certified for 40 s at height 10, short of height 13"
    (diagnosis,) = log.diagnoses
    assert "no head certified for 40 s at height 10" in diagnosis


def test_a_joiner_starts_once_the_chain_is_longer_than_its_heights() -> None:
    net, log = ScriptedNetwork(certify_s=1.0, rejoin_s=2.0), RunLog(seed=7)
    outcome = play_fault(net, Fault("join", (JOINER,), 1.0, 0.0, heights=9), CONFIG, log)
    assert net.calls == ["pump 1.0", f"join {JOINER} at 10"]
    assert outcome.behind == 10
    assert outcome.rejoin_s == pytest.approx(2.0, abs=0.05) and not outcome.stalled
    # a chain already long enough: the joiner starts at once
    net = ScriptedNetwork(certify_s=1.0, rejoin_s=None)
    outcome = play_fault(net, Fault("join", (JOINER,), 1.0, 0.0, heights=3), CONFIG, log)
    assert net.calls == ["pump 1.0", f"join {JOINER} at 7"]
    assert outcome.stalled and outcome.behind == 7
    assert outcome.note == f"not at the tip (height 7) within 30 s of ready: {JOINER} at 0"


def test_short_deadlines_let_a_trainer_be_the_outage_victim() -> None:
    assert set(CONFIG.long_faults.victims) == {"validator-0", "validator-1", "validator-2"}
    short = ChaosConfig(deadline_s=0.5, proposal_s=0.2)
    assert {"trainer-0", "trainer-1"} <= set(short.long_faults.victims)
    # and the stall limits keep a floor
    assert (short.stall_after_s, short.give_up_after_s) == (10.0, 20.0)
    assert (CONFIG.stall_after_s, CONFIG.give_up_after_s) == (20.0, 40.0)
    assert ChaosConfig(long_every=1, outage_heights=20).replay_flags(netns=True) == (
        "--long-every 1 --outage-heights 20"
    )
