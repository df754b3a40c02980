"""What a node shows of itself: its typed events (:mod:`.events`, one JSON line each on a
node's stdout), its status record (:mod:`.status`, ``status.json`` and ``/v1/status``), its
counters and timings (:mod:`.telemetry`, ``/metrics``), its window history
(:mod:`.window_history`) and the dashboard and metrics listener built from them
(:mod:`.dashboard`).

The package sits below :mod:`p2ptrain.node`, which fills it, and imports no node code:
``p2ptrain status`` and ``p2ptrain dashboard --dir`` read what it defines from a node's files
without loading torch or the node's runtime.

The names below are imported when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2ptrain.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from p2ptrain.observe.events import NodeEvent
    from p2ptrain.observe.status import NodeStatus

__all__ = ["NodeEvent", "NodeStatus"]

#: Where each name of ``__all__`` is defined.
_MODULE_OF = {
    "NodeEvent": "events",
    "NodeStatus": "status",
}


__getattr__ = lazy_exports(__name__, _MODULE_OF)
