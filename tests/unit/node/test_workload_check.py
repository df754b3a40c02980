"""Is the local workload the experiment's? Which code builds it, and what differs when it
is not: a parameter (with the DDP hint), the batch size, or a data shard."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest, ShardInfo, WorkloadSpec
from p2ptrain.core.tensors import schema_hash
from p2ptrain.errors import InvalidRecord, LocalError
from p2ptrain.node.setup import _workload_table
from p2ptrain.node.workload_check import (
    check_workload,
    dataset_difference,
    schema_difference,
    workload_code,
)
from p2ptrain.torch.workload import TorchWorkload
from tests.support.builders import experiment, h, identity

SEED = 0


def _samples(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.arange(n) % 2)


def _workload(
    model: nn.Module | None = None,
    *,
    batch_size: int = 8,
    train: TensorDataset | None = None,
) -> TorchWorkload:
    torch.manual_seed(SEED)
    model = model or nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return TorchWorkload(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train or _samples(),
        _samples(8),
        batch_size=batch_size,
        samples_per_shard=16,
        name="blobs",
    )


def _manifest(workload: TorchWorkload, **spec: object) -> ExperimentManifest:
    """An experiment of ``workload`` as its seed would record it."""
    fields: dict[str, object] = {
        "name": "blobs-mlp",
        "schema_hash": schema_hash(workload.initial_weights()),
        "batch_size": workload.batch_size,
    }
    fields.update(spec)
    return msgspec.structs.replace(
        experiment([identity(0)], quorum=1),
        workload=WorkloadSpec(**fields),  # type: ignore[arg-type]
        dataset=workload.dataset_manifest(),
    )


def _spec_manifest(name: str, reference: str = "") -> ExperimentManifest:
    manifest = experiment([identity(0)], quorum=1)
    spec = WorkloadSpec(name=name, schema_hash=h("schema"), reference=reference)
    return msgspec.structs.replace(manifest, workload=spec)


def test_a_referenced_workload_is_run_only_when_the_operator_gives_it() -> None:
    manifest = _spec_manifest("models.nets.workload", reference="models/nets.py:workload")
    with pytest.raises(LocalError) as info:
        workload_code(manifest, None)
    message = str(info.value)
    assert "--workload models/nets.py:workload" in message
    assert "'models.nets.workload'" in message and "'exp'" in message
    assert workload_code(manifest, "mine/nets.py:workload") == "mine/nets.py:workload"


def test_a_built_in_workload_is_built_from_its_name() -> None:
    manifest = _spec_manifest("char-gpt")
    assert workload_code(manifest, None) == "char-gpt"
    assert workload_code(manifest, "other.py:f") == "other.py:f"


def test_a_workload_not_installed_here_says_how_to_give_it() -> None:
    with pytest.raises(LocalError) as info:
        workload_code(_spec_manifest("not-installed-anywhere"), None)
    message = str(info.value)
    assert "not installed here" in message
    assert "--workload path/to/file.py:factory" in message


def test_the_experiments_own_workload_passes() -> None:
    workload = _workload()
    assert check_workload(_manifest(workload), workload, workload.initial_weights()) is workload


def test_a_different_layer_size_names_the_parameter_and_both_shapes() -> None:
    expected = _workload()
    manifest = _manifest(expected)
    local = _workload(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    with pytest.raises(LocalError) as info:
        check_workload(manifest, local, expected.initial_weights())
    # the first differing name in sorted order is the last layer's bias
    assert "parameter '2.bias' has shape (3,) locally, (2,) in the experiment" in str(info.value)
    # without the genesis weights, the schema hashes are named instead
    with pytest.raises(LocalError) as info:
        check_workload(manifest, local)
    ours = schema_hash(local.initial_weights())[:12]
    assert f"parameter schema {ours}, the experiment's {manifest.workload.schema_hash[:12]}" in (
        str(info.value)
    )


class _DataParallelLike(nn.Module):
    """What DistributedDataParallel looks like to state_dict: the model under ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_ddp_wrapped_model_gets_the_unwrap_hint() -> None:
    expected = _workload()
    torch.manual_seed(SEED)
    wrapped = _DataParallelLike(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    local = _workload(wrapped)
    with pytest.raises(LocalError) as info:
        check_workload(_manifest(expected), local, expected.initial_weights())
    message = str(info.value)
    assert "parameter '0.bias' is missing from the local model" in message
    assert "pass the unwrapped model, model.module" in message


def test_schema_difference_names_extra_prefixed_and_retyped_parameters() -> None:
    weight = torch.zeros(2, 2)
    assert schema_difference({"module.weight": weight}, {"weight": weight}) == (
        "the local model has a parameter 'module.weight' the experiment's has not "
        "(the 'module.' prefix means a DDP-wrapped model: pass model.module)"
    )
    assert schema_difference({"weight": weight, "extra": weight}, {"weight": weight}) == (
        "the local model has a parameter 'extra' the experiment's has not"
    )
    assert schema_difference({"weight": weight.double()}, {"weight": weight}) == (
        "parameter 'weight' is torch.float64 locally, torch.float32 in the experiment"
    )
    assert schema_difference({"weight": weight}, {"weight": weight}) == (
        "the parameter schemas differ"
    )


def test_a_different_batch_size_names_both_sizes() -> None:
    manifest = _manifest(_workload(batch_size=8))
    with pytest.raises(LocalError) as info:
        check_workload(manifest, _workload(batch_size=4))
    message = str(info.value)
    assert "the local batch size is 4" in message and "trains batches of 8" in message
    assert "batch_size=8" in message
    # an experiment that did not record its batch size (0) takes any
    unrecorded = _manifest(_workload(batch_size=8), batch_size=0)
    assert check_workload(unrecorded, _workload(batch_size=4)).batch_size == 4


def test_different_data_names_the_first_differing_shard() -> None:
    manifest = _manifest(_workload())
    changed = _samples()
    changed.tensors[0][20] += 1.0  # sample 20: the second shard of 16
    changed.tensors[0][40] += 1.0  # and the third, which is not the first difference
    with pytest.raises(LocalError) as info:
        check_workload(manifest, _workload(train=changed))
    message = str(info.value)
    assert "shard 1 (blobs-00001, samples from 16) has other contents locally" in message
    local_blob = _workload(train=changed).dataset_manifest().shards[1].blob_id
    assert f"hash {local_blob[:12]}" in message
    assert f"the experiment's {manifest.dataset.shards[1].blob_id[:12]}" in message


def _dataset(name: str, samples: list[int], labels: str = "s") -> DatasetManifest:
    return DatasetManifest(
        name=name,
        shards=tuple(
            ShardInfo(name=f"{name}-{i:05d}", blob_id=h(f"{labels}{i}"), samples=count)
            for i, count in enumerate(samples)
        ),
    )


def test_dataset_difference_in_words() -> None:
    expected = _dataset("d", [16, 16, 8])
    assert dataset_difference(_dataset("e", [16, 16, 8]), expected) == (
        "the local dataset is named 'e', the experiment's 'd'"
    )
    assert dataset_difference(_dataset("d", [16, 12, 8]), expected) == (
        "shard 1 (d-00001) holds 12 samples locally, 16 in the experiment"
    )
    assert dataset_difference(_dataset("d", [16, 16]), expected) == (
        "the local dataset has 2 shards, the experiment's 3"
    )
    assert dataset_difference(_dataset("d", [16, 16, 8], labels="t"), expected).startswith(
        "shard 0 (d-00000, samples from 0) has other contents"
    )


@pytest.mark.parametrize(
    ("workload", "given", "code", "table"),
    [
        # a built-in or installed name stays the name; a stale reference goes
        (
            {"name": "char-gpt", "reference": ""},
            None,
            "char-gpt",
            {"name": "char-gpt"},
        ),
        # a reference in name becomes reference, with a name made from it
        (
            {"name": "models/nets.py:workload", "config": {"width": 4}},
            None,
            "models/nets.py:workload",
            {
                "name": "models.nets.workload",
                "reference": "models/nets.py:workload",
                "config": {"width": 4},
            },
        ),
        # reference = ... keeps the author's name
        (
            {"name": "my-net", "reference": "models/nets.py:workload"},
            None,
            "models/nets.py:workload",
            {"name": "my-net", "reference": "models/nets.py:workload"},
        ),
        # ... or makes one when there is none
        (
            {"reference": "my_pkg.models:gpt"},
            None,
            "my_pkg.models:gpt",
            {"name": "my_pkg.models.gpt", "reference": "my_pkg.models:gpt"},
        ),
        # the seed's --workload wins, and names the workload
        (
            {"name": "my-net", "reference": "models/nets.py:workload"},
            "other/code.py:make",
            "other/code.py:make",
            {"name": "other.code.make", "reference": "other/code.py:make"},
        ),
        # --workload with a built-in name drops the file's reference
        (
            {"name": "my-net", "reference": "models/nets.py:workload"},
            "char-gpt",
            "char-gpt",
            {"name": "char-gpt"},
        ),
        # --workload alone needs no [workload] table
        (None, "models/nets.py:workload", "models/nets.py:workload", None),
    ],
)
def test_workload_table_normalises_name_and_reference(
    workload: dict[str, object] | None,
    given: str | None,
    code: str,
    table: dict[str, object] | None,
) -> None:
    raw: dict[str, object] = {"study": "s"} if workload is None else {"workload": workload}
    assert _workload_table(raw, given, Path("exp.toml")) == code
    if table is None:
        table = {"name": "models.nets.workload", "reference": code}
    assert raw["workload"] == table


def test_workload_table_without_a_workload_says_what_to_add() -> None:
    for raw in ({}, {"workload": {"config": {"width": 4}}}, {"workload": {"name": ""}}):
        with pytest.raises(LocalError) as info:
            _workload_table(dict(raw), None, Path("exp.toml"))
        message = str(info.value)
        assert message.startswith("exp.toml: [workload] needs a name")
        assert "--workload" in message
    with pytest.raises(LocalError, match=r"exp\.toml: \[workload\] must be a table"):
        _workload_table({"workload": "char-gpt"}, None, Path("exp.toml"))


def test_workload_spec_records_reference_config_hash_and_batch_size() -> None:
    spec = WorkloadSpec(
        name="models.nets.workload",
        schema_hash=h("schema"),
        reference="models/nets.py:workload",
        config_hash=h("config"),
        batch_size=8,
    )
    assert msgspec.json.decode(msgspec.json.encode(spec), type=WorkloadSpec) == spec
    bare = WorkloadSpec(name="char-gpt", schema_hash=h("schema"))
    assert (bare.reference, bare.config_hash, bare.batch_size) == ("", "", 0)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"config_hash": "abc"}, "workload.config_hash"),
        ({"config_hash": h("x").upper()}, "workload.config_hash"),
        ({"batch_size": -1}, "workload.batch_size"),
        ({"batch_size": (1 << 24) + 1}, "workload.batch_size"),
        ({"reference": "x" * 257}, "workload.reference"),
        ({"reference": "models/nets.py:work\nload"}, "workload.reference"),
        ({"name": "nets.modèle"}, "workload.name"),
    ],
)
def test_workload_spec_rejects_bad_fields(changes: dict[str, object], field: str) -> None:
    fields: dict[str, object] = {"name": "net", "schema_hash": h("schema")}
    fields.update(changes)
    with pytest.raises(InvalidRecord) as info:
        WorkloadSpec(**fields)  # type: ignore[arg-type]
    assert info.value.field == field
