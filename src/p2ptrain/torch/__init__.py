"""PyTorch workloads: what trainers train and validators evaluate.

``import torch`` inside this package is PyTorch itself (absolute imports); this package is
``p2ptrain.torch``. :mod:`.workload` defines the :class:`Workload` protocol the node calls and
:class:`TorchWorkload` (:mod:`.capabilities` declares what a workload may offer beyond the
protocol, each checked by type; its parts: :mod:`.batch_loss`, :mod:`.placement` for device and
precision, :mod:`.weights`, :mod:`.optimizer_state`, :mod:`.dry_run`); :mod:`.char_gpt` is the
demo model; :mod:`.hf_causal_lm` builds Hugging Face causal LMs and :mod:`.hf_export` writes
them in the Hugging Face format (both need the ``hf`` extra); :mod:`.registry` maps manifest
workload names to factories; :mod:`.baseline` replays a run as synchronous data parallel
training, the yardstick DiLoCo is measured against. The Trainer API (your model,
optimizer and loaders on the network) runs a node, so it lives in :mod:`p2ptrain.node`
(``p2ptrain.Trainer``).

The names below are imported when first asked for, so that a plain module of this package
(:mod:`.demo_settings`) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2ptrain.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from p2ptrain.torch.registry import known_workloads, make_workload, register
    from p2ptrain.torch.workload import TorchWorkload, WindowResult, Workload

__all__ = [
    "TorchWorkload",
    "WindowResult",
    "Workload",
    "known_workloads",
    "make_workload",
    "register",
]

#: Where each name of ``__all__`` is defined.
_MODULE_OF = {
    "known_workloads": "registry",
    "make_workload": "registry",
    "register": "registry",
    "TorchWorkload": "workload",
    "WindowResult": "workload",
    "Workload": "workload",
}


__getattr__ = lazy_exports(__name__, _MODULE_OF)
