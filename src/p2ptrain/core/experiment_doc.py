"""``docs/experiment.md``: the reference of the experiment file, as Markdown, generated from
the tables of :mod:`p2ptrain.core.experiment_reference` and
:mod:`p2ptrain.core.workload_settings` (``p2ptrain experiment template --doc`` prints it)."""

from __future__ import annotations

from p2ptrain.core.experiment_reference import SECTIONS, Key, experiment_keys, toml_value
from p2ptrain.core.workload_settings import BUILT_IN_WORKLOADS, ConfigValue

__all__ = ["REGENERATE", "reference_markdown"]

#: The command that writes the reference where the repository keeps it.
REGENERATE = "p2ptrain experiment template --doc > docs/experiment.md"

_INTRO = f"""\
# The experiment file

<!-- Generated from src/p2ptrain/core/experiment_reference.py (the keys) and
src/p2ptrain/core/workload_settings.py (the built-in workloads' settings) by
`{REGENERATE}`. Edit those files, not this one:
tests/unit/core/test_experiment_reference.py fails while they differ. -->

An experiment definition is a TOML file: top-level keys, then one table per component. It
defines one training run, which a seed signs into the experiment manifest
(docs/protocol.md §4) whose id every node joins.

- `p2ptrain experiment template [--workload REF] > experiment.toml` prints a starting file
  for a workload (`char-gpt` when none is given): the keys it needs, and every other key
  commented out with its default and meaning.
- `p2ptrain demo --experiment-toml experiment.toml` trains it on this machine (with the
  demo's own validators, reducers and quorum).
- `p2ptrain seed --experiment-toml experiment.toml` signs it and starts the network. The
  seed builds the workload and fills in what it computes, the keys marked *filled in by the
  seed* below, unless the file gives them.
- `p2ptrain experiment create experiment.toml` signs a file that gives every key itself.

A key left out takes its default. An unknown key, a value of the wrong type or out of range
is refused with the key named, e.g. `window.min_updates: must be between 1 and 1000000, got
0`. Numbers may be written as integers. Public keys and ids are hex strings.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(key: Key) -> str:
    if not key.doc.written:
        return "never written"
    if key.doc.seed_fills or (not key.has_default and key.seed_fills):
        return "filled in by the seed"
    if not key.has_default:
        return "required"
    if key.default is None:
        return "not set"
    return f"`{toml_value(key.default)}`"


def _values(key: Key) -> str:
    choices = ", ".join(f"`{choice}`" for choice in key.doc.choices)
    return "; ".join(part for part in (choices, key.doc.values) if part)


def _meaning(key: Key) -> str:
    if key.doc.seed_fills:
        return f"{key.doc.meaning} Filled in by the seed: {key.doc.seed_fills}."
    return key.doc.meaning


def _section(section: str, keys: list[Key]) -> list[str]:
    doc = SECTIONS[section]
    lines = [f"## {doc.header}", "", doc.meaning]
    if doc.seed_fills:
        lines[-1] += f" Filled in by the seed: {doc.seed_fills}."
    lines += ["", "| key | type | default | values | meaning |", "|---|---|---|---|---|"]
    for key in keys:
        cells = (f"`{key.name}`", key.toml_type, _default(key), _values(key), _meaning(key))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return [*lines, ""]


def _setting_type(default: ConfigValue | None) -> str:
    if isinstance(default, bool):
        return "boolean"
    if isinstance(default, int):
        return "integer"
    if isinstance(default, float):
        return "number"
    return "string"


def _workloads() -> list[str]:
    lines = [
        "## Built-in workloads' `[workload.config]`",
        "",
        "What `[workload] config` holds for the workloads p2ptrain ships. Your own workload "
        "takes whatever its factory reads.",
        "",
    ]
    for name, workload in BUILT_IN_WORKLOADS.items():
        lines += [f"### `{name}`", "", workload.summary, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, setting in workload.settings.items():
            default = "not set" if setting.default is None else f"`{toml_value(setting.default)}`"
            cells = (f"`{key}`", _setting_type(setting.default), default, setting.meaning)
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    return lines


def reference_markdown() -> str:
    """The text of ``docs/experiment.md``."""
    by_section: dict[str, list[Key]] = {}
    for key in experiment_keys():
        by_section.setdefault(key.section, []).append(key)
    lines = [_INTRO]
    for section, keys in by_section.items():
        lines += _section(section, keys)
    lines += _workloads()
    return "\n".join(lines).rstrip("\n") + "\n"
