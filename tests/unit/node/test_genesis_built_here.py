"""A joining trainer builds the genesis weights from its workload instead of downloading
them: kept when they hash to the manifest's ``genesis_weights``; when they differ (an
unseeded model) or cannot be built, nothing is kept and the join downloads them, saying why
(a warning for a workload built from the manifest, which should have matched)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from p2ptrain.core.encoding import sha256_hex
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.tensors import encode_state_dict
from p2ptrain.errors import LocalError
from p2ptrain.node.join import _built_here
from p2ptrain.node.local_network import experiment_toml
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import GenesisBuilder, NodeSettings, Prepared, prepare
from p2ptrain.node.workload_check import build_workload
from p2ptrain.store.datadir import DataDir

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "batch_size": 4}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """An experiment a seed created for the built-in char GPT."""
    tmp_path = tmp_path_factory.mktemp("seed")
    definition = tmp_path / "experiment.toml"
    definition.write_text(
        experiment_toml(
            validators=[Identity.generate().public_key.hex()],
            reducers=[],
            quorum=1,
            workload={"name": "char-gpt", "config": TINY},
            inner_steps=2,
            deadline_s=10.0,
            proposal_s=2.0,
            min_updates=1,
            max_updates=2,
        )
    )
    settings = NodeSettings(data_dir=tmp_path / "seed", roles=("seed",), experiment_toml=definition)
    with DataDir(settings.data_dir, exclusive=True) as datadir:
        return asyncio.run(prepare(settings, NodeStore(datadir)))


def _join(
    tmp_path: Path, seeded: Prepared, builder: GenesisBuilder
) -> tuple[Prepared | None, list[str]]:
    """``_built_here`` for a trainer's fresh data directory: what it prepared, and the
    blob ids its store then holds."""
    with DataDir(tmp_path / "trainer", exclusive=True) as datadir:
        store = NodeStore(datadir)
        manifests = (seeded.network, seeded.experiment)
        prepared = asyncio.run(_built_here(Identity.generate(), store, manifests, builder))
        held = [b for b in (seeded.experiment.record.genesis_weights,) if store.blobs.has(b)]
    return prepared, held


_BUILT: dict[str, Mapping[str, torch.Tensor]] = {}


def _workload_genesis(manifest: ExperimentManifest) -> Mapping[str, torch.Tensor]:
    """The built-in workload's initial weights, built from the manifest (once a module)."""
    key = manifest.genesis_weights
    if key not in _BUILT:
        _BUILT[key] = build_workload(manifest).initial_weights()
    return {name: tensor.clone() for name, tensor in _BUILT[key].items()}


def test_the_workloads_own_initial_weights_are_kept_and_not_downloaded(
    tmp_path: Path, seeded: Prepared
) -> None:
    manifest = seeded.experiment.record
    prepared, held = _join(tmp_path, seeded, GenesisBuilder(_workload_genesis, expected=True))
    assert prepared is not None and held == [manifest.genesis_weights]
    assert prepared.experiment.record_id == seeded.experiment.record_id
    for name, tensor in seeded.genesis.items():
        assert torch.equal(prepared.genesis[name], tensor), name
    assert sha256_hex(encode_state_dict(prepared.genesis)) == manifest.genesis_weights


def test_other_weights_are_downloaded_and_the_log_says_why(
    tmp_path: Path, seeded: Prepared, caplog: pytest.LogCaptureFixture
) -> None:
    def unseeded(manifest: ExperimentManifest) -> Mapping[str, torch.Tensor]:
        weights = _workload_genesis(manifest)
        return {name: tensor + 1.0 for name, tensor in weights.items()}

    with caplog.at_level(logging.INFO, logger="p2ptrain.node.join"):
        prepared, held = _join(tmp_path / "a", seeded, GenesisBuilder(unseeded, expected=True))
    assert prepared is None and held == []
    (said,) = [r for r in caplog.records if "downloading the experiment's" in r.getMessage()]
    assert said.levelno == logging.WARNING
    assert seeded.experiment.record.genesis_weights[:12] in said.getMessage()
    assert "torch.manual_seed" in said.getMessage()

    caplog.clear()  # a model the user built (Trainer API) has its own weights: no alarm
    with caplog.at_level(logging.INFO, logger="p2ptrain.node.join"):
        prepared, _ = _join(tmp_path / "b", seeded, GenesisBuilder(unseeded, expected=False))
    assert prepared is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_a_workload_that_cannot_be_built_here_leaves_the_download(
    tmp_path: Path, seeded: Prepared, caplog: pytest.LogCaptureFixture
) -> None:
    def missing(manifest: ExperimentManifest) -> Mapping[str, torch.Tensor]:
        raise LocalError("pass --workload path/to/file.py:factory")

    with caplog.at_level(logging.INFO, logger="p2ptrain.node.join"):
        prepared, held = _join(tmp_path, seeded, GenesisBuilder(missing, expected=True))
    assert prepared is None and held == []
    assert "cannot be built here (pass --workload" in caplog.text
