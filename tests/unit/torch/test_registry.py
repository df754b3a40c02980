"""Finding a workload by name or reference: files, modules, entry points, factories with or
without a config, parts dicts, and the errors that name what went wrong."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from p2ptrain.errors import LocalError
from p2ptrain.torch import registry
from p2ptrain.torch.registry import (
    ENTRY_POINT_GROUP,
    config_hash,
    is_reference,
    known_workloads,
    make_workload,
    reference_name,
    resolve_factory,
)
from p2ptrain.torch.workload import TorchWorkload
from p2ptrain.torch.workload_parts import workload_from_parts

#: A user's model file: a factory taking the config, one taking nothing, one that raises,
#: and a name that is not a function.
MODEL_FILE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def _data():
    return TensorDataset(torch.zeros(8, 2), torch.zeros(8, dtype=torch.long))


def factory(config):
    torch.manual_seed(0)
    model = nn.Linear(2, int(config.get("width", 3)))
    return {"model": model, "train": _data(), "val": _data(), "batch_size": 4,
            "samples_per_shard": 4}


def plain():
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    return {"model": model, "train": _data(), "val": _data(), "batch_size": 2,
            "samples_per_shard": 4}


def broken(config):
    raise ValueError("boom in the factory")


def not_a_workload(config):
    return 42


factory_count = 3
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def _parts(**changes: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    data = TensorDataset(torch.ones(4, 1), torch.zeros(4, dtype=torch.long))
    parts: dict[str, Any] = {"model": model, "train": data, "val": data, "batch_size": 2}
    parts.update(changes)
    return parts


def test_a_file_reference_calls_a_factory_with_the_config(model_file: Path) -> None:
    workload = make_workload(f"{model_file}:factory", {"width": 5})
    assert isinstance(workload, TorchWorkload)
    assert workload.batch_size == 4
    assert workload.initial_weights()["weight"].shape == (5, 2)
    # the dataset is named after the factory, cut into shards of 4 samples
    shards = workload.dataset_manifest().shards
    assert [s.name for s in shards] == ["factory-00000", "factory-00001"]
    assert [s.samples for s in shards] == [4, 4]


def test_a_zero_argument_factory_is_called_without_the_config(model_file: Path) -> None:
    workload = make_workload(f"{model_file}:plain", {})
    assert workload.batch_size == 2
    assert workload.initial_weights()["weight"].shape == (3, 2)
    with pytest.raises(LocalError, match=r"takes no config.*\['width'\]"):
        make_workload(f"{model_file}:plain", {"width": 5})


def test_a_file_reference_leaves_sys_path_as_it_was(model_file: Path) -> None:
    before = list(sys.path)
    resolve_factory(f"{model_file}:factory")
    assert sys.path == before


def _line_of(text: str, code: str) -> int:
    return text.splitlines().index(code) + 1


def test_a_factory_that_raises_is_named_with_its_exception_and_its_last_frame(
    model_file: Path,
) -> None:
    reference = f"{model_file}:broken"
    with pytest.raises(LocalError) as info:
        make_workload(reference, {})
    assert reference in str(info.value)
    line = _line_of(MODEL_FILE, '    raise ValueError("boom in the factory")')
    assert str(info.value).endswith(
        f"ValueError: boom in the factory (at {model_file}, line {line}, in broken)"
    )


def test_the_command_prints_one_line_and_under_v_the_factorys_traceback(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2ptrain.cli.main import main

    definition = tmp_path / "experiment.toml"
    definition.write_text(f'[workload]\nreference = "{model_file}:broken"\n')
    command = ["experiment", "coverage", "--experiment-toml", str(definition)]
    command += ["--trainers", "2", "--windows", "1"]
    line = _line_of(MODEL_FILE, '    raise ValueError("boom in the factory")')

    assert main(command) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[-1].startswith("p2ptrain: error: workload ")
    assert errors[-1].endswith(f"(at {model_file}, line {line}, in broken)")
    assert not any("Traceback" in e for e in errors)

    assert main(["-v", *command]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[-1].startswith("p2ptrain: error: workload ")
    assert f'  File "{model_file}", line {line}, in broken' in errors


def test_a_factory_returning_neither_workload_nor_dict_is_refused(model_file: Path) -> None:
    with pytest.raises(LocalError, match="returned a int"):
        make_workload(f"{model_file}:not_a_workload", {})


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    with pytest.raises(LocalError) as info:
        resolve_factory(f"{missing}:factory")
    assert f"no file {missing}" in str(info.value)


def test_a_missing_or_non_callable_attribute_is_named(model_file: Path) -> None:
    with pytest.raises(LocalError, match="has no function 'absent'") as info:
        resolve_factory(f"{model_file}:absent")
    assert " is a " not in str(info.value)
    with pytest.raises(
        LocalError, match=r"has no function 'factory_count' \(factory_count is a int\)"
    ):
        resolve_factory(f"{model_file}:factory_count")


def test_a_reference_without_a_factory_name_is_refused(model_file: Path) -> None:
    for bad in (f"{model_file}:", f"{model_file}:not-an-identifier", ":factory"):
        with pytest.raises(LocalError, match=r"use path/to/file\.py:factory"):
            resolve_factory(bad)


def test_a_file_that_fails_to_import_is_named_and_forgotten(tmp_path: Path) -> None:
    path = tmp_path / "bad_syntax.py"
    path.write_text("def factory(:\n")
    with pytest.raises(LocalError, match=r"importing .*bad_syntax.py failed: SyntaxError"):
        resolve_factory(f"{path}:factory")
    # nothing half-imported stays behind: fixing the file makes it load
    path.write_text("def factory():\n    return 1\n")
    assert resolve_factory(f"{path}:factory")() == 1


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``p2ptrain_test_models`` with a module ``nets`` on a temporary sys.path."""
    name = "p2ptrain_test_models"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "nets.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


def test_a_module_reference_imports_the_package(package: str) -> None:
    workload = make_workload(f"{package}.nets:factory", {"width": 7})
    assert workload.initial_weights()["weight"].shape == (7, 2)
    assert workload.dataset_manifest().name == "factory"


def test_a_missing_module_says_to_install_it() -> None:
    with pytest.raises(LocalError) as info:
        resolve_factory("p2ptrain_no_such_package.models:factory")
    message = str(info.value)
    assert "no module 'p2ptrain_no_such_package.models'" in message
    assert "install the package" in message


@dataclass
class FakeEntryPoint:
    name: str
    value: str
    factory: Callable[..., Any] | None

    def load(self) -> Callable[..., Any]:
        if self.factory is None:
            raise ImportError("no module named fake_models")
        return self.factory


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Two installed entry points: ``fake-net`` (loads) and ``fake-broken`` (fails to);
    returns the groups the registry asked for."""
    asked: list[str] = []
    points = [
        FakeEntryPoint("fake-net", "fake_models.nets:workload", lambda: _parts(batch_size=3)),
        FakeEntryPoint("fake-broken", "fake_models.broken:workload", None),
    ]

    def fake_entry_points(*, group: str) -> list[FakeEntryPoint]:
        asked.append(group)
        return points

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    return asked


def test_an_entry_point_is_found_by_name(entry_points: list[str]) -> None:
    workload = make_workload("fake-net", {})
    assert workload.batch_size == 3
    assert entry_points and set(entry_points) == {ENTRY_POINT_GROUP}
    assert ENTRY_POINT_GROUP == "p2ptrain.workloads"


def test_an_entry_point_that_fails_to_load_is_named(entry_points: list[str]) -> None:
    with pytest.raises(LocalError) as info:
        resolve_factory("fake-broken")
    message = str(info.value)
    assert "'fake-broken'" in message and "fake_models.broken:workload" in message
    assert "ImportError: no module named fake_models" in message


def test_known_workloads_lists_built_ins_and_entry_points(entry_points: list[str]) -> None:
    known = known_workloads()
    assert {"char-gpt", "hf-causal-lm", "fake-net", "fake-broken"} <= set(known)
    assert list(known) == sorted(known)


def test_an_unknown_name_lists_the_known_ones_and_how_to_give_code(
    entry_points: list[str],
) -> None:
    with pytest.raises(LocalError) as info:
        resolve_factory("no-such-workload")
    message = str(info.value)
    assert "unknown workload 'no-such-workload'" in message
    assert "char-gpt" in message and "fake-net" in message
    assert "path/to/file.py:factory" in message and ENTRY_POINT_GROUP in message


def test_a_parts_dict_makes_a_workload_with_its_batch_size_and_loss() -> None:
    def absolute_error(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, _ = batch
        return (model(inputs) - 3.0).abs().mean()

    parts = _parts(batch_size=2, loss=absolute_error, name="ones")
    with torch.no_grad():
        parts["model"].weight.fill_(1.0)
        parts["model"].bias.fill_(0.5)
    workload = workload_from_parts(parts, where="test:parts")
    assert workload.batch_size == 2
    assert workload.batch_loss is absolute_error
    assert workload.dataset_manifest().name == "ones"
    # every input is 1: the model says 1 * 1 + 0.5 = 1.5, |1.5 - 3| = 1.5
    assert workload.evaluate(workload.initial_weights()) == pytest.approx(1.5)


def test_parts_default_to_adamw_and_the_factory_name() -> None:
    workload = workload_from_parts(_parts(), where="nets.py:my_factory")
    assert isinstance(workload.optimizer, torch.optim.AdamW)
    assert workload.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert workload.dataset_manifest().name == "my_factory"
    assert workload.dataset_manifest().shards[0].samples == 4  # 64 per shard by default


def test_a_non_ascii_factory_name_makes_a_valid_dataset_name() -> None:
    workload = workload_from_parts(_parts(), where="nets.py:modèle")
    assert workload.dataset_manifest().name == "mod-le"


def test_unknown_and_missing_parts_are_named() -> None:
    with pytest.raises(LocalError) as info:
        workload_from_parts(_parts(batchsize=2, lr=0.1), where="w.py:f")
    assert "unknown parts ['batchsize', 'lr']" in str(info.value)
    parts = _parts()
    del parts["val"], parts["batch_size"]
    with pytest.raises(LocalError, match=r"lacks \['val', 'batch_size'\]"):
        workload_from_parts(parts, where="w.py:f")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "not a model"}, "'model' is a str"),
        ({"batch_size": 0}, "'batch_size' must be a positive int, got 0"),
        ({"batch_size": True}, "'batch_size' must be a positive int, got True"),
        ({"batch_size": 2.0}, "'batch_size' must be a positive int, got 2.0"),
        ({"loss": "mse"}, "'loss' must be a function"),
    ],
)
def test_bad_parts_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(LocalError, match=message.replace("(", r"\(")):
        workload_from_parts(_parts(**changes), where="w.py:f")


def test_is_reference() -> None:
    assert not is_reference("char-gpt")
    assert not is_reference("my_pkg.models")
    assert is_reference("models/net.py:workload")
    assert is_reference("my_pkg.models:gpt")


@pytest.mark.parametrize(
    ("reference", "name"),
    [
        ("examples/hf_gpt2/workload.py:workload", "hf_gpt2.workload"),
        ("net.py:build", "net.build"),
        ("my_pkg.models:gpt", "my_pkg.models.gpt"),
        ("models:gpt", "models.gpt"),
        ("my dir/my net.py:make", "my-dir.my-net.make"),
        ("_private/_net.py:f", "private._net.f"),
        ("nets.py:modèle", "nets.mod-le"),
        ("/:", "workload"),
    ],
)
def test_reference_name(reference: str, name: str) -> None:
    assert reference_name(reference) == name


def test_reference_name_is_at_most_64_characters() -> None:
    assert reference_name("a" * 100 + ".py:f") == "a" * 64


def test_config_hash_is_the_sha256_of_the_sorted_compact_json() -> None:
    expected = hashlib.sha256(b'{"config":{"a":1,"b":"x"},"model_config":{}}').hexdigest()
    assert config_hash({"b": "x", "a": 1}, None) == expected
    assert config_hash({"a": 1, "b": "x"}, {}) == expected


def test_config_hash_changes_with_the_config_and_the_model_config() -> None:
    base = config_hash({"width": 4}, {"n_layer": 2})
    assert config_hash({"width": 4}, {"n_layer": 2}) == base
    assert config_hash({"width": 5}, {"n_layer": 2}) != base
    assert config_hash({"width": 4}, {"n_layer": 3}) != base
    assert config_hash({"width": 4}, None) != base
