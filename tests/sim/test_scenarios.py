"""Seeded end-to-end scenarios of the simulator: safety always, liveness where expected."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from p2ptrain.errors import LocalError
from p2ptrain.sim.attacks import ATTACKS
from p2ptrain.sim.run import simulate
from p2ptrain.sim.scenario import Crash, Partitioned, Scenario, SlowLink

Report = dict[str, Any]
Check = Callable[[Scenario, Report], None]

VECTOR_ATTACKS = ("sign_flip", "scaled", "gaussian", "nan")


def _base(seed: int = 1, **fields: Any) -> Scenario:
    values: dict[str, Any] = {"trainers": 10, "validators": 3, "quorum": 2, "windows": 3}
    values.update(fields)
    return Scenario(seed=seed, **values)


def _no_check(scenario: Scenario, report: Report) -> None:
    pass


def _all_accepted(scenario: Scenario, report: Report) -> None:
    assert all(w["accepted"] == scenario.trainers for w in report["windows"]), report["windows"]
    assert report["final_loss"] is not None and math.isfinite(report["final_loss"])


def _only_honest_trainers(scenario: Scenario, report: Report) -> None:
    # the adversarial extra trainer (x-...) never makes it into a certified head
    assert all(0 < w["accepted"] <= scenario.trainers for w in report["windows"]), report["windows"]


def _wrong_head_reported(scenario: Scenario, report: Report) -> None:
    reasons = list(report["reports"])
    assert any("differs from our recomputation" in r for r in reasons), reasons


def _attack_check(scenario: Scenario, report: Report) -> None:
    assert report["final_loss"] is not None and math.isfinite(report["final_loss"])
    if scenario.attack in VECTOR_ATTACKS:
        assert all((w["rejected"] or 0) > 0 for w in report["windows"]), report["windows"]
        honest = scenario.trainers - scenario.byzantine
        assert all(w["accepted"] <= honest for w in report["windows"]), report["windows"]


def _forger_check(scenario: Scenario, report: Report) -> None:
    assert report["rejected_messages"] > 0, report
    assert report["windows"][-1]["quarantined"] >= 1, report["windows"]
    _only_honest_trainers(scenario, report)


def _equivocation_seen(scenario: Scenario, report: Report) -> None:
    assert report["equivocations_seen"] >= 1, report


def _crashed_trainer_missing(scenario: Scenario, report: Report) -> None:
    assert report["windows"][-1]["accepted"] <= scenario.trainers - 1, report["windows"]


def _digits_learns(scenario: Scenario, report: Report) -> None:
    # ten classes, two windows: well above chance (0.1), not converged
    assert report["final_accuracy"] is not None and report["final_accuracy"] > 0.2, report


# (id, scenario, windows expected certified, scenario-specific check)
CASES: list[Any] = [
    *(pytest.param(_base(seed), 3, _all_accepted, id=f"honest-seed{seed}") for seed in (1, 2, 3)),
    pytest.param(_base(5, reducers=2), 3, _all_accepted, id="two-reducers"),
    pytest.param(
        _base(
            41,
            windows=5,
            codec="sparseloco",
            codec_config=(("dense_windows", 2), ("fraction", 0.05)),
            rule="contributor_mean",
            precision="bf16",
            outer="sgd",
        ),
        5,
        _all_accepted,
        id="sparseloco-dense-warm-up-bf16-aggregates",
    ),
    pytest.param(_base(6, reducers=0), 3, _all_accepted, id="no-reducers-validators-fall-back"),
    pytest.param(_base(7, adversaries=("silent_reducer",)), 3, _all_accepted, id="silent-reducer"),
    pytest.param(
        _base(8, adversaries=("lying_reducer",)), 3, _wrong_head_reported, id="lying-reducer"
    ),
    *(
        pytest.param(
            _base(10 + i, byzantine=3, attack=name), 3, _attack_check, id=f"byzantine-{name}"
        )
        for i, name in enumerate(a for a in ATTACKS if a != "none")
    ),
    pytest.param(_base(20, adversaries=("replayer",)), 3, _only_honest_trainers, id="replayer"),
    pytest.param(_base(21, adversaries=("stale",)), 3, _only_honest_trainers, id="stale-sender"),
    pytest.param(_base(22, windows=4, adversaries=("forger",)), 4, _forger_check, id="forger"),
    pytest.param(
        _base(23, validators=5, quorum=3, silent_validators=2),
        3,
        _all_accepted,
        id="silent-validators-V-minus-Q",
    ),
    pytest.param(
        _base(24, validators=5, quorum=3, silent_validators=3),
        0,
        _no_check,
        id="silent-validators-V-minus-Q-plus-1",
    ),
    pytest.param(
        _base(25, windows=4, crashes=(Crash("v1", 10.0, 50.0),)),
        4,
        _all_accepted,
        id="validator-crash-restart",
    ),
    pytest.param(
        _base(26, crashes=(Crash("t2", 12.0),)), 3, _crashed_trainer_missing, id="trainer-crash"
    ),
    pytest.param(
        _base(27, partitions=(Partitioned(10.0, 40.0, ("v2",)),)),
        3,
        _all_accepted,
        id="validator-partitioned-30s",
    ),
    pytest.param(
        # the reducer and two validators cut off while window 1 gathers its updates: what
        # was sent meanwhile is repaired by window syncs once the partition heals
        _base(34, partitions=(Partitioned(3.0, 40.0, ("v0", "v1", "r0")),)),
        3,
        _all_accepted,
        id="reducer-and-validators-partitioned-then-synced",
    ),
    *(
        # q = n = 2 validators, no reducer: one validator and one trainer are cut off until
        # after both proposer slots, so each proposes (and prevotes) its own cohort; the next
        # voting round settles on the earliest proposal (one vote per height stalled here)
        pytest.param(
            _base(35, validators=2, reducers=0, partitions=(Partitioned(0.0, 21.0, (cut, "t9")),)),
            3,
            _no_check,
            id=f"split-first-votes-{cut}-cut-off",
        )
        for cut in ("v0", "v1")
    ),
    pytest.param(
        _base(28, slow=(SlowLink("t1", 20_000.0, 0.5),)), 3, _no_check, id="slow-trainer-link"
    ),
    pytest.param(_base(29, loss=0.02), 3, _only_honest_trainers, id="message-loss-2pct"),
    pytest.param(
        _base(30, validators=4, quorum=3, adversaries=("equivocating_validator",)),
        3,
        _equivocation_seen,
        id="equivocating-validator-majority-quorum",
    ),
    pytest.param(
        Scenario(trainers=200, validators=5, quorum=3, windows=2, seed=31),
        2,
        _all_accepted,
        id="scale-200-trainers",
    ),
    pytest.param(
        Scenario(trainers=6, validators=3, quorum=2, windows=2, seed=32, workload="digits"),
        2,
        _digits_learns,
        id="digits-6-trainers",
    ),
]


@pytest.mark.parametrize(("scenario", "certified", "check"), CASES)
def test_scenario(scenario: Scenario, certified: int, check: Check) -> None:
    report = simulate(scenario)
    context = f"seed={scenario.seed} violations={report['violations']} windows={report['windows']}"
    assert report["safety_violations"] == 0, context
    assert report["role_failures"] == [], context
    assert report["windows_certified"] == certified, context
    check(scenario, report)


@pytest.mark.parametrize("seed", [41, 42])
def test_minority_quorum_with_equivocator_is_caught(seed: int) -> None:
    scenario = Scenario(
        trainers=6,
        validators=3,
        quorum=1,
        windows=2,
        seed=seed,
        adversaries=("equivocating_validator",),
        allow_minority_quorum=True,
    )
    report = simulate(scenario)
    assert report["safety_violations"] >= 1, f"seed={seed} report={report}"
    assert any("two certified heads" in v for v in report["violations"]), report["violations"]


def test_same_scenario_same_run() -> None:
    scenario = _base(50, byzantine=2, attack="gaussian", adversaries=("forger",), loss=0.02)
    first, second = simulate(scenario), simulate(scenario)
    assert first["windows"] == second["windows"]
    assert first["final_loss"] == second["final_loss"]


def test_minority_quorum_needs_explicit_opt_in() -> None:
    with pytest.raises(LocalError, match="--allow-minority-quorum"):
        Scenario(trainers=4, validators=4, quorum=2, windows=1, seed=1)
