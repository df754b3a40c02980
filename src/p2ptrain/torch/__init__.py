"""PyTorch workloads: what trainers train and validators evaluate.

``import torch`` inside this package is PyTorch itself (absolute imports); this package is
``p2ptrain.torch``. :mod:`.workload` defines the :class:`Workload` protocol the node calls and
:class:`TorchWorkload`; :mod:`.char_gpt` is the demo model; :mod:`.registry` maps manifest
workload names to factories; :mod:`.trainer` is the Trainer API (your model, optimizer and
loaders on the network); :mod:`.baseline` replays a run as synchronous data parallel
training, the yardstick DiLoCo is measured against.
"""

from __future__ import annotations

from p2ptrain.torch.registry import known_workloads, make_workload, register
from p2ptrain.torch.trainer import Trainer, WindowOutcome
from p2ptrain.torch.workload import TorchWorkload, WindowResult, Workload

__all__ = [
    "TorchWorkload",
    "Trainer",
    "WindowOutcome",
    "WindowResult",
    "Workload",
    "known_workloads",
    "make_workload",
    "register",
]
