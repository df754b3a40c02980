"""What ``p2ptrain demo`` trains: the built-in char GPT or the user's workload, and the
definition its seed signs (the user's settings kept, the demo's validators, reducers and
quorum, the window settings the user left out filled in)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.cli.demo_experiment import DemoExperiment, demo_experiment, demo_toml
from p2ptrain.errors import LocalError
from p2ptrain.torch.char_gpt import DEFAULT_CONFIG

USER_VALIDATOR = "11" * 32
DEMO_VALIDATORS = ["cc" * 32, "aa" * 32, "bb" * 32]
DEMO_REDUCER = "dd" * 32

USER_TOML = f"""
study = "mine"
inner_steps = 7
validators = ["{USER_VALIDATOR}"]
reducers = ["{USER_VALIDATOR}"]
quorum = 1
network_id = "{"ee" * 32}"

[workload]
name = "my-net"
reference = "models/nets.py:workload"
config = {{ width = 4 }}

[inner_optimizer]
lr = 0.01

[window]
deadline_s = 99.0
"""


def _defaults() -> dict[str, Any]:
    return {
        "study": "demo",
        "name": "nets.workload",
        "inner_steps": 50,
        "inner_optimizer": {"name": "adamw", "lr": 0.001},
        "window": {"deadline_s": 30.0, "proposal_s": 10.0, "min_updates": 1, "max_updates": 2},
    }


def _user_experiment(tmp_path: Path, workload: str | None = None) -> DemoExperiment:
    path = tmp_path / "experiment.toml"
    path.write_text(USER_TOML)
    return demo_experiment(workload, str(path))


def test_with_no_options_the_demo_trains_the_char_gpt() -> None:
    experiment = demo_experiment(None, None)
    assert experiment == DemoExperiment("char-gpt", dict(DEFAULT_CONFIG))
    assert experiment.built_in_char_gpt


def test_a_workload_alone_is_trained_with_an_empty_config() -> None:
    experiment = demo_experiment("models/nets.py:workload", None)
    assert experiment == DemoExperiment("models/nets.py:workload", {})
    assert not experiment.built_in_char_gpt


def test_a_definition_gives_the_workload_and_drops_who_validates(tmp_path: Path) -> None:
    experiment = _user_experiment(tmp_path)
    assert experiment.code == "models/nets.py:workload"  # reference before name
    assert experiment.config == {"width": 4}
    for dropped in ("validators", "reducers", "quorum", "network_id"):
        assert dropped not in experiment.tables
    assert experiment.tables["inner_steps"] == 7
    assert not experiment.built_in_char_gpt
    # --workload wins over the definition's, which still gives the config
    given = _user_experiment(tmp_path, workload="other.py:make")
    assert (given.code, given.config) == ("other.py:make", {"width": 4})


def test_a_definition_without_a_workload_or_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text('study = "mine"\n')
    with pytest.raises(LocalError, match=r"\[workload\] needs a name"):
        demo_experiment(None, str(path))
    assert demo_experiment("char-gpt", str(path)).code == "char-gpt"
    with pytest.raises(LocalError, match="cannot read the experiment definition"):
        demo_experiment(None, str(tmp_path / "missing.toml"))


def test_demo_toml_keeps_the_users_settings_and_takes_the_demos_processes(
    tmp_path: Path,
) -> None:
    experiment = _user_experiment(tmp_path)
    text = demo_toml(
        experiment,
        validators=DEMO_VALIDATORS,
        reducers=[DEMO_REDUCER],
        quorum=2,
        defaults=_defaults(),
    )
    tables = tomllib.loads(text)
    assert tables["study"] == "mine"
    assert tables["name"] == "nets.workload"
    assert tables["inner_steps"] == 7
    assert tables["inner_optimizer"] == {"name": "adamw", "lr": 0.01}
    # the user's deadline, the demo's other window settings
    assert tables["window"] == {
        "deadline_s": 99.0,
        "proposal_s": 10.0,
        "min_updates": 1,
        "max_updates": 2,
    }
    assert tables["validators"] == sorted(DEMO_VALIDATORS)
    assert tables["reducers"] == [DEMO_REDUCER]
    assert tables["quorum"] == 2
    assert "network_id" not in tables
    # the seed turns the reference in name into name + reference
    assert tables["workload"] == {"name": "models/nets.py:workload", "config": {"width": 4}}


def test_demo_toml_replaces_validators_the_tables_still_hold() -> None:
    experiment = DemoExperiment(
        "char-gpt", {"n_layer": 1}, {"validators": [USER_VALIDATOR], "quorum": 1}
    )
    tables = tomllib.loads(
        demo_toml(experiment, validators=DEMO_VALIDATORS, reducers=[], quorum=3, defaults={})
    )
    assert tables == {
        "validators": sorted(DEMO_VALIDATORS),
        "reducers": [],
        "quorum": 3,
        "workload": {"name": "char-gpt", "config": {"n_layer": 1}},
    }


def test_demo_toml_does_not_change_the_defaults_it_is_given(tmp_path: Path) -> None:
    defaults = _defaults()
    demo_toml(
        _user_experiment(tmp_path),
        validators=DEMO_VALIDATORS,
        reducers=[],
        quorum=2,
        defaults=defaults,
    )
    assert defaults == _defaults()


def test_demo_toml_counts_the_demos_own_trainers(tmp_path: Path) -> None:
    # a definition for a real network waits for 8 updates; the demo runs 2 trainers
    path = tmp_path / "mine.toml"
    path.write_text(
        '[workload]\nname = "char-gpt"\n[window]\ndeadline_s = 300.0\nmin_updates = 8\n'
        "max_updates = 8\n"
    )
    text = demo_toml(
        demo_experiment(None, str(path)),
        validators=DEMO_VALIDATORS,
        reducers=[DEMO_REDUCER],
        quorum=2,
        defaults=_defaults(),
    )
    window = tomllib.loads(text)["window"]
    assert (window["min_updates"], window["max_updates"], window["deadline_s"]) == (1, 2, 300.0)


def test_a_prepared_dataset_is_found_from_the_definitions_directory(tmp_path: Path) -> None:
    path = tmp_path / "exp" / "experiment.toml"
    path.parent.mkdir()
    path.write_text('[workload]\nname = "char-gpt"\n\n[data]\nprepared = "shards"\n')
    experiment = demo_experiment(None, str(path))
    assert experiment.prepared == (tmp_path / "exp" / "shards").resolve()
    assert experiment.tables["data"] == {"prepared": str(experiment.prepared)}
