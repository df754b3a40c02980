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
    KINDS,
    MAX_FAULTS,
    NODES,
    REFERENCE_BUDGET_S,
    Fault,
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


def test_a_plan_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="kinds"):
        plan_faults(0, kinds=())
    with pytest.raises(ValueError, match="kinds"):
        plan_faults(0, kinds=("flood",))
    with pytest.raises(ValueError, match="budget"):
        plan_faults(0, kinds=KINDS, budget_s=0)


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
    assert summary["faults"] == {"kill": 3, "pause": 2, "partition": 1}
    assert summary["logged_strikes"] == 4
    assert summary["logged_bans"] == 1
    assert summary["failing_seeds"] == [5, 6, 8, 9]
    assert summary["netns"] is False
    assert summary["partitions_skipped"] == "needs root"
    assert [run["seed"] for run in summary["details"]] == [7, 5, 6, 8, 9]
    assert [run["failed"] for run in summary["details"]] == [False, True, True, True, True]


def test_an_empty_summary_has_no_percentiles() -> None:
    summary = summarize([], netns=True, partitions_skipped=None)
    assert summary["runs"] == 0
    assert summary["recovery_seconds_p50"] is None
    assert summary["recovery_seconds_p99"] is None
    assert summary["failing_seeds"] == []
    assert summary["faults"] == {"kill": 0, "pause": 0, "partition": 0}


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
    """A network (:class:`~p2ptrain.bench.chaos.FaultTarget`) that certifies again
    ``certify_s`` after a heal (None: never) and whose victims are back ``rejoin_s`` after
    it; waiting takes no time, it only adds up what was waited."""

    def __init__(self, certify_s: float | None, rejoin_s: float | None = 1.0) -> None:
        self.certify_s = certify_s
        self.rejoin_s = rejoin_s
        self.calls: list[str] = []
        self.healed_at = 0.0
        self.waited_s = 0.0
        self.lost_on_restart = ["validator-0 came back at height 1"]

    @property
    def height(self) -> int:
        return 7

    def pump(self, timeout_s: float, until: Callable[[], bool] | None = None) -> bool:
        self.calls.append(f"pump {timeout_s}")
        return False

    def _healed(self, call: str) -> None:
        self.calls.append(call)
        self.healed_at, self.waited_s = time.monotonic(), 0.0

    def kill(self, names: Sequence[str]) -> None:
        self.calls.append(f"kill {'+'.join(names)}")

    def restart(self, names: Sequence[str]) -> list[str]:
        self._healed(f"restart {'+'.join(names)}")
        return self.lost_on_restart

    def pause(self, names: Sequence[str]) -> None:
        self.calls.append(f"pause {'+'.join(names)}")

    def resume(self, names: Sequence[str]) -> None:
        self._healed(f"resume {'+'.join(names)}")

    def cut(self, names: Sequence[str]) -> None:
        self.calls.append(f"cut {'+'.join(names)}")

    def heal(self) -> None:
        self._healed("heal")

    def wait_certified_above(self, height: int, timeout_s: float) -> float | None:
        assert height == 7
        self.waited_s += timeout_s
        if self.certify_s is None or self.certify_s > self.waited_s:
            return None
        return self.healed_at + self.certify_s

    def wait_rejoined(
        self, names: Sequence[str], height: int, since: float, timeout_s: float
    ) -> dict[str, float | None]:
        at = None if self.rejoin_s is None else self.healed_at + self.rejoin_s
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
    assert outcome.note == "not back at height 7: validator-0, validator-1"
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
