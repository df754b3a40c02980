"""scikit-learn's digits (8x8 images, 10 classes), split among workers: the data of the
Byzantine benchmark (:mod:`p2ptrain.bench.byzantine`) and of the simulator's digits workload
(:mod:`p2ptrain.sim.workloads`).

scikit-learn comes with the ``bench`` extra (``pip install 'p2ptrain[bench]'``); it is
imported only when the data is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Digits", "load_digits_split"]


@dataclass(frozen=True)
class Digits:
    train_x: torch.Tensor  # (workers, shard, 64)
    train_y: torch.Tensor  # (workers, shard)
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits_split(workers: int, seed: int) -> Digits:
    """Digits scaled to [0, 1], 20% held out, the rest split evenly among workers."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test = order[: len(y) // 5]
    train = order[len(y) // 5 :]
    shard = len(train) // workers
    train = train[: shard * workers].reshape(workers, shard)
    return Digits(x[train], y[train], x[test], y[test])
