"""The manifest's inner learning-rate schedule: its factors by hand, its checks, and the
trainers and the DDP replay following it."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from p2ptrain.core.manifests import InnerOptimizerSpec
from p2ptrain.errors import InvalidRecord, LocalError
from p2ptrain.node.trainer_runner import inner_lr_scaler, warn_if_other_lr
from p2ptrain.torch.baseline import ddp_equivalent
from p2ptrain.torch.char_gpt import demo_inner_schedule
from p2ptrain.torch.workload import TorchWorkload


def _workload(lr: float = 0.05) -> TorchWorkload:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": lr},
            {"params": model[2].parameters(), "lr": lr / 10},
        ]
    )
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.arange(32) % 2)
    return TorchWorkload(
        model, optimizer, data, data, batch_size=8, samples_per_shard=16, name="blobs"
    )


def test_constant_is_one_in_every_window() -> None:
    spec = InnerOptimizerSpec()
    assert not spec.scheduled
    assert [spec.lr_scale(w) for w in (1, 2, 50, 10_000)] == [1.0] * 4


def test_warmup_rises_linearly_then_holds() -> None:
    spec = InnerOptimizerSpec(warmup_windows=4)
    assert spec.scheduled
    assert [spec.lr_scale(w) for w in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_the_floor_and_stays() -> None:
    spec = InnerOptimizerSpec(schedule="cosine", decay_windows=4, min_lr_ratio=0.1)
    # progress (w - 1) / 4: 0, 1/4, 1/2, 3/4, then 1 from window 5 on
    expected = [
        1.0,
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)),
        0.55,
        0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)),
        0.1,
        0.1,
    ]
    got = [spec.lr_scale(w) for w in (1, 2, 3, 4, 5, 500)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_cosine_after_warmup_starts_at_one() -> None:
    spec = InnerOptimizerSpec(
        schedule="cosine", warmup_windows=2, decay_windows=2, min_lr_ratio=0.0
    )
    got = [spec.lr_scale(w) for w in (1, 2, 3, 4, 5)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"schedule": "cosine"}, "inner_optimizer.decay_windows"),
        ({"schedule": "linear"}, "inner_optimizer.schedule"),
        ({"min_lr_ratio": 1.5}, "inner_optimizer.min_lr_ratio"),
        ({"warmup_windows": -1}, "inner_optimizer.warmup_windows"),
    ],
)
def test_bad_schedules_name_their_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidRecord, match=named):
        InnerOptimizerSpec(**fields)  # type: ignore[arg-type]


def test_a_schedule_survives_the_manifest_encoding() -> None:
    spec = InnerOptimizerSpec(schedule="cosine", decay_windows=24, min_lr_ratio=0.1)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=InnerOptimizerSpec)
    assert decoded == spec
    assert decoded.lr_scale(13) == spec.lr_scale(13)


def test_set_lr_scale_scales_each_group_from_its_own_rate() -> None:
    workload = _workload(lr=0.05)
    workload.set_lr_scale(0.5)
    workload.set_lr_scale(0.5)  # from the built rates, not compounding
    assert [g["lr"] for g in workload.optimizer.param_groups] == pytest.approx([0.025, 0.0025])
    workload.set_lr_scale(1.0)
    assert [g["lr"] for g in workload.optimizer.param_groups] == pytest.approx([0.05, 0.005])
    with pytest.raises(LocalError, match="finite and >= 0"):
        workload.set_lr_scale(float("nan"))


def test_a_scheduled_experiment_needs_a_workload_that_can_follow_it() -> None:
    cosine = InnerOptimizerSpec(**demo_inner_schedule(24))  # type: ignore[arg-type]
    assert inner_lr_scaler(object(), InnerOptimizerSpec()) is None  # nothing to follow

    class Fixed:
        """A workload without set_lr_scale."""

    with pytest.raises(LocalError, match="has no set_lr_scale"):
        inner_lr_scaler(Fixed(), cosine)  # type: ignore[arg-type]
    workload = _workload(lr=0.05)
    scale = inner_lr_scaler(workload, cosine)
    assert scale is not None
    scale(cosine.lr_scale(24))
    assert workload.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * cosine.lr_scale(24))


def test_an_optimizer_built_with_another_rate_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    workload = _workload(lr=0.003)  # groups at 3e-3 and 3e-4
    assert warn_if_other_lr(workload, InnerOptimizerSpec(lr=0.003)) is None
    assert warn_if_other_lr(object(), InnerOptimizerSpec(lr=0.001)) is None  # no rates known
    with caplog.at_level("WARNING"):
        warning = warn_if_other_lr(workload, InnerOptimizerSpec(lr=0.001))
    assert warning is not None and warning in caplog.text
    assert "learning rate 0.0003, 0.003" in warning and "inner_optimizer.lr is 0.001" in warning


def test_ddp_replay_follows_the_schedule() -> None:
    windows = [[list(range(0, 16)), list(range(16, 32))]] * 3
    constant = ddp_equivalent(_workload(), windows, steps=4, seed_of=lambda w, t: w + t)
    frozen = ddp_equivalent(
        _workload(), windows, steps=4, seed_of=lambda w, t: w + t, lr_scale=lambda w: 0.0
    )
    genesis = _workload()
    # a rate of zero moves nothing: the replay ends where it began
    assert frozen == pytest.approx(genesis.evaluate(genesis.initial_weights()), abs=1e-6)
    assert constant < frozen
    # the replay starts from the rates the optimizer was built with, not the current ones
    scaled = _workload()
    scaled.set_lr_scale(0.0)
    again = ddp_equivalent(scaled, windows, steps=4, seed_of=lambda w, t: w + t)
    assert again == constant
