"""The experiment file's reference and template: docs/experiment.md is what the schema's
tables generate, every key is documented, the documented ranges and choices are the ones
the schema checks, and a template parses into a valid experiment for every workload."""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.cli import experiment_commands
from p2ptrain.core.experiment_config import (
    defined_workload,
    experiment_from_tables,
    parse_experiment_toml,
)
from p2ptrain.core.experiment_doc import REGENERATE, reference_markdown
from p2ptrain.core.experiment_reference import (
    KEYS,
    SECTIONS,
    Key,
    experiment_keys,
    schema_paths,
    toml_value,
)
from p2ptrain.core.experiment_template import experiment_template
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.workload_settings import BUILT_IN_WORKLOADS
from p2ptrain.errors import LocalError

REPO = Path(__file__).resolve().parents[3]
AUTHORITY = bytes(range(32))
VALIDATOR = "ab" * 32


def _hex(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def test_the_committed_reference_is_what_the_schema_generates() -> None:
    committed = (REPO / "docs" / "experiment.md").read_text(encoding="utf-8")
    assert committed == reference_markdown(), (
        f"docs/experiment.md differs from the code's tables: run `{REGENERATE}`"
    )


def test_every_key_of_the_schema_is_documented_and_every_doc_is_a_key() -> None:
    paths = schema_paths()
    assert len(paths) == len(set(paths))
    assert set(paths) - set(KEYS) == set(), "schema keys without a KeyDoc in KEYS"
    assert set(KEYS) - set(paths) == set(), "KeyDocs for keys the schema no longer has"
    keys = experiment_keys()
    assert {key.section for key in keys} == set(SECTIONS)
    for key in keys:
        assert key.doc.meaning.endswith("."), key.path
        section = SECTIONS[key.section]
        assert section.header.strip("[]") == key.section or not key.section, section.header
    # a required key must have an example for the template
    assert all(key.doc.example is not None for key in keys if key.required)


# -- the documented ranges and choices are the schema's ------------------------------------


def _base(path: str) -> dict[str, Any]:
    """A complete definition with the sections ``path`` lies in."""
    tables: dict[str, Any] = {
        "network_id": _hex("network"),
        "study": "study",
        "name": "run",
        "validators": [VALIDATOR],
        "quorum": 1,
        "lease_size": 1,
        "genesis_weights": _hex("genesis"),
        "workload": {"name": "w", "schema_hash": _hex("schema")},
        "dataset": {
            "name": "d",
            "shards": [{"name": "s0", "blob_id": _hex("s0"), "samples": 10}],
        },
    }
    if path.startswith("dataset.validation."):
        dataset = tables["dataset"]
        dataset["kind"] = "sharded"
        dataset["shards"][0]["bytes"] = 5
        dataset["validation"] = [{"name": "v0", "blob_id": _hex("v0"), "samples": 4, "bytes": 5}]
    if path.startswith("dataset.tokenizer."):
        tables["dataset"]["tokenizer"] = {
            "kind": "huggingface",
            "vocab_size": 50257,
            "block_size": 64,
            "name": "GPT2TokenizerFast",
        }
    return tables


def _set(tables: dict[str, Any], path: str, value: Any) -> None:
    """Set ``path`` (``dataset.shards.samples``: of the first shard)."""
    *parents, leaf = path.split(".")
    table = tables
    for part in parents:
        table = table.setdefault(part, {})
        if isinstance(table, list):
            table = table[0]
    table[leaf] = value


#: What another key must be for a value to be allowed (rules that couple keys, each
#: documented with the key).
COUPLED: dict[tuple[str, Any], dict[str, Any]] = {
    ("protocol", "fedavg"): {
        "outer_optimizer.name": "sgd",
        "outer_optimizer.lr": 1.0,
        "outer_optimizer.momentum": 0.0,
    },
    ("outer_optimizer.name", "sgd"): {"outer_optimizer.momentum": 0.0},
    ("inner_optimizer.schedule", "cosine"): {"inner_optimizer.decay_windows": 10},
    ("window.min_updates", 1_000_000): {"window.max_updates": 1_000_000},
    ("dataset.kind", "sharded"): {"dataset.shards.bytes": 5},
    ("dataset.tokenizer.kind", "bytes"): {"dataset.tokenizer.vocab_size": 256},
    ("dataset.tokenizer.kind", "chars"): {
        "dataset.tokenizer.vocab_size": 3,
        "dataset.tokenizer.vocab": "abc",
        "dataset.tokenizer.name": "",
    },
}


def _manifest_with(path: str, value: Any) -> ExperimentManifest:
    tables = _base(path)
    for other, coupled in COUPLED.get((path, value), {}).items():
        _set(tables, other, coupled)
    _set(tables, path, value)
    return experiment_from_tables(tables, AUTHORITY)


def _key(path: str) -> Key:
    (key,) = (key for key in experiment_keys() if key.path == path)
    return key


@pytest.mark.parametrize("path", [path for path, doc in KEYS.items() if doc.bounds is not None])
def test_a_documented_range_is_what_the_schema_accepts(path: str) -> None:
    key = _key(path)
    assert key.doc.bounds is not None
    low, high = key.doc.bounds
    integer = key.toml_type == "integer"

    def value(x: float) -> int | float:
        return int(x) if integer else float(x)

    def beyond(x: float, direction: int) -> int | float:
        return int(x) + direction if integer else x + direction * max(abs(x) * 1e-6, 1e-9)

    ends = [low] if high is None else [low, high]
    for end in ends:
        _manifest_with(key.path, value(end))
    outside = [beyond(low, -1)] if high is None else [beyond(low, -1), beyond(high, 1)]
    for wrong in outside:
        with pytest.raises(LocalError, match=key.name):
            _manifest_with(key.path, wrong)


@pytest.mark.parametrize("path", [path for path, doc in KEYS.items() if doc.choices])
def test_documented_choices_are_what_the_schema_accepts(path: str) -> None:
    key = _key(path)
    for choice in key.doc.choices:
        _manifest_with(key.path, choice)
    with pytest.raises(LocalError, match=key.name):
        _manifest_with(key.path, "no-such-choice")


def test_a_default_shown_for_the_schema_s_is_the_same_manifest() -> None:
    for key in experiment_keys():
        if key.doc.default is None:
            continue
        left_out = experiment_from_tables(_base(key.path), AUTHORITY)
        assert _manifest_with(key.path, key.doc.default) == left_out, key.path


# -- templates -----------------------------------------------------------------------------


def _seed_fill(name: str) -> dict[str, Any]:
    """What a seed fills in (placeholders for what it computes from the workload)."""
    return {
        "network_id": _hex("network"),
        "workload": {
            "name": name,
            "schema_hash": _hex("schema"),
            "batch_size": 16,
            "config_hash": _hex("config"),
        },
        "dataset": {
            "name": "d",
            "shards": [
                {"name": f"s{i}", "blob_id": _hex(f"s{i}"), "samples": 256} for i in range(4)
            ],
        },
        "genesis_weights": _hex("genesis"),
        "lease_size": 800,
    }


_SETTING = re.compile(r"# ([A-Za-z_][A-Za-z0-9_]*) = (.+)")
_HEADER = re.compile(r"(?:# )?\[+([a-z_.]+)\]+")


def _uncommented(text: str, tables: set[str]) -> str:
    """``text`` with the commented-out ``key = value`` lines of ``tables`` uncommented,
    except for the examples (``config`` tables, ``parent``, ``start_head``)."""
    table, lines = "", []
    for line in text.splitlines():
        header = _HEADER.fullmatch(line)
        if header:
            table = header.group(1)
        setting = _SETTING.fullmatch(line)
        examples = {"config", "parent", "start_head"}
        uncomment = setting and table in tables and setting.group(1) not in examples
        lines.append(line[2:] if uncomment else line)
    return "\n".join(lines) + "\n"


WORKLOADS = [
    ("char-gpt", "char-gpt", "char-gpt"),
    ("hf-causal-lm", "hf-causal-lm", "hf-causal-lm"),
    (
        "examples/hf_gpt2/workload.py:workload",
        "examples/hf_gpt2/workload.py:workload",
        "hf_gpt2.workload",
    ),
    ("my_pkg.models:gpt", "my_pkg.models:gpt", "my_pkg.models.gpt"),
    ("installed-net", "installed-net", "installed-net"),
]


@pytest.mark.parametrize(("given", "code", "name"), WORKLOADS, ids=[w[0] for w in WORKLOADS])
def test_a_template_parses_into_a_valid_experiment(given: str, code: str, name: str) -> None:
    text = experiment_template(given, installed={"installed-net"})
    tables = parse_experiment_toml(text)
    assert "data" not in tables and "dataset" not in tables  # the seed fills the dataset in
    assert defined_workload(tables, None, "template") == code
    manifest = experiment_from_tables(tables, AUTHORITY, _seed_fill(name))
    assert manifest.workload.name == name
    assert manifest.workload.reference == (code if ":" in code else "")
    start = BUILT_IN_WORKLOADS[code].start if code in BUILT_IN_WORKLOADS else {}
    assert manifest.workload.config == start
    assert manifest.quorum == 1 and manifest.validators == (bytes(32),)
    # every default the template shows is the default: uncommented, the same experiment
    sections = {s for s in SECTIONS if s not in {"workload.config", "data"}}
    shown = parse_experiment_toml(_uncommented(text, sections))
    assert shown != tables
    assert experiment_from_tables(shown, AUTHORITY, _seed_fill(name)) == manifest


def test_a_template_refuses_an_unknown_workload_or_a_malformed_reference() -> None:
    with pytest.raises(LocalError, match="unknown workload 'char-gtp'; known: char-gpt"):
        experiment_template("char-gtp")
    with pytest.raises(LocalError, match=r"a reference is path/to/file\.py:factory"):
        experiment_template("models.py:")
    with pytest.raises(LocalError, match="workload: must be 1-128 characters"):
        experiment_template("two words")


def test_a_built_in_template_s_settings_are_the_workload_s_defaults() -> None:
    from p2ptrain.torch import char_gpt, hf_causal_lm

    defaults = {"char-gpt": char_gpt.DEFAULT_CONFIG, "hf-causal-lm": hf_causal_lm.DEFAULT_CONFIG}
    assert set(defaults) == set(BUILT_IN_WORKLOADS)
    for name, workload in BUILT_IN_WORKLOADS.items():
        documented = {k: s.default for k, s in workload.settings.items() if s.default is not None}
        assert documented == defaults[name], name
        tables = tomllib.loads(_uncommented(experiment_template(name), {"workload.config"}))
        assert tables["workload"]["config"] == {**defaults[name], **workload.start}, name


# -- the command -----------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    experiment_commands.add_parsers(parser.add_subparsers(), "data")
    args = parser.parse_args(["experiment", "template", *argv])
    code: int = args.handler(args)
    return code


def test_the_command_prints_a_template_or_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--workload", "hf-causal-lm"]) == 0
    assert capsys.readouterr().out == experiment_template("hf-causal-lm")
    assert _run([]) == 0
    assert capsys.readouterr().out == experiment_template("char-gpt")
    assert _run(["--doc"]) == 0
    assert capsys.readouterr().out == reference_markdown()
    with pytest.raises(LocalError, match=r"--doc: .* leave out --workload"):
        _run(["--doc", "--workload", "char-gpt"])


def test_the_command_names_the_registry_s_entry_point_group() -> None:
    from p2ptrain.torch.registry import ENTRY_POINT_GROUP

    assert experiment_commands.WORKLOAD_ENTRY_POINTS == ENTRY_POINT_GROUP


def test_the_template_command_does_not_import_torch() -> None:
    program = (
        "import argparse, sys\n"
        "from p2ptrain.cli.experiment_commands import run_template\n"
        "for workload, doc in (('hf-causal-lm', False), ('x.py:make', False), (None, True)):\n"
        "    run_template(argparse.Namespace(workload=workload, doc=doc))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_toml_values_read_back_as_written() -> None:
    values = {
        "s": 'a "quoted" \\ path\n',
        "i": -3,
        "f": 1e-6,
        "b": True,
        "l": ["x", 2],
        "t": {"a.b": 1, "c": "d"},
        "e": {},
    }
    text = "\n".join(f"{k} = {toml_value(v)}" for k, v in values.items())
    assert tomllib.loads(text) == values
    with pytest.raises(ValueError, match="finite"):
        toml_value(math.inf)
