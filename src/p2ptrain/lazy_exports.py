"""A package's public names, imported from their modules when first asked for (PEP 562), so
that importing the package costs nothing until a name is used: the commands that need no
torch stay quick (``tests/unit/cli/test_no_torch.py``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, module_of: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: each name of ``module_of`` comes from
    ``package.<its module>`` (or from the module named in full, ``p2ptrain.…``)."""

    def attribute(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        full = module if module.startswith("p2ptrain.") else f"{package}.{module}"
        return getattr(importlib.import_module(full), name)

    return attribute
