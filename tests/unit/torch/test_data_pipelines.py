"""Data pipelines (indexed, generated, custom) and a trainer's shard cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from p2ptrain.core.manifests import DatasetManifest, ShardInfo
from p2ptrain.data.pipelines import (
    CustomData,
    DataPipeline,
    GeneratedData,
    IndexedData,
    ShardedData,
    as_pipeline,
)
from p2ptrain.data.shards import lease_indices
from p2ptrain.errors import LocalError
from p2ptrain.node.shard_cache import CACHE_FILE, ShardCache
from p2ptrain.protocol.leases import Lease
from p2ptrain.store.blobs import BlobStore
from p2ptrain.torch.workload import TorchWorkload


def _square(index: int, generator: torch.Generator) -> torch.Tensor:
    return torch.tensor([float(index), torch.rand((), generator=generator).item()])


def test_indexed_data_is_a_map_style_dataset_hashed_into_shards() -> None:
    rows = [torch.tensor([i]) for i in range(10)]
    data = as_pipeline(rows, name="rows", samples_per_shard=4)
    assert isinstance(data, IndexedData) and isinstance(data, DataPipeline)
    manifest = data.dataset_manifest()
    assert manifest.kind == "indexed"
    assert [s.samples for s in manifest.shards] == [4, 4, 2]
    said = data.describe()
    assert said.kind == "indexed" and "10 samples" in said.descriptor
    assert data.view()[7].item() == 7


def test_an_iterable_dataset_is_sent_to_prepare() -> None:
    with pytest.raises(LocalError, match="p2ptrain data prepare"):
        as_pipeline(iter([1, 2, 3]), name="stream", samples_per_shard=4)


def test_generated_samples_follow_from_index_and_seed_alone() -> None:
    one = GeneratedData(_square, samples=100, name="made", samples_per_shard=32, seed=7)
    two = GeneratedData(_square, samples=100, name="made", samples_per_shard=32, seed=7)
    other = GeneratedData(_square, samples=100, name="made", samples_per_shard=32, seed=8)
    assert one.dataset_manifest() == two.dataset_manifest()
    assert one.dataset_manifest().kind == "generated"
    assert one.dataset_manifest().shards[0].blob_id != other.dataset_manifest().shards[0].blob_id
    assert torch.equal(one.view()[42], two.view()[42])
    assert not torch.equal(one.view()[42], other.view()[42])
    assert one.view()[42][0].item() == 42.0
    assert one.describe().location is None and "seed 7" in one.describe().descriptor


def test_custom_data_asks_the_callback_for_each_lease() -> None:
    asked: list[tuple[int, list[int]]] = []

    def load(lease: Lease, indices: list[int]) -> list[torch.Tensor]:
        asked.append((lease.window, indices))
        return [torch.tensor([i * 10]) for i in indices]

    data = CustomData(load, samples=20, name="mine", samples_per_shard=8, identity="v1")
    manifest = data.dataset_manifest()
    assert manifest.kind == "custom"
    lease = Lease(window=3, peer_id="p", parts=((manifest.shards[1].name, 0, 4),))
    data.begin_lease(lease)
    indices = lease_indices(manifest, lease)
    assert asked == [(3, indices)]
    assert [data.view()[i].item() for i in indices] == [i * 10 for i in indices]
    with pytest.raises(LocalError, match="not in the lease of window 3"):
        data.view()[0]


def test_custom_data_that_returns_too_few_samples_is_named() -> None:
    data = CustomData(lambda lease, indices: [], samples=8, name="short", samples_per_shard=8)
    lease = Lease(window=2, peer_id="p", parts=((data.dataset_manifest().shards[0].name, 0, 3),))
    with pytest.raises(LocalError, match="returned 0 samples for the lease of window 2"):
        data.begin_lease(lease)


def test_a_workload_without_training_data_says_where_it_comes_from() -> None:
    model = torch.nn.Linear(2, 2)
    workload = TorchWorkload(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        None,
        [(torch.zeros(2), torch.tensor(0))],
        batch_size=1,
        samples_per_shard=4,
        name="none",
    )
    with pytest.raises(LocalError, match=r"\[data\] prepared"):
        workload.dataset_manifest()
    workload.dry_run()  # stands in with the validation rows
    generated = GeneratedData(
        lambda i, g: (torch.rand(2, generator=g), torch.tensor(i % 2)),
        samples=16,
        name="pairs",
        samples_per_shard=8,
    )
    workload.use_data(generated)
    assert workload.dataset_manifest().kind == "generated"
    result = workload.train_window(workload.initial_weights(), list(range(8)), steps=2, seed=0)
    assert result.samples == 2


# -- the shard cache -----------------------------------------------------------------------


def _sharded(store: BlobStore, sizes: list[int]) -> DatasetManifest:
    shards = []
    for i, size in enumerate(sizes):
        data = bytes([i % 251]) * size
        blob_id = hashlib.sha256(data).hexdigest()
        shards.append(ShardInfo(name=f"d-{i:05d}", blob_id=blob_id, samples=4, bytes=size))
    return DatasetManifest(name="d", shards=tuple(shards), kind="sharded")


def _bytes_of(manifest: DatasetManifest, index: int) -> bytes:
    return bytes([index % 251]) * manifest.shards[index].bytes


def test_the_cache_evicts_the_least_recently_leased_shards_and_remembers_the_order(
    tmp_path: Path,
) -> None:
    store = BlobStore(tmp_path / "blobs")
    manifest = _sharded(store, [100] * 5)
    cache = ShardCache(store, manifest, tmp_path / CACHE_FILE, limit_bytes=300)
    for i in range(4):
        shard = manifest.shards[i]
        assert not cache.held(shard)
        store.put(_bytes_of(manifest, i))
        cache.fetched(shard, shard.bytes)
        evicted = cache.leased([shard.name])
        assert evicted == (set() if i < 3 else {"d-00000"})
    assert json.loads((tmp_path / CACHE_FILE).read_text())["leased"].keys() == {
        "d-00001",
        "d-00002",
        "d-00003",
    }
    # shard 1 leased again: shard 2 is now the least recently leased
    cache.leased(["d-00001"])
    again = ShardCache(store, manifest, tmp_path / CACHE_FILE, limit_bytes=300)
    store.put(_bytes_of(manifest, 4))
    assert again.leased(["d-00004"]) == {"d-00002"}
    status = again.status("sharded", "d", None)
    assert (status.shards_held, status.bytes_held, status.evicted_shards) == (3, 300, 1)


def test_a_shard_that_rotted_on_disk_is_fetched_again(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    manifest = _sharded(store, [64, 64])
    shard = manifest.shards[0]
    store.put(_bytes_of(manifest, 0))
    path = store.path(shard.blob_id)
    path.write_bytes(b"x" * 64)
    cache = ShardCache(store, manifest, tmp_path / CACHE_FILE, limit_bytes=None)
    assert not cache.held(shard)
    assert not store.has(shard.blob_id)


def test_sharded_data_names_a_shard_that_is_not_here(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    manifest = _sharded(store, [64])
    cache = ShardCache(store, manifest, tmp_path / CACHE_FILE, limit_bytes=None)
    data = ShardedData(manifest, cache.locate)
    assert not cache.held(manifest.shards[0])
    with pytest.raises(LocalError, match="d-00000"):
        data.view()[0]


def test_status_tells_a_person_what_the_trainer_trains_on() -> None:
    from p2ptrain.cli.node_commands import describe_status
    from p2ptrain.observe.status import DataStatus, NodeStatus

    status = NodeStatus(
        peer_id="p" * 64,
        roles=("trainer",),
        address=None,
        experiment_id="e" * 64,
        height=3,
        head_id="h" * 64,
        adopted_head_id="h" * 64,
        data=DataStatus(
            kind="sharded",
            descriptor="prepared shards 'tokens': 10 samples in 2 shards, 2.0 MiB",
            location="/d/blobs",
            shards_held=1,
            bytes_held=1 << 20,
            cache_limit_bytes=4 << 30,
            fetched_shards=1,
            downloaded_bytes=1 << 20,
            leased_shards=1,
            leased_bytes=1 << 20,
        ),
    )
    lines = describe_status(status)
    assert "data       sharded: prepared shards 'tokens'" in "\n".join(lines)
    shards = next(line for line in lines if line.startswith("shards"))
    assert "1 held (1.0 MiB of 4,096.0 MiB) in /d/blobs; fetched 1 (1.0 MiB)" in shards
