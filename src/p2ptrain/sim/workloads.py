"""What simulated trainers train: a synthetic quadratic (for scale) and digits (a real MLP).

A workload gives the genesis weights, the dataset's shards (whose names and sample counts
go into the manifest, so leases are real), and trains one window: from the canonical weights,
``inner_steps`` steps on the trainer's lease, returning the pseudo-gradient
``theta_base - theta_local`` and the loss before and after.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Protocol

import torch

from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.data.digits import load_digits_split
from p2ptrain.errors import LocalError
from p2ptrain.protocol.leases import Lease

__all__ = ["DigitsWorkload", "SimWorkload", "SyntheticWorkload", "make_workload"]

Tensors = dict[str, torch.Tensor]

#: The digits training images (80%) split into this many equal shards (47 images each).
DIGITS_SHARDS = 30


class SimWorkload(Protocol):
    name: str
    #: Virtual seconds a trainer spends on one window.
    train_seconds: float

    def genesis(self) -> Tensors: ...

    def dataset(self) -> DatasetManifest: ...

    def train(
        self, weights: Mapping[str, torch.Tensor], lease: Lease, trainer: int, window: int, *,
        poison: bool = False,
    ) -> tuple[Tensors, float, float]: ...  # fmt: skip

    def loss(self, weights: Mapping[str, torch.Tensor]) -> float: ...


def _shards(name: str, sizes: list[int]) -> DatasetManifest:
    shards = tuple(
        ShardInfo(
            name=f"{name}-{index:03d}",
            blob_id=hashlib.sha256(f"{name}/{index}/{size}".encode()).hexdigest(),
            samples=size,
        )
        for index, size in enumerate(sizes)
    )
    return DatasetManifest(name=name, shards=shards)


class SyntheticWorkload:
    """Minimise ``mean((w - target)^2)``: each sample of a shard is a noisy copy of the
    target, and a window takes ``inner_steps`` gradient steps toward the lease's samples.
    Cheap enough for thousands of trainers."""

    name = "synthetic"
    train_seconds = 5.0

    def __init__(self, seed: int, size: int = 64, shards: int = 32, inner_steps: int = 4) -> None:
        self.size, self.inner_steps, self.step = size, inner_steps, 0.2
        generator = torch.Generator().manual_seed(seed)
        self.target = torch.randn(size, generator=generator)
        self._start = torch.randn(size, generator=generator) * 3
        self._dataset = _shards("synthetic", [64] * shards)
        self._noise = {
            shard.name: torch.randn(size, generator=generator) * 0.3
            for shard in self._dataset.shards
        }

    def genesis(self) -> Tensors:
        return {"w": self._start.clone()}

    def dataset(self) -> DatasetManifest:
        return self._dataset

    def train(
        self, weights: Mapping[str, torch.Tensor], lease: Lease, trainer: int, window: int, *,
        poison: bool = False,
    ) -> tuple[Tensors, float, float]:  # fmt: skip
        total = lease.samples
        aim = sum(((self.target + self._noise[name]) * count for name, _, count in lease.parts),
                  torch.zeros(self.size)) / total  # fmt: skip
        if poison:
            aim = -aim
        base = weights["w"]
        local = base.clone()
        for _ in range(self.inner_steps):
            local -= self.step * 2 * (local - aim)
        return {"w": base - local}, self.loss(weights), self.loss({"w": local})

    def loss(self, weights: Mapping[str, torch.Tensor]) -> float:
        return float(((weights["w"] - self.target) ** 2).mean())


class DigitsWorkload:
    """scikit-learn's digits, a 64-32-10 MLP, AdamW inner steps on the lease's samples (each
    trainer keeps its AdamW state across windows); the loss is on 20% held-out images."""

    name = "digits"
    train_seconds = 20.0

    def __init__(self, seed: int, hidden: int = 32, inner_steps: int = 10) -> None:
        digits = load_digits_split(workers=DIGITS_SHARDS, seed=seed)
        self.test_x, self.test_y = digits.test_x, digits.test_y
        self._dataset = _shards("digits", [digits.train_x.shape[1]] * DIGITS_SHARDS)
        self._data = {
            shard.name: (digits.train_x[i], digits.train_y[i])
            for i, shard in enumerate(self._dataset.shards)
        }
        self.hidden, self.inner_steps, self.seed = hidden, inner_steps, seed
        #: each trainer's AdamW state per parameter, kept across windows
        self._optimizers: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def genesis(self) -> Tensors:
        generator = torch.Generator().manual_seed(self.seed)
        shapes = {"l1.weight": (self.hidden, 64), "l1.bias": (self.hidden,),
                  "l2.weight": (10, self.hidden), "l2.bias": (10,)}  # fmt: skip
        weights = {}
        for name, shape in shapes.items():
            fan_in = 64 if name.startswith("l1") else self.hidden
            bound = 1 / math.sqrt(fan_in)
            weights[name] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        return weights

    def dataset(self) -> DatasetManifest:
        return self._dataset

    def _logits(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(x @ weights["l1.weight"].T + weights["l1.bias"])
        return hidden @ weights["l2.weight"].T + weights["l2.bias"]

    def train(
        self, weights: Mapping[str, torch.Tensor], lease: Lease, trainer: int, window: int, *,
        poison: bool = False,
    ) -> tuple[Tensors, float, float]:  # fmt: skip
        xs, ys = [], []
        for name, start, count in lease.parts:
            x, y = self._data[name]
            taken = (start + torch.arange(count)) % len(y)
            xs.append(x[taken])
            ys.append(y[taken])
        x, y = torch.cat(xs), torch.cat(ys)
        if poison:
            y = 9 - y
        local = {name: t.clone().requires_grad_(True) for name, t in weights.items()}
        optimizer = torch.optim.AdamW(local.values(), lr=3e-3)
        for name, state in self._optimizers.get(trainer, {}).items():
            optimizer.state[local[name]] = {k: v.clone() for k, v in state.items()}
        with torch.no_grad():
            before = float(torch.nn.functional.cross_entropy(self._logits(local, x), y))
        generator = torch.Generator().manual_seed(trainer * 100_003 + window)
        for _ in range(self.inner_steps):
            batch = torch.randint(0, len(y), (32,), generator=generator)
            loss = torch.nn.functional.cross_entropy(self._logits(local, x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        with torch.no_grad():
            after = float(torch.nn.functional.cross_entropy(self._logits(local, x), y))
        self._optimizers[trainer] = {
            name: {k: v.detach().clone() for k, v in optimizer.state[param].items()}
            for name, param in local.items()
        }
        delta = {name: weights[name] - local[name].detach() for name in weights}
        return delta, before, after

    def loss(self, weights: Mapping[str, torch.Tensor]) -> float:
        with torch.no_grad():
            logits = self._logits(weights, self.test_x)
            return float(torch.nn.functional.cross_entropy(logits, self.test_y))

    def accuracy(self, weights: Mapping[str, torch.Tensor]) -> float:
        with torch.no_grad():
            predicted = self._logits(weights, self.test_x).argmax(dim=1)
            return float((predicted == self.test_y).float().mean())


def make_workload(name: str, seed: int) -> SyntheticWorkload | DigitsWorkload:
    if name == "synthetic":
        return SyntheticWorkload(seed)
    if name == "digits":
        return DigitsWorkload(seed)
    raise LocalError(f"unknown workload {name!r}; choose 'synthetic' or 'digits'")
