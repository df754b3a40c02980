"""Workloads by name: the manifest's ``workload.name`` picks the factory, its config the rest.

Every peer builds the experiment's workload from the manifest alone (name and config), so a
name must mean the same code everywhere. The registry is a plain dict; a program that ships
its own workload registers it under a new name before starting its node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from p2ptrain.errors import LocalError
from p2ptrain.torch.char_gpt import char_gpt_workload
from p2ptrain.torch.hf_causal_lm import hf_causal_lm_workload  # imports transformers lazily
from p2ptrain.torch.workload import Workload

__all__ = ["WorkloadFactory", "known_workloads", "make_workload", "register"]

ConfigValue = str | int | float | bool
WorkloadFactory = Callable[[Mapping[str, ConfigValue]], Workload]

_FACTORIES: dict[str, WorkloadFactory] = {
    "char-gpt": char_gpt_workload,
    "hf-causal-lm": hf_causal_lm_workload,
}


def register(name: str, factory: WorkloadFactory, *, replace: bool = False) -> None:
    """Make ``make_workload(name, config)`` call ``factory(config)``."""
    if name in _FACTORIES and not replace and _FACTORIES[name] is not factory:
        raise LocalError(
            f"a workload named {name!r} is already registered; pick another name "
            "(or pass replace=True to override it)"
        )
    _FACTORIES[name] = factory


def known_workloads() -> tuple[str, ...]:
    return tuple(sorted(_FACTORIES))


def make_workload(name: str, config: Mapping[str, ConfigValue]) -> Workload:
    """The workload ``name`` built from ``config`` (a manifest's ``workload`` section)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise LocalError(
            f"unknown workload {name!r:.80}; known workloads: {', '.join(known_workloads())}. "
            "Register a custom one with p2ptrain.torch.registry.register(name, factory)"
        )
    return factory(config)
