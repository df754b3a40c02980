"""The optional workload capabilities: TorchWorkload has each, a workload of only the
protocol's methods has none, and the node asks by type (refusing in words where it needs
one, going without elsewhere)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from p2ptrain.core.manifests import DatasetManifest, InnerOptimizerSpec, ShardInfo
from p2ptrain.errors import LocalError
from p2ptrain.node.data_import import attach_validation
from p2ptrain.node.evaluator import evaluate_head
from p2ptrain.node.launch import attach_shards
from p2ptrain.node.trainer_runner import inner_lr_scaler, warn_if_other_lr
from p2ptrain.store.blobs import BlobStore
from p2ptrain.torch.capabilities import (
    DryRunnable,
    Placeable,
    PreparedDataUser,
    RateScheduled,
    ReportsEvaluation,
    TorchModule,
    model_config,
)
from p2ptrain.torch.workload import TorchWorkload, WindowResult, Workload

CAPABILITIES = (
    DryRunnable,
    Placeable,
    PreparedDataUser,
    RateScheduled,
    ReportsEvaluation,
    TorchModule,
)


def _rows(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.arange(n) % 2)


def _torch_workload() -> TorchWorkload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    return TorchWorkload(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        _rows(32),
        _rows(8),
        batch_size=4,
        samples_per_shard=8,
        name="rows",
        val_batches=1,
    )


class Bare:
    """The :class:`Workload` protocol's members and nothing else."""

    batch_size = 4

    def initial_weights(self) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(2)}

    def dataset_manifest(self) -> DatasetManifest:
        return DatasetManifest(
            name="bare", shards=(ShardInfo(name="s", blob_id="0" * 64, samples=4),)
        )

    def train_window(
        self, weights: Mapping[str, torch.Tensor], indices: Sequence[int], *, steps: int, seed: int
    ) -> WindowResult:
        return WindowResult(dict(weights), 1.0, 1.0, len(indices))

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> float:
        return 2.5

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        pass


def test_a_torch_workload_has_every_capability_and_a_bare_one_none() -> None:
    built = _torch_workload()
    bare: Workload = Bare()
    assert isinstance(bare, Workload)
    for capability in CAPABILITIES:
        assert isinstance(built, capability), capability.__name__
        assert not isinstance(bare, capability), capability.__name__


def test_the_node_goes_without_what_it_does_not_need() -> None:
    bare = Bare()
    assert evaluate_head(bare, {}) == (2.5, None, 0)  # no perplexity, samples unknown
    assert model_config(bare) is None
    assert inner_lr_scaler(bare, InnerOptimizerSpec()) is None  # a constant rate
    assert warn_if_other_lr(bare, InnerOptimizerSpec(lr=0.5)) is None


def test_the_node_refuses_in_words_what_the_experiment_needs(tmp_path: Path) -> None:
    bare = Bare()
    cosine = InnerOptimizerSpec(schedule="cosine", decay_windows=10)
    with pytest.raises(LocalError, match="has no set_lr_scale"):
        inner_lr_scaler(bare, cosine)
    with pytest.raises(LocalError, match=r"cannot be given data.*PreparedDataUser"):
        attach_shards(bare, bare.dataset_manifest(), lambda shard: None, str(tmp_path))
    # a workload that validates on nothing of the prepared data's says nothing is missing
    assert attach_validation(bare, bare.dataset_manifest(), BlobStore(tmp_path / "blobs")) is None


def test_a_model_config_is_read_by_type() -> None:
    class Config:
        def to_dict(self) -> dict[str, int]:
            return {"n_layer": 2}

    built = _torch_workload()
    assert model_config(built) is None  # an nn.Sequential has no config
    built.model.config = Config()  # type: ignore[assignment]
    assert model_config(built) == {"n_layer": 2}
    built.model.config = "not a config"  # type: ignore[assignment]
    assert model_config(built) is None
