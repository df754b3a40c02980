"""Mistakes a user makes with their own model and data, caught before anything joins."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from p2ptrain.errors import LocalError
from p2ptrain.torch.workload import TorchWorkload


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield torch.zeros(3), torch.tensor(0)


def _pairs() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 3, generator=generator), torch.arange(16) % 2)


def _workload(train: object, **options: object) -> TorchWorkload:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TorchWorkload(
        model, optimizer, train, _pairs(), batch_size=4, samples_per_shard=8, name="t",
        **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_an_iterable_dataset_is_refused_with_what_to_do() -> None:
    with pytest.raises(
        LocalError,
        match=r"training data \(_Stream\) is iterable but not indexable.*p2ptrain data prepare",
    ):
        _workload(_Stream())


def test_a_loss_that_raises_fails_the_dry_run_in_words() -> None:
    def broken(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise KeyError("labels")

    workload = _workload(_pairs(), loss_fn=broken)
    with pytest.raises(LocalError, match=r"failed on the first training batch.*KeyError") as caught:
        workload.dry_run()
    assert isinstance(caught.value.__cause__, KeyError)


def test_the_dry_run_leaves_the_weights_as_they_were() -> None:
    workload = _workload(_pairs())
    before = workload.initial_weights()
    workload.dry_run()
    after = {name: p.detach() for name, p in workload.model.named_parameters()}
    assert all(torch.equal(before[name], after[name]) for name in before)
