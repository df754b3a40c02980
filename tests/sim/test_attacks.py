"""The attacks forge what their papers describe."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.errors import LocalError
from p2ptrain.sim.attacks import ATTACKS, AttackContext, alie_z, attack_named

SEED = 7


def context(byzantine: int = 3) -> AttackContext:
    generator = torch.Generator().manual_seed(SEED)
    honest = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])]
    return AttackContext(torch.tensor([1.0, -1.0, 0.5]), honest, byzantine, 10, generator)


def test_simple_attacks() -> None:
    c = context()
    assert torch.equal(ATTACKS["none"].forge(c), c.own)
    assert torch.equal(ATTACKS["sign_flip"].forge(c), -c.own)
    assert torch.equal(ATTACKS["scaled"].forge(c), c.own * 10)
    assert torch.isnan(ATTACKS["nan"].forge(c)).all()
    assert torch.equal(ATTACKS["ipm"].forge(c), torch.tensor([-1.0, -1.0, -1.0]))
    assert ATTACKS["label_flip"].poisons_data
    assert torch.equal(ATTACKS["label_flip"].forge(c), c.own)


def test_alie_shifts_by_z_standard_deviations() -> None:
    # n = 10, f = 3: s = floor(10/2 + 1) - 3 = 3, z = Phi^-1(7/10) = 0.5244
    assert alie_z(10, 3) == pytest.approx(0.524400513, abs=1e-6)
    forged = ATTACKS["alie"].forge(context())
    # honest mean (2, 2, 2), std (1, 0, 1)
    assert torch.allclose(forged, torch.tensor([2 - 0.5244005, 2.0, 2 - 0.5244005]))


def test_gaussian_noise_is_seeded_and_large() -> None:
    a = ATTACKS["gaussian"].forge(context())
    b = ATTACKS["gaussian"].forge(context())
    assert torch.equal(a, b), f"seed={SEED}"
    assert a.shape == (3,)


def test_unknown_attack_is_named() -> None:
    with pytest.raises(LocalError, match="unknown attack 'nope'"):
        attack_named("nope")
