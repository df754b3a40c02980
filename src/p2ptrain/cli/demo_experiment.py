"""What ``p2ptrain demo`` trains: the built-in char GPT, or the user's own workload.

``p2ptrain demo`` with no options trains the character GPT; ``--workload REF`` (a file or
module reference, or a built-in or installed name) and/or ``--experiment-toml FILE`` train
the user's model on the same local network, like ``flwr run .``. The user's definition keeps
every setting it makes except who validates and reduces (the demo's own processes) and the
quorum; the window settings it leaves out are sized for this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from p2ptrain.core.experiment_config import defined_workload, parse_experiment_toml
from p2ptrain.errors import LocalError
from p2ptrain.node.setup import read_definition

__all__ = ["DemoExperiment", "demo_experiment", "demo_toml"]


@dataclass(frozen=True)
class DemoExperiment:
    """The workload the demo trains and the definition's tables it keeps."""

    #: A workload name or reference (what ``make_workload`` takes).
    code: str
    config: dict[str, Any]
    #: The user's definition (without validators, reducers, quorum), or empty.
    tables: dict[str, Any] = field(default_factory=dict)
    #: The prepared dataset the definition trains on (``[data] prepared``), if any.
    prepared: Path | None = None

    @property
    def built_in_char_gpt(self) -> bool:
        return self.code == "char-gpt" and not self.tables


def demo_experiment(workload: str | None, experiment_toml: str | None) -> DemoExperiment:
    """The demo's experiment from ``--workload`` and ``--experiment-toml`` (either may be
    None; with neither, the built-in char GPT with its demo settings)."""
    from p2ptrain.torch.char_gpt import DEFAULT_CONFIG

    if experiment_toml is None:
        if workload is None:
            return DemoExperiment("char-gpt", dict(DEFAULT_CONFIG))
        return DemoExperiment(workload, {})
    path = Path(experiment_toml)
    tables = parse_experiment_toml(read_definition(path))
    for key in ("validators", "reducers", "quorum", "network_id"):
        tables.pop(key, None)  # the demo's own processes validate and reduce
    code = defined_workload(tables, workload, str(path))
    spec = tables.get("workload", {})
    config = spec.get("config", {})
    if not isinstance(config, dict):
        raise LocalError(f"{path}: [workload.config] must be a table")
    prepared = None
    data = tables.get("data")
    if isinstance(data, dict) and isinstance(data.get("prepared"), str):
        # the demo writes the definition elsewhere: the directory becomes absolute
        prepared = (path.parent / data["prepared"]).resolve()
        tables["data"] = {**data, "prepared": str(prepared)}
    return DemoExperiment(code, dict(config), tables, prepared)


def demo_toml(
    experiment: DemoExperiment,
    *,
    validators: list[str],
    reducers: list[str],
    quorum: int,
    defaults: dict[str, Any],
) -> str:
    """The definition the demo's seed signs: ``defaults`` (the demo's own settings, sized
    for this machine) overridden by the user's tables, with the demo's validators, reducers
    and quorum, and the demo's ``window.min_updates``/``max_updates`` (they count the demo's
    trainers: a window waiting for more trainers than the demo runs would wait out its
    whole deadline)."""
    tables: dict[str, Any] = {}
    for key, value in defaults.items():
        tables[key] = dict(value) if isinstance(value, dict) else value
    for key, value in experiment.tables.items():
        if isinstance(value, dict) and isinstance(tables.get(key), dict):
            tables[key] = {**tables[key], **value}
        else:
            tables[key] = value
    workload = dict(tables.get("workload", {}))
    workload.pop("name", None)
    workload.pop("reference", None)
    workload["name"] = experiment.code  # the seed turns a reference into name + reference
    workload["config"] = experiment.config
    tables["workload"] = workload
    for key in ("min_updates", "max_updates"):
        if key in defaults.get("window", {}):
            tables.setdefault("window", {})[key] = defaults["window"][key]
    tables["validators"] = sorted(validators)
    tables["reducers"] = sorted(reducers)
    tables["quorum"] = quorum
    return tomli_w.dumps(tables)
