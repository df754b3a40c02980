"""Running a node in the foreground: data directory, preparation, workload, signals.

``run_node(settings)`` is what ``p2ptrain node|seed|train|validate|reduce|view`` call: it opens the
data directory and holds its lock until the node ends (a second node on it is refused,
naming this one's pid; :class:`~p2ptrain.store.datadir.DataDirLock`), prepares the node
(:mod:`.setup`), builds the trainer's workload (and, with ``--evaluate``, the evaluator's
own) from the experiment manifest (checking that the local model and data are the
experiment's), and runs until the window target or
SIGINT/SIGTERM, which stop it cleanly (connections closed with a goodbye, status written, the
database closed). A role that failed too often in a row stops
it the same way, and then :class:`~.failures.RoleFailed` is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.tensors import schema_hash
from p2ptrain.errors import LocalError
from p2ptrain.node.events import NodeEvent
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings, prepare
from p2ptrain.node.shell import Node
from p2ptrain.node.status import NodeStatus
from p2ptrain.store.datadir import DataDir
from p2ptrain.store.kernel_build import ensure_kernel
from p2ptrain.torch.workload import Workload

__all__ = ["WorkloadSource", "check_workload", "experiment_workload", "run_node", "serve"]


def experiment_workload(manifest: ExperimentManifest) -> Workload:
    """The registered workload the experiment names, checked against the manifest."""
    from p2ptrain.torch.registry import make_workload

    return check_workload(manifest, make_workload(manifest.workload.name, manifest.workload.config))


def check_workload(manifest: ExperimentManifest, workload: Workload) -> Workload:
    """``workload`` if its model and data are the experiment's: the same parameter schema
    and the same shards (bytes hashed); else a LocalError saying which differs."""
    spec = manifest.workload
    local_schema = schema_hash(workload.initial_weights())
    if local_schema != spec.schema_hash:
        raise LocalError(
            f"the local model has parameter schema {local_schema[:12]}, experiment "
            f"{manifest.name!r} trains {spec.schema_hash[:12]} ({spec.name!r}): build the same "
            "model (names, shapes, dtypes) as the experiment's"
        )
    if workload.dataset_manifest() != manifest.dataset:
        raise LocalError(
            f"the local training data differs from the experiment's dataset "
            f"{manifest.dataset.name!r} (shard names, sizes or hashes differ): use the same "
            "dataset, in the same order, with the same samples per shard"
        )
    return workload


WorkloadSource = Workload | Callable[[ExperimentManifest], Workload]


async def serve(
    settings: NodeSettings,
    *,
    workload: WorkloadSource | None = None,
    on_event: Callable[[NodeEvent], None] | None = None,
    on_node: Callable[[Node], None] | None = None,
) -> NodeStatus:
    """Prepare and run a node until it stops; return its final status."""
    ensure_kernel()  # the C aggregation kernel, built on first use
    with DataDir(settings.data_dir, exclusive=True) as datadir:
        store = NodeStore(datadir)
        prepared = await prepare(settings, store)
        manifest = prepared.experiment.record
        chosen: Workload | None = None
        if "trainer" in settings.roles:
            if workload is None:
                chosen = experiment_workload(manifest)
            elif callable(workload):
                chosen = check_workload(manifest, workload(manifest))
            else:
                chosen = check_workload(manifest, workload)
        # the evaluator's own workload (a trainer's model is busy training); a node that
        # does not evaluate builds none, and needs no model code
        evaluating = experiment_workload(manifest) if settings.evaluate else None
        node = Node(
            settings,
            prepared,
            store,
            workload=chosen,
            evaluator_workload=evaluating,
            on_event=on_event,
        )
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
    settings: NodeSettings, *, on_event: Callable[[NodeEvent], None] | None = None
) -> NodeStatus:
    return asyncio.run(serve(settings, on_event=on_event))
