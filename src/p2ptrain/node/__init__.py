"""The running node: roles wired to the protocol core, the network layer and the stores."""

from __future__ import annotations

from p2ptrain.node.persist import NodeStore
from p2ptrain.node.runtime import Node, experiment_topic, window_seed
from p2ptrain.node.setup import ROLES, NodeSettings, Prepared, prepare

__all__ = [
    "ROLES",
    "Node",
    "NodeSettings",
    "NodeStore",
    "Prepared",
    "experiment_topic",
    "prepare",
    "window_seed",
]
