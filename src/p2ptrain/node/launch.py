"""Running a node in the foreground: data directory, preparation, workload, signals.

``run_node(settings)`` is what ``p2ptrain seed|train|validate|reduce`` call: it opens the
data directory, prepares the node (:mod:`.setup`), builds the trainer's workload from the
experiment manifest (checking that the local model and data are the experiment's), and runs
until the window target or SIGINT/SIGTERM, which stop it cleanly (connections closed with a
goodbye, status written, the database closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.tensors import schema_hash
from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.runtime import Node
from p2ptrain.node.setup import NodeSettings, prepare
from p2ptrain.store.datadir import DataDir
from p2ptrain.torch.workload import Workload

__all__ = ["experiment_workload", "run_node", "serve"]


def experiment_workload(manifest: ExperimentManifest) -> Workload:
    """The registered workload the experiment names, checked against the manifest: same
    model schema and the same data shards (bytes hashed), or a LocalError saying which."""
    from p2ptrain.torch.registry import make_workload

    spec = manifest.workload
    workload = make_workload(spec.name, spec.config)
    local_schema = schema_hash(workload.initial_weights())
    if local_schema != spec.schema_hash:
        raise LocalError(
            f"the local {spec.name!r} model has schema {local_schema[:12]}, the experiment's "
            f"is {spec.schema_hash[:12]}: upgrade p2ptrain to the seed's version"
        )
    if workload.dataset_manifest() != manifest.dataset:
        raise LocalError(
            f"the local {spec.name!r} data differs from the experiment's dataset "
            f"{manifest.dataset.name!r} (shard hashes differ): install the same data package "
            "version as the seed"
        )
    return workload


async def serve(
    settings: NodeSettings,
    *,
    workload: Workload | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_node: Callable[[Node], None] | None = None,
) -> dict[str, Any]:
    """Prepare and run a node until it stops; return its final status."""
    with DataDir(settings.data_dir) as datadir:
        store = NodeStore(datadir)
        prepared = await prepare(settings, store)
        if "trainer" in settings.roles and workload is None:
            workload = experiment_workload(prepared.experiment.record)
        node = Node(settings, prepared, store, workload=workload, on_event=on_event)
        if on_node is not None:
            on_node(node)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, node.stop)
        try:
            return await node.run()
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(signum)


def run_node(
    settings: NodeSettings, *, on_event: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    return asyncio.run(serve(settings, on_event=on_event))
