"""The running node: a thin shell, one runner per role, the Trainer API."""

from __future__ import annotations

from p2ptrain.node.events import NodeEvent
from p2ptrain.node.failures import RoleFailed
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.services import experiment_topic
from p2ptrain.node.setup import ROLES, NodeSettings, Prepared, prepare
from p2ptrain.node.shell import Node
from p2ptrain.node.status import NodeStatus
from p2ptrain.node.trainer_api import Trainer, WindowOutcome
from p2ptrain.node.trainer_runner import window_seed

__all__ = [
    "ROLES",
    "Node",
    "NodeEvent",
    "NodeSettings",
    "NodeStatus",
    "NodeStore",
    "Prepared",
    "RoleFailed",
    "Trainer",
    "WindowOutcome",
    "experiment_topic",
    "prepare",
    "window_seed",
]
