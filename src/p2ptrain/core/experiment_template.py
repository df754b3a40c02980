"""``p2ptrain experiment template``: a commented starting file for an experiment.

The file is generated from the same tables as ``docs/experiment.md``
(:mod:`p2ptrain.core.experiment_reference`, :mod:`p2ptrain.core.workload_settings`): the
keys a seed needs are written out, every other key is commented out with its default and
meaning, and the keys the seed fills in are named. Nothing here imports a workload: a
reference to the user's code is checked for its form only.
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from p2ptrain.core.experiment_reference import (
    SECTIONS,
    Key,
    TomlValue,
    experiment_keys,
    toml_key,
    toml_value,
)
from p2ptrain.core.field_rules import check_name
from p2ptrain.core.workload_settings import BUILT_IN_WORKLOADS
from p2ptrain.errors import InvalidRecord, LocalError

__all__ = ["DEFAULT_WORKLOAD", "experiment_template"]

#: The workload of a template when none is named (the demo's).
DEFAULT_WORKLOAD = "char-gpt"
_WIDTH = 90
#: What a template of a built-in or installed workload leaves out of ``[workload]``.
_NAMED = frozenset({"reference"})


@dataclass(frozen=True)
class _Workload:
    """What the ``[workload]`` table of a template says."""

    #: The ``[workload]`` keys written out (``name`` or ``reference``).
    given: dict[str, TomlValue]
    #: The ``[workload]`` keys left out (``reference`` of a named workload).
    skip: frozenset[str]
    #: A comment on ``[workload.config]``.
    about_config: str
    #: ``[workload.config]`` keys written out, then those shown commented out, each with
    #: its meaning.
    config: dict[str, TomlValue] = field(default_factory=dict)
    optional: dict[str, tuple[TomlValue, str]] = field(default_factory=dict)
    meanings: dict[str, str] = field(default_factory=dict)


def _comment(text: str, indent: str = "") -> list[str]:
    wrapped = textwrap.wrap(text, _WIDTH, break_long_words=False, break_on_hyphens=False)
    return [f"{indent}# {line}" for line in wrapped]


def _is_reference(text: str) -> bool:
    """Whether ``text`` points at code, as the workload registry reads it."""
    return ":" in text


def _workload(code: str, installed: Collection[str]) -> _Workload:
    """The ``[workload]`` of a template for ``code``: a built-in or installed name, or a
    reference to the user's code."""
    built_in = BUILT_IN_WORKLOADS.get(code)
    if built_in is not None:
        optional: dict[str, tuple[TomlValue, str]] = {
            key: (setting.default, setting.meaning)
            for key, setting in built_in.settings.items()
            if setting.default is not None and key not in built_in.start
        }
        meanings = {key: setting.meaning for key, setting in built_in.settings.items()}
        about = f"{code}'s settings. {built_in.summary} A setting commented out takes its default."
        return _Workload({"name": code}, _NAMED, about, dict(built_in.start), optional, meanings)
    if _is_reference(code):
        where, _, factory = code.rpartition(":")
        if not where or not factory.isidentifier() or len(code) > 256:
            raise LocalError(
                f"workload {code!r:.120}: a reference is path/to/file.py:factory or "
                "package.module:factory (at most 256 characters)"
            )
        about = f"The settings passed to your factory, {factory}(config); for example: width = 256."
        return _Workload({"reference": code}, frozenset(), about)
    try:
        check_name("workload", code)
    except InvalidRecord as exc:
        raise LocalError(f"{exc.field}: {exc.problem}") from None
    if code not in installed:
        known = sorted({*BUILT_IN_WORKLOADS, *installed})
        raise LocalError(
            f"unknown workload {code!r}; known: {', '.join(known)}. Give your own code as "
            "path/to/file.py:factory or package.module:factory, or install the package that "
            "registers it (entry point group 'p2ptrain.workloads')"
        )
    return _Workload({"name": code}, _NAMED, f"The settings the workload {code} reads.")


def _key_lines(key: Key, given: dict[str, TomlValue]) -> list[str]:
    doc = key.doc
    if key.name in given:
        value = given[key.name]
        return ["", *_comment(doc.meaning), f"{toml_key(key.name)} = {toml_value(value)}"]
    if key.doc.seed_fills:
        return ["", *_comment(f"{key.name}: left out, the seed fills in {doc.seed_fills}.")]
    lines = ["", *_comment(doc.meaning)]
    if key.required:
        if doc.example is None:
            raise ValueError(f"the required key {key.path} has no example in KEYS")
        return [*lines, f"{toml_key(key.name)} = {toml_value(doc.example)}"]
    shown = doc.example if key.default is None or key.default == {} else key.default
    if shown is None:
        raise ValueError(f"the key {key.path} has neither a default nor an example in KEYS")
    return [*lines, f"# {toml_key(key.name)} = {toml_value(shown)}"]


def _config_lines(workload: _Workload) -> list[str]:
    lines = ["", *_comment(workload.about_config), "[workload.config]"]
    for name, value in workload.config.items():
        if name in workload.meanings:
            lines += ["", *_comment(workload.meanings[name])]
        lines.append(f"{toml_key(name)} = {toml_value(value)}")
    for name, (default, meaning) in workload.optional.items():
        lines += ["", *_comment(meaning), f"# {toml_key(name)} = {toml_value(default)}"]
    return lines


def _section_lines(section: str, keys: Iterable[Key], workload: _Workload) -> list[str]:
    doc = SECTIONS[section]
    parent = section.rpartition(".")[0]
    if parent and SECTIONS[parent].seed_fills:
        return []  # named with the table it is in
    if doc.seed_fills:
        inner = ", ".join(
            s.header for name, s in SECTIONS.items() if name.startswith(f"{section}.")
        )
        return [
            "",
            "",
            *_comment(
                f"{doc.header} (with {inner}): left out, the seed fills in {doc.seed_fills}. "
                "`p2ptrain experiment create` needs it written out (docs/experiment.md)."
            ),
        ]
    given: dict[str, TomlValue] = {}
    skip: frozenset[str] = frozenset()
    if section == "workload":
        given, skip = workload.given, workload.skip | {"config"}
    lines = []
    if section:
        header = f"# {doc.header}" if doc.definition_only else doc.header
        lines += ["", "", *_comment(doc.meaning), header]
    for key in keys:
        if not key.doc.written or key.name in skip:
            continue
        lines += _key_lines(key, given)
    if section == "workload":
        lines += _config_lines(workload)
    return lines


def experiment_template(workload: str = DEFAULT_WORKLOAD, installed: Collection[str] = ()) -> str:
    """A commented starting file for an experiment training ``workload`` (a built-in name,
    a name among ``installed``, or a reference to code); LocalError for anything else."""
    chosen = _workload(workload, installed)
    lines = [
        f"# An experiment definition for the workload {workload}. Every key is explained in",
        "# docs/experiment.md (`p2ptrain experiment template --doc` prints it).",
        "#",
        "#   p2ptrain demo --experiment-toml FILE    trains it on this machine",
        "#   p2ptrain seed --experiment-toml FILE    signs it and starts a network (put your",
        "#                                           validators' keys in `validators` first)",
        "#",
        "# The seed builds the workload and fills in what it computes. A key commented out",
        "# takes the default it shows.",
    ]
    by_section: dict[str, list[Key]] = {}
    for key in experiment_keys():
        by_section.setdefault(key.section, []).append(key)
    for section, keys in by_section.items():
        lines += _section_lines(section, keys, chosen)
    return "\n".join(lines) + "\n"
