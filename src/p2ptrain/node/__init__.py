"""The running node: a thin shell, one runner per role, the Trainer API. What it shows of
itself (events, status, metrics, the dashboard) is :mod:`p2ptrain.observe`.

The names below are imported when first asked for, so that importing the package loads
neither torch nor the node's runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2ptrain.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from p2ptrain.driver.failures import RoleFailed
    from p2ptrain.driver.services import experiment_topic
    from p2ptrain.node.persist import NodeStore
    from p2ptrain.node.setup import ROLES, NodeSettings, Prepared, prepare
    from p2ptrain.node.shell import Node
    from p2ptrain.node.trainer_api import Trainer, WindowOutcome
    from p2ptrain.node.trainer_runner import window_seed

__all__ = [
    "ROLES",
    "Node",
    "NodeSettings",
    "NodeStore",
    "Prepared",
    "RoleFailed",
    "Trainer",
    "WindowOutcome",
    "experiment_topic",
    "prepare",
    "window_seed",
]

#: Where each name of ``__all__`` is defined.
_MODULE_OF = {
    "RoleFailed": "p2ptrain.driver.failures",
    "NodeStore": "persist",
    "experiment_topic": "p2ptrain.driver.services",
    "ROLES": "setup",
    "NodeSettings": "setup",
    "Prepared": "setup",
    "prepare": "setup",
    "Node": "shell",
    "Trainer": "trainer_api",
    "WindowOutcome": "trainer_api",
    "window_seed": "trainer_runner",
}


__getattr__ = lazy_exports(__name__, _MODULE_OF)
