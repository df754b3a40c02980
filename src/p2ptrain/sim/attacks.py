"""Byzantine attacks on pseudo-gradients, for benchmarks and the simulator.

Each attack turns what a Byzantine trainer knows into the update it sends. The omniscient
ones (ALIE, inner-product manipulation) see every honest update of the window, the worst case
for the defence. ``label_flip`` is a data attack: the trainer trains honestly on labels it
flips, so it changes the training, not the vector (:attr:`Attack.poisons_data`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from p2ptrain.errors import LocalError


@dataclass(frozen=True, slots=True)
class AttackContext:
    """What a Byzantine trainer knows when it forges its update."""

    own: torch.Tensor  # the update it would have sent had it been honest
    honest: Sequence[torch.Tensor]  # the honest updates of this window (omniscient attacks)
    byzantine: int  # how many trainers collude
    total: int  # how many trainers send updates
    generator: torch.Generator  # seeded randomness


@dataclass(frozen=True, slots=True)
class Attack:
    name: str
    description: str
    forge: Callable[[AttackContext], torch.Tensor]
    poisons_data: bool = False


def _honest_mean(context: AttackContext) -> torch.Tensor:
    return torch.stack(list(context.honest)).mean(dim=0)


def _sign_flip(context: AttackContext) -> torch.Tensor:
    return torch.neg(context.own)


def _scaled(context: AttackContext) -> torch.Tensor:
    return torch.mul(context.own, 10.0)


def _gaussian(context: AttackContext) -> torch.Tensor:
    """Noise 100x as large, coordinate by coordinate, as the honest updates' RMS."""
    rms = math.sqrt(float(torch.stack(list(context.honest)).square().mean()))
    noise = torch.randn(context.own.shape, generator=context.generator)
    return torch.mul(noise, 100.0 * rms)


def alie_z(total: int, byzantine: int) -> float:
    """The z of "A Little Is Enough" (Baruch et al., 2019): the largest shift that keeps the
    forged update inside the honest spread for enough coordinates to steer the median."""
    supporters = math.floor(total / 2 + 1) - byzantine
    quantile = (total - supporters) / total
    return float(statistics.NormalDist().inv_cdf(min(max(quantile, 0.5), 0.999)))


def _alie(context: AttackContext) -> torch.Tensor:
    stacked = torch.stack(list(context.honest))
    mean = stacked.mean(dim=0)
    std = stacked.std(dim=0, unbiased=False)
    return torch.sub(mean, torch.mul(std, alie_z(context.total, context.byzantine)))


def _inner_product(context: AttackContext) -> torch.Tensor:
    """Inner-product manipulation (Xie et al., 2020): -epsilon times the honest mean, so the
    aggregate's inner product with the true direction turns small or negative."""
    return torch.mul(_honest_mean(context), -0.5)


def _nan(context: AttackContext) -> torch.Tensor:
    return torch.full_like(context.own, float("nan"))


def _label_flip(context: AttackContext) -> torch.Tensor:
    return context.own  # the poison is in the data it trained on


ATTACKS: dict[str, Attack] = {
    attack.name: attack
    for attack in (
        Attack("none", "honest behaviour", lambda c: c.own),
        Attack("sign_flip", "sends the negation of its honest update", _sign_flip),
        Attack("scaled", "sends its honest update multiplied by 10", _scaled),
        Attack("gaussian", "sends Gaussian noise 100x the honest RMS", _gaussian),
        Attack("alie", "mean - z*std of the honest updates (A Little Is Enough)", _alie),
        Attack("ipm", "-0.5 x the honest mean (inner-product manipulation)", _inner_product),
        Attack("label_flip", "trains on labels mapped y -> C-1-y", _label_flip, True),
        Attack("nan", "sends an update full of NaN", _nan),
    )
}


def attack_named(name: str) -> Attack:
    try:
        return ATTACKS[name]
    except KeyError:
        raise LocalError(f"unknown attack {name!r}; choose one of {', '.join(ATTACKS)}") from None
