"""Rejection reasons are codes in the records (protocol 5): rewording every human-readable
reason changes no record. With each text of ``core/reasons.py`` replaced, the reduction
test vectors (head ids, rejections, quarantine books, aggregate hashes) and a simulated
network's certified heads, with Byzantine trainers rejected and quarantined, are the same
bit for bit."""

from __future__ import annotations

import json

import pytest

from p2ptrain.core import reasons
from p2ptrain.sim.scenario import Scenario
from p2ptrain.sim.world import World
from tests.golden.make_vectors import FILE, vectors

SEED = 12
SCENARIO = Scenario(
    trainers=8, validators=3, quorum=2, windows=3, seed=SEED, byzantine=2, attack="sign_flip"
)


def _reworded() -> dict[reasons.Code, str]:
    """Every text replaced by other words (the same arguments, said otherwise)."""
    return {
        code: f"RAISON {code.value}: " + " / ".join(f"{{{i}}}" for i in range(reasons.ARITY[code]))
        for code in reasons.Code
    }


def _certified_heads() -> dict[int, list[str]]:
    world = World(SCENARIO)
    world.run()
    assert world.role_failures == [] and world.observer.violations == []
    rejected = [p for p in world.observer.proposals.values() if p.rejected]
    assert rejected, f"seed {SEED}: no proposal rejected an update"
    return {height: sorted(heads) for height, heads in world.observer.certified.items()}


def test_rewording_every_reason_changes_no_record(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _certified_heads()
    assert sorted(before) == [1, 2, 3], f"seed {SEED}: {before}"
    for code, text in _reworded().items():
        monkeypatch.setitem(reasons.TEXTS, code, text)
    reworded = reasons.Reason(reasons.Code.NORM_ABOVE, (12.5, 3.0))
    assert reasons.describe(reworded) == "RAISON 12: 12.5 / 3.0"
    assert json.loads(json.dumps(vectors())) == json.loads(FILE.read_text())
    assert _certified_heads() == before, f"seed {SEED}"
