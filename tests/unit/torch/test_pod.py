"""The pod's pieces: minibatches split among ranks, and a 1-rank pod computing exactly what a
single trainer computes (DDP over one rank, batches through the pod's code path)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import TCPStore
from torch.utils.data import TensorDataset

from p2ptrain.errors import LocalError
from p2ptrain.node.pod import PodWorkload
from p2ptrain.torch.pod import PodGroup, PodReplica, PodSettings, split_batch
from p2ptrain.torch.pod_fsdp import ShardedReplica, make_replica
from p2ptrain.torch.workload import TorchWorkload

SEED = 99


def test_split_batch_cuts_consecutive_runs_differing_by_at_most_one() -> None:
    assert split_batch([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_batch([1, 2, 3, 4], 4) == [[1], [2], [3], [4]]
    assert split_batch(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]


def test_pod_settings_are_checked() -> None:
    with pytest.raises(LocalError, match="rank 2 of 2"):
        PodSettings(rank=2, world_size=2)
    with pytest.raises(LocalError, match="--pod-timeout-s"):
        PodSettings(rank=0, world_size=1, timeout_s=0)


def _workload(dropout: float = 0.1) -> TorchWorkload:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 2))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=generator), torch.arange(64) % 2)
    return TorchWorkload(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        data,
        data,
        batch_size=8,
        samples_per_shard=16,
        name="pod-test",
        val_batches=2,
    )


@pytest.fixture
def one_rank() -> Iterator[PodGroup]:
    """A pod of one rank, its store hosted here as torchrun's agent would."""
    master = TCPStore("127.0.0.1", 0, 1, True)
    group = PodGroup(
        PodSettings(rank=0, world_size=1, timeout_s=30, agent_store=("127.0.0.1", master.port)),
        torch.device("cpu"),
    )
    try:
        yield group
    finally:
        group.close()


def test_a_one_rank_pod_trains_exactly_as_a_single_trainer(one_rank: PodGroup) -> None:
    single, inner = _workload(), _workload()
    pod = PodWorkload(inner, one_rank, PodReplica(one_rank, inner, batch_size=inner.batch_size))
    base = single.initial_weights()
    indices = list(range(40))
    for window in range(2):
        seed = 1000 + window
        for trainer in (single, pod):
            trainer.set_lr_scale(0.5 + window)
        expected = single.train_window(base, indices, steps=6, seed=seed)
        got = pod.train_window(base, indices, steps=6, seed=seed)
        for name, tensor in expected.weights.items():
            assert torch.equal(got.weights[name], tensor), f"window {window}: {name} differs"
        assert got.loss_before == expected.loss_before
        assert got.loss_after == expected.loss_after
        base = expected.weights
    state, pod_state = single.optimizer_state(), pod.optimizer_state()
    assert state.keys() == pod_state.keys()
    assert all(torch.equal(state[k], pod_state[k]) for k in state)


def test_a_pod_needs_batches_of_at_least_one_sample_per_rank(one_rank: PodGroup) -> None:
    inner = _workload()
    with pytest.raises(LocalError, match="use at most 0 ranks"):
        PodReplica(one_rank, inner, batch_size=0)


def test_a_one_rank_sharded_pod_trains_as_a_single_trainer(one_rank: PodGroup) -> None:
    """FSDP2 over one rank: the same steps (its reductions may round differently), and the
    weights and optimizer state come back whole on rank 0, in the trainer's names."""
    single, inner = _workload(dropout=0.0), _workload(dropout=0.0)
    replica = make_replica(one_rank, inner, batch_size=inner.batch_size, wrap="fsdp2")
    assert isinstance(replica, ShardedReplica)
    pod = PodWorkload(inner, one_rank, replica)
    base = single.initial_weights()
    indices = list(range(40))
    expected = single.train_window(base, indices, steps=6, seed=5)
    got = pod.train_window(base, indices, steps=6, seed=5)
    assert got.weights.keys() == expected.weights.keys()
    for name, tensor in expected.weights.items():
        torch.testing.assert_close(got.weights[name], tensor, rtol=1e-5, atol=1e-6)
    assert got.loss_before == pytest.approx(expected.loss_before, rel=1e-6)
    state = pod.optimizer_state()
    assert state.keys() == single.optimizer_state().keys()
    # a restored state reaches the shards at the next window
    pod.load_optimizer_state(single.optimizer_state())
    again = pod.train_window(expected.weights, indices, steps=2, seed=6)
    reference = single.train_window(expected.weights, indices, steps=2, seed=6)
    for name, tensor in reference.weights.items():
        torch.testing.assert_close(again.weights[name], tensor, rtol=1e-5, atol=1e-6)
