"""Experiment definitions written by people, in TOML, turned into an ExperimentManifest.

The TOML mirrors the manifest: top-level keys for scalars and one table per component
(``[workload]``, ``[dataset]`` with ``[[dataset.shards]]``, ``[inner_optimizer]``,
``[outer_optimizer]``, ``[window]``, ``[codec]``, ``[aggregation]``, ``[screening]``).
Validator keys are hex; their order in the file does not matter. The authority is the key
that signs the manifest, so it is not written in the file. Any problem raises
:class:`~p2ptrain.errors.LocalError` naming the field. Every key is documented in
``docs/experiment.md``, generated from :mod:`p2ptrain.core.experiment_reference`.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from typing import Any

import msgspec

from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.errors import InvalidRecord, LocalError


def _public_keys(raw: object, field: str = "validators") -> list[bytes]:
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise LocalError(f"{field}: must be a list of hex Ed25519 public keys (64 hex chars)")
    keys: list[bytes] = []
    for i, text in enumerate(raw):
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise LocalError(f"{field}[{i}]: {text!r:.80} is not hex") from None
        if len(key) != 32:
            raise LocalError(f"{field}[{i}]: an Ed25519 public key is 32 bytes (64 hex chars)")
        keys.append(key)
    if len(set(keys)) != len(keys):
        raise LocalError(f"{field}: a key is listed twice")
    return sorted(keys)


def parse_experiment_toml(text: str) -> dict[str, Any]:
    """The tables of an experiment definition, before validation."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LocalError(f"the experiment file is not valid TOML: {exc}") from exc


def experiment_from_toml(
    text: str, authority: bytes, fill: Mapping[str, Any] | None = None
) -> ExperimentManifest:
    """Parse and validate an experiment definition; ``authority`` is the signer's key."""
    return experiment_from_tables(parse_experiment_toml(text), authority, fill)


def experiment_from_tables(
    tables: Mapping[str, Any], authority: bytes, fill: Mapping[str, Any] | None = None
) -> ExperimentManifest:
    """Validate a parsed experiment definition. ``fill`` supplies top-level keys (and keys
    of tables) the definition leaves out, e.g. the dataset, schema hash and genesis weights
    a registered workload computes."""
    raw = dict(tables)
    for key, value in (fill or {}).items():
        if key not in raw:
            raw[key] = value
        elif isinstance(value, dict) and isinstance(raw[key], dict):
            raw[key] = {**value, **raw[key]}
    if "authority" in raw:
        raise LocalError(
            "authority: leave it out; the key that signs the manifest is the authority"
        )
    raw["validators"] = _public_keys(raw.get("validators"))
    if "reducers" in raw:
        raw["reducers"] = _public_keys(raw["reducers"], "reducers")
    raw["authority"] = authority
    try:
        return msgspec.convert(raw, ExperimentManifest)
    except InvalidRecord as exc:
        raise LocalError(f"{exc.field}: {exc.problem}") from exc
    except msgspec.ValidationError as exc:
        raise LocalError(_describe(str(exc))) from exc


def _describe(message: str) -> str:
    """Name the bad field in msgspec's message, e.g. ``dataset.shards[0].samples: ...``."""
    detail, _, path = message.partition(" - at `$")
    where = path.rstrip("`").lstrip(".")
    named, sep, problem = detail.partition(": ")
    base = re.sub(r"\[\d+\]", "", where)
    if sep and " " not in named and named.startswith(base):
        # A record's own check already names the field; add the list index msgspec knows.
        return f"{where}{named[len(base) :]}: {problem}" if where else detail
    if detail.startswith("Object contains unknown field"):
        detail += " (check its spelling against docs/experiment.md)"
    return f"{where or '(top level)'}: {detail}"


def defined_workload(tables: Mapping[str, Any], given: str | None, where: str) -> str:
    """The workload a definition names, as a name or a reference: ``given`` (a
    ``--workload``) wins, then ``[workload] reference``, then ``[workload] name``."""
    spec = tables.get("workload", {})
    if not isinstance(spec, dict):
        raise LocalError(f"{where}: [workload] must be a table")
    code = given or spec.get("reference") or spec.get("name")
    if not isinstance(code, str) or not code:
        raise LocalError(
            f'{where}: [workload] needs a name (e.g. name = "char-gpt") or a reference to '
            'your code (reference = "path/to/file.py:factory"), or pass --workload'
        )
    return code
