"""TorchWorkload, the char-GPT workload, the registry and the DDP baseline, on tiny sizes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from p2ptrain.core.tensors import decode_state_dict, encode_state_dict
from p2ptrain.errors import LocalError
from p2ptrain.torch.baseline import ddp_bytes_per_worker, ddp_equivalent
from p2ptrain.torch.char_gpt import DEFAULT_CONFIG, DEMO_DEFAULTS, CharGPT, char_gpt_workload
from p2ptrain.torch.registry import known_workloads, make_workload, register
from p2ptrain.torch.workload import TorchWorkload, Workload, minibatch_plan

SEED = 1234


def _blobs(n: int, seed: int) -> TensorDataset:
    """Two Gaussian blobs in 4-D, labels 0/1: linearly separable, learnt in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    centres = torch.tensor([[2.0, 0.0, -1.0, 1.0], [-2.0, 1.0, 1.0, -1.0]])
    return TensorDataset(centres[labels] + torch.randn(n, 4, generator=generator), labels)


def _workload(lr: float = 0.05, batch_size: int = 8) -> TorchWorkload:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return TorchWorkload(
        model,
        optimizer,
        _blobs(64, 1),
        _blobs(32, 2),
        batch_size=batch_size,
        samples_per_shard=16,
        name="blobs",
        val_batches=2,
    )


def test_minibatch_plan_is_seeded_shuffled_and_cycles() -> None:
    indices = [10, 11, 12, 13, 14]
    plan = minibatch_plan(indices, steps=3, batch_size=4, seed=7)
    assert plan == minibatch_plan(indices, steps=3, batch_size=4, seed=7)
    assert plan != minibatch_plan(indices, steps=3, batch_size=4, seed=8)
    flat = [i for batch in plan for i in batch]
    assert sorted(flat[:5]) == indices and sorted(flat[5:10]) == indices  # whole passes
    assert [len(batch) for batch in plan] == [4, 4, 4]
    with pytest.raises(LocalError, match="lease is empty"):
        minibatch_plan([], steps=1, batch_size=1, seed=0)


def test_train_window_lowers_the_loss_and_returns_float32_cpu_clones() -> None:
    workload = _workload()
    assert isinstance(workload, Workload)
    genesis = workload.initial_weights()
    before = workload.evaluate(genesis)
    result = workload.train_window(genesis, range(64), steps=30, seed=SEED)
    assert result.samples == 30 * 8
    assert result.loss_after < result.loss_before
    assert workload.evaluate(result.weights) < before / 2
    for name, param in workload.model.named_parameters():
        tensor = result.weights[name]
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tensor.is_contiguous() and not tensor.requires_grad
        assert tensor.data_ptr() != param.data_ptr()
    # genesis is untouched and stays the same
    assert all(torch.equal(genesis[n], t) for n, t in workload.initial_weights().items())


def test_evaluate_is_deterministic() -> None:
    workload = _workload()
    weights = workload.initial_weights()
    assert workload.evaluate(weights) == workload.evaluate(weights)


def test_optimizer_state_round_trip_continues_bit_for_bit() -> None:
    uninterrupted = _workload()
    genesis = uninterrupted.initial_weights()
    first = uninterrupted.train_window(genesis, range(32), steps=5, seed=1)
    second = uninterrupted.train_window(first.weights, range(32, 64), steps=5, seed=2)

    interrupted = _workload()
    first_again = interrupted.train_window(genesis, range(32), steps=5, seed=1)
    saved = decode_state_dict(encode_state_dict(interrupted.optimizer_state()))
    assert "0.weight/exp_avg" in saved and "0.weight/step" in saved
    resumed = _workload()
    resumed.load_optimizer_state(saved)
    second_again = resumed.train_window(first_again.weights, range(32, 64), steps=5, seed=2)
    for name, tensor in second.weights.items():
        assert torch.equal(tensor, second_again.weights[name]), name
    # without the state the second window differs (the state matters)
    fresh = _workload().train_window(first.weights, range(32, 64), steps=5, seed=2)
    assert not all(torch.equal(t, fresh.weights[n]) for n, t in second.weights.items())
    with pytest.raises(LocalError, match="names no parameter"):
        resumed.load_optimizer_state({"nope/exp_avg": torch.zeros(1)})


def test_from_loaders_takes_datasets_batch_size_and_collate() -> None:
    torch.manual_seed(SEED)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train = DataLoader(_blobs(40, 1), batch_size=5)
    workload = TorchWorkload.from_loaders(
        model, optimizer, train, DataLoader(_blobs(10, 2), batch_size=10),
        samples_per_shard=8, name="blobs",
    )  # fmt: skip
    assert workload.batch_size == 5 and workload.collate_fn is train.collate_fn
    assert [s.samples for s in workload.dataset_manifest().shards] == [8, 8, 8, 8, 8]
    workload.train_window(workload.initial_weights(), range(40), steps=2, seed=0)
    assert set(workload.optimizer_state()) == {"weight/momentum_buffer", "bias/momentum_buffer"}


def test_weights_for_another_model_are_refused() -> None:
    workload = _workload()
    with pytest.raises(LocalError, match="missing"):
        workload.evaluate({"0.weight": torch.zeros(8, 4)})


def test_ddp_equivalent_replays_the_trainers_minibatches() -> None:
    workload = _workload(lr=0.02)
    windows = [[list(range(0, 32)), list(range(32, 64))], [list(range(16, 48)), list(range(48))]]
    loss = ddp_equivalent(workload, windows, steps=4, seed_of=lambda w, t: 10 * w + t)
    assert loss < workload.evaluate(workload.initial_weights())
    # by hand: one optimizer, each step on both trainers' k-th minibatches concatenated
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    data = _blobs(64, 1)
    for w, trainers in enumerate(windows):
        plans = [
            minibatch_plan(ix, steps=4, batch_size=8, seed=10 * w + t)
            for t, ix in enumerate(trainers)
        ]
        for k in range(4):
            x, y = data[[i for plan in plans for i in plan[k]]]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    assert loss == workload.evaluate({n: p.detach() for n, p in model.named_parameters()})
    assert not workload.optimizer_state()  # the workload's own optimizer was not used


def test_ddp_equivalent_tells_the_loss_after_each_window() -> None:
    windows = [[list(range(0, 32)), list(range(32, 64))], [list(range(16, 48)), list(range(48))]]
    seen: list[tuple[int, float]] = []
    loss = ddp_equivalent(
        _workload(lr=0.02),
        windows,
        steps=4,
        seed_of=lambda w, t: 10 * w + t,
        on_window=lambda w, value: seen.append((w, value)),
    )
    # evaluating in between leaves the training as it was: each loss is a shorter replay's
    first = ddp_equivalent(_workload(lr=0.02), windows[:1], steps=4, seed_of=lambda w, t: t)
    assert seen == [(1, first), (2, loss)]


def test_ddp_bytes_per_worker_is_a_ring_all_reduce() -> None:
    assert ddp_bytes_per_worker(1000, steps=10, workers=4) == 10 * 2 * 3 * 1000 * 4 // 4
    assert ddp_bytes_per_worker(1000, steps=10, workers=1) == 0


TINY = {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "batch_size": 4,
        "samples_per_shard": 4096, "val_blocks": 8}  # fmt: skip


def test_char_gpt_is_deterministic_and_trains() -> None:
    first, second = char_gpt_workload(TINY), char_gpt_workload(TINY)
    genesis = first.initial_weights()
    assert all(torch.equal(genesis[n], t) for n, t in second.initial_weights().items())
    other = char_gpt_workload({**TINY, "seed": 1}).initial_weights()
    assert not torch.equal(genesis["token.weight"], other["token.weight"])
    vocab = genesis["token.weight"].shape[0]
    assert first.evaluate(genesis) == pytest.approx(math.log(vocab), rel=0.05)
    result = first.train_window(genesis, range(256), steps=20, seed=0)
    assert result.loss_after < result.loss_before - 0.5
    assert "head.weight" not in genesis  # tied to token.weight


def test_char_gpt_default_size_and_causality() -> None:
    model = CharGPT(65, n_layer=4, n_embd=128, n_head=4, block_size=64)
    assert 700_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    tokens = torch.randint(65, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 65
    with torch.no_grad():
        assert torch.equal(model(tokens)[0, :10], model(changed)[0, :10])
    assert set(DEMO_DEFAULTS) >= {"inner_steps", "windows", "outer_lr", "outer_momentum"}
    assert DEMO_DEFAULTS["trainers"] == 4


def test_char_gpt_rejects_bad_settings() -> None:
    with pytest.raises(LocalError, match="does not know"):
        char_gpt_workload({"layers": 2})
    with pytest.raises(LocalError, match="must be of type int"):
        char_gpt_workload({"n_layer": 2.5})
    with pytest.raises(LocalError, match="multiple of n_head"):
        char_gpt_workload({**TINY, "n_embd": 15})
    assert set(DEFAULT_CONFIG) >= {"lr", "seed", "batch_size", "samples_per_shard"}


def test_registry() -> None:
    assert "char-gpt" in known_workloads()
    with pytest.raises(LocalError, match=r"known workloads: .*char-gpt"):
        make_workload("no-such-model", {})
    register("test-blobs", lambda config: _workload())
    assert isinstance(make_workload("test-blobs", {}), TorchWorkload)
    with pytest.raises(LocalError, match="already registered"):
        register("test-blobs", lambda config: _workload())
