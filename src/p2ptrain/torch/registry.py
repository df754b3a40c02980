"""Workloads by name or by reference: what builds the model, optimizer and data a manifest names.

Every peer builds the experiment's workload from the manifest (its ``workload`` section: a
name, a config table and, for user code, a reference), so a name must mean the same code
everywhere. A workload is found, in this order:

1. **Built in**: ``char-gpt`` (the demo model) and ``hf-causal-lm`` (a Hugging Face causal LM
   from a config or a local directory, ``pip install 'p2ptrain[hf]'``).
2. **Registered in this process** with :func:`register` (a program that ships its own).
3. **An installed package's entry point** in the group ``p2ptrain.workloads``
   (``[project.entry-points."p2ptrain.workloads"] my-model = "my_pkg.train:workload"``).
4. **A reference to code**: ``path/to/file.py:factory`` or ``package.module:factory``.

A factory takes the config table (``factory(config)``) or nothing (``factory()``) and returns a
:class:`~p2ptrain.torch.workload.Workload` (a ``TorchWorkload``, a ``causal_lm_workload``), or
the parts of one as a mapping: ``model``, ``train`` and ``val`` (map-style datasets),
``batch_size``, and optionally ``optimizer`` (default AdamW, lr 1e-3), ``loss`` (the loss of a
collated batch: ``loss(model, batch)``; default: cross-entropy of ``model(inputs)`` against
``targets`` for ``(inputs, targets)`` batches), ``samples_per_shard`` (default 64) and ``name``
(the dataset's name). Loading code runs it: a node runs a reference only when its operator
passed it (``--workload``), never because a manifest named it.

A factory with a parameter named ``dataset`` is also given the experiment's dataset
manifest (``factory(config, dataset=...)``; None when there is none yet): the built-in
language models take their vocabulary, data and validation split from a prepared text
dataset there (:mod:`p2ptrain.torch.prepared_text`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from p2ptrain.core.field_rules import name_from
from p2ptrain.core.manifests import DatasetManifest
from p2ptrain.errors import LocalError
from p2ptrain.torch.char_gpt import char_gpt_workload
from p2ptrain.torch.hf_causal_lm import hf_causal_lm_workload  # imports transformers lazily
from p2ptrain.torch.workload import Workload

__all__ = [
    "ENTRY_POINT_GROUP",
    "WorkloadFactory",
    "config_hash",
    "is_reference",
    "known_workloads",
    "make_workload",
    "reference_name",
    "register",
    "resolve_factory",
]

ConfigValue = str | int | float | bool
WorkloadFactory = Callable[[Mapping[str, ConfigValue]], Workload]
ENTRY_POINT_GROUP = "p2ptrain.workloads"


_BUILT_IN: dict[str, WorkloadFactory] = {
    "char-gpt": char_gpt_workload,
    "hf-causal-lm": hf_causal_lm_workload,
}
_FACTORIES: dict[str, WorkloadFactory] = dict(_BUILT_IN)


def register(name: str, factory: WorkloadFactory, *, replace: bool = False) -> None:
    """Make ``make_workload(name, config)`` call ``factory(config)``."""
    if name in _FACTORIES and not replace and _FACTORIES[name] is not factory:
        raise LocalError(
            f"a workload named {name!r} is already registered; pick another name "
            "(or pass replace=True to override it)"
        )
    _FACTORIES[name] = factory


def _entry_points() -> dict[str, Any]:
    return {point.name: point for point in entry_points(group=ENTRY_POINT_GROUP)}


def known_workloads() -> tuple[str, ...]:
    """Built-in, registered and installed (entry point) workload names."""
    return tuple(sorted({*_FACTORIES, *_entry_points()}))


def is_reference(text: str) -> bool:
    """Whether ``text`` points at code (``file.py:factory``, ``package.module:factory``)
    rather than naming a built-in, registered or installed workload."""
    return ":" in text


def reference_name(reference: str) -> str:
    """A manifest-safe name for a reference: ``examples/hf_gpt2/workload.py:workload`` ->
    ``hf_gpt2.workload`` (folder, file, and the factory unless it is the file's name);
    ``my_pkg.models:gpt`` -> ``my_pkg.models.gpt``. Other than ASCII letters, digits, '.',
    '_' and '-' becomes '-'."""
    where, _, attr = reference.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        parts = [path.parent.name, path.stem] if path.parent.name else [path.stem]
    else:
        parts = where.split(".")
    if attr != parts[-1]:
        parts.append(attr)
    return name_from(".".join(p for p in parts if p), limit=64, fallback="workload")


def _load_file(path: Path, reference: str) -> Any:
    if not path.is_file():
        raise LocalError(
            f"workload {reference!r}: no file {path} (give the path to a .py file, relative "
            "to the current directory, then ':' and the factory's name)"
        )
    name = f"p2ptrain_workload_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LocalError(f"workload {reference!r}: cannot load {path} as Python code")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # the file's own directory is importable, as it is for `python file.py`
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise LocalError(
            f"workload {reference!r}: importing {path} failed: {type(exc).__name__}: {exc}"
            f"{_raised_at(exc)}"
        ) from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _load_module(module_name: str, reference: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise LocalError(
            f"workload {reference!r}: no module {module_name!r} ({exc}); install the package "
            "that provides it, or give a file: path/to/file.py:factory"
        ) from exc
    except Exception as exc:
        raise LocalError(
            f"workload {reference!r}: importing {module_name} failed: {type(exc).__name__}: "
            f"{exc}{_raised_at(exc)}"
        ) from exc


def _from_reference(reference: str) -> Callable[..., Any]:
    where, _, attr = reference.rpartition(":")
    if not where or not attr.isidentifier():
        raise LocalError(
            f"workload {reference!r:.120}: use path/to/file.py:factory or package.module:factory"
        )
    module = (
        _load_file(Path(where), reference)
        if where.endswith(".py") or "/" in where
        else _load_module(where, reference)
    )
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise LocalError(
            f"workload {reference!r}: {where} has no function {attr!r}"
            + ("" if factory is None else f" ({attr} is a {type(factory).__name__})")
        )
    return factory  # type: ignore[no-any-return]


def resolve_factory(name_or_reference: str) -> Callable[..., Any]:
    """The factory a workload name or reference means (see the module docstring)."""
    if is_reference(name_or_reference):
        return _from_reference(name_or_reference)
    factory = _FACTORIES.get(name_or_reference)
    if factory is not None:
        return factory
    point = _entry_points().get(name_or_reference)
    if point is not None:
        try:
            loaded = point.load()
        except Exception as exc:
            raise LocalError(
                f"workload {name_or_reference!r} (entry point {point.value}) failed to "
                f"load: {type(exc).__name__}: {exc}{_raised_at(exc)}"
            ) from exc
        return loaded  # type: ignore[no-any-return]
    raise LocalError(
        f"unknown workload {name_or_reference!r:.80}; known workloads: "
        f"{', '.join(known_workloads())}. Give your own as path/to/file.py:factory or "
        "package.module:factory (--workload), or register it under the entry point group "
        f"{ENTRY_POINT_GROUP!r}"
    )


def _raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised, its last frame: `` (at path/file.py, line 12, in build)``;
    ``p2ptrain -v`` prints the whole traceback. Nothing for a syntax error, which names its
    file and line itself."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) or not frames:
        return ""
    last = frames[-1]
    return f" (at {_shown(last.filename)}, line {last.lineno}, in {last.name})"


def _shown(filename: str) -> str:
    """A file as people give it: relative to the current directory when it is inside it."""
    path = Path(filename)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return filename


def _call(
    factory: Callable[..., Any],
    config: Mapping[str, ConfigValue],
    where: str,
    dataset: DatasetManifest | None,
) -> Any:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        parameters = None
    takes_config = parameters is None or any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        and p.name != "dataset"
        for p in parameters
    )
    extra: dict[str, Any] = {}
    if parameters is not None and any(
        p.name == "dataset" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in parameters
    ):
        extra["dataset"] = dataset
    if not takes_config and config:
        raise LocalError(
            f"workload {where!r} takes no config, but the experiment gives it "
            f"{sorted(config)}: add a config parameter to the factory, or drop "
            "[workload.config] from the experiment"
        )
    try:
        return factory(dict(config), **extra) if takes_config else factory(**extra)
    except LocalError:
        raise
    except Exception as exc:
        raise LocalError(
            f"workload {where!r}: the factory raised {type(exc).__name__}: {exc}{_raised_at(exc)}"
        ) from exc


def make_workload(
    name_or_reference: str,
    config: Mapping[str, ConfigValue],
    *,
    dataset: DatasetManifest | None = None,
) -> Workload:
    """The workload ``name_or_reference`` built from ``config`` (a manifest's
    ``[workload.config]``); ``dataset``, the experiment's dataset manifest, goes to a
    factory that takes it (see the module docstring)."""
    built = _call(resolve_factory(name_or_reference), config, name_or_reference, dataset)
    if isinstance(built, Workload):
        return built
    if isinstance(built, Mapping):
        from p2ptrain.torch.workload_parts import workload_from_parts

        return workload_from_parts(built, where=name_or_reference)
    raise LocalError(
        f"workload {name_or_reference!r}: the factory returned a {type(built).__name__}; "
        "return a Workload (p2ptrain.TorchWorkload, causal_lm_workload) or a dict with "
        "model, train, val, batch_size (and optimizer, loss)"
    )


def config_hash(config: Mapping[str, ConfigValue], model_config: Mapping[str, Any] | None) -> str:
    """SHA-256 hex of what configures a workload: the experiment's config table and, for a
    model that has one (a Hugging Face ``config``), the model's own configuration."""
    described = {"config": dict(config), "model_config": dict(model_config or {})}
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
