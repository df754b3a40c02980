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
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from p2ptrain.aggregate import native
from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest, ShardInfo
from p2ptrain.data.pipelines import ShardedData
from p2ptrain.data.prepare import read_prepared
from p2ptrain.errors import LocalError
from p2ptrain.net.wire_meter import metered_loop
from p2ptrain.node.data_import import attach_validation, import_prepared
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.pod import PodWorkload, form_pod
from p2ptrain.node.setup import GenesisBuilder, NodeSettings, Prepared, prepare
from p2ptrain.node.shard_cache import CACHE_FILE, ShardCache
from p2ptrain.node.shell import Node
from p2ptrain.node.workload_check import build_workload, check_workload, experiment_workload
from p2ptrain.observe.events import NodeEvent
from p2ptrain.observe.memory import mark_after_imports
from p2ptrain.observe.status import NodeStatus
from p2ptrain.store.datadir import DataDir
from p2ptrain.store.kernel_build import ensure_kernel
from p2ptrain.torch.capabilities import DryRunnable, Placeable, PreparedDataUser
from p2ptrain.torch.workload import Workload

__all__ = [
    "WorkloadSource",
    "attach_shards",
    "check_workload",
    "experiment_workload",
    "run_node",
    "serve",
]


WorkloadSource = Workload | Callable[[ExperimentManifest], Workload]


async def serve(
    settings: NodeSettings,
    *,
    workload: WorkloadSource | None = None,
    on_event: Callable[[NodeEvent], None] | None = None,
    on_node: Callable[[Node], None] | None = None,
    dry_run: bool = True,
) -> NodeStatus:
    """Prepare and run a node until it stops; return its final status. A trainer's workload
    first runs one batch forward and backward (``dry_run``; the Trainer API has done it
    already, before joining)."""
    mark_after_imports()  # before any model state: what the status measures peaks against
    # before any thread runs torch: torch reads the count once per thread, at the thread's
    # first parallel operation, so a worker that built the genesis weights before the count
    # was set would train every window it gets on all the machine's cores
    torch.set_num_threads(max(1, settings.threads))
    ensure_kernel()  # the C aggregation kernel: the package's, or built on first use
    if {"reducer", "validator"} & set(settings.roles):
        # loaded now (built, at worst), off the loop: the status names the backend at once
        await asyncio.to_thread(native.available)
    with DataDir(settings.data_dir, exclusive=True) as datadir:
        store = NodeStore(datadir)
        trainer = _OnceBuilt(settings, workload) if "trainer" in settings.roles else None
        prepared = await prepare(
            settings, store, build_genesis=None if trainer is None else trainer.genesis_builder()
        )
        manifest = prepared.experiment.record
        if settings.serve_data is not None:
            import_prepared(store.blobs, read_prepared(settings.serve_data), manifest.dataset)
        chosen: Workload | None = None
        pod: PodWorkload | None = None
        shards: ShardCache | None = None
        if trainer is not None:
            chosen, shards = _trainer_workload(settings, prepared, store, trainer, dry_run)
            if settings.pod is not None:  # rank 0 of a pod: the ranks train its windows
                pod = await asyncio.to_thread(form_pod, settings.pod, chosen, manifest)
                chosen = pod
        # the evaluator's own workload (a trainer's model is busy training); a node that
        # does not evaluate builds none, and needs no model code
        evaluating = experiment_workload(manifest, settings.workload) if settings.evaluate else None
        if evaluating is not None:
            missing = attach_validation(evaluating, manifest.dataset, store.blobs)
            if missing:
                raise LocalError(f"--evaluate: this node cannot evaluate: {missing}")
        node = Node(
            settings,
            prepared,
            store,
            workload=chosen,
            shards=shards,
            evaluator_workload=evaluating,
            on_event=on_event,
        )
        # the node's follower holds the genesis weights until it moves past them: ours
        # would keep a model's worth of memory for the node's whole life
        del prepared
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
            if pod is not None:
                pod.close()


class _OnceBuilt:
    """A trainer's workload, built once from the experiment's manifest: while joining (its
    initial weights are the genesis weights, so they need not be downloaded), or after."""

    def __init__(self, settings: NodeSettings, source: WorkloadSource | None) -> None:
        self._settings, self._source = settings, source
        self._built: Workload | None = None

    def workload(self, manifest: ExperimentManifest) -> Workload:
        if self._built is None:
            if self._source is None:
                self._built = build_workload(manifest, self._settings.workload)
            elif callable(self._source):
                self._built = self._source(manifest)
            else:
                self._built = self._source
        return self._built

    def genesis(self, manifest: ExperimentManifest) -> Mapping[str, torch.Tensor]:
        return self.workload(manifest).initial_weights()

    def genesis_builder(self) -> GenesisBuilder:
        # a workload built by name or reference from the manifest should start from its
        # genesis weights; the Trainer API's (a callable) or a given object need not
        return GenesisBuilder(self.genesis, expected=self._source is None)


def _trainer_workload(
    settings: NodeSettings,
    prepared: Prepared,
    store: NodeStore,
    trainer: _OnceBuilt,
    dry_run: bool,
) -> tuple[Workload, ShardCache | None]:
    """The trainer's workload, checked against the experiment, on its device, its prepared
    shards attached (and their cache), after one dry batch."""
    manifest = prepared.experiment.record
    shards: ShardCache | None = None
    built = trainer.workload(manifest)
    if manifest.dataset.kind == "sharded":
        shards = ShardCache(
            store.blobs,
            manifest.dataset,
            settings.data_dir / CACHE_FILE,
            limit_bytes=settings.data_cache_bytes,
        )
        data = attach_shards(built, manifest.dataset, shards.locate, str(store.blobs.root))
        shards.on_evict = data.forget
    chosen = check_workload(manifest, built, prepared.genesis)
    if settings.device != "cpu":
        if not isinstance(chosen, Placeable):
            raise LocalError(
                f"--device {settings.device}: this workload ({type(chosen).__name__}) "
                "cannot be moved (it has no place(device)); build it on the device yourself"
            )
        chosen.place(settings.device)
    if dry_run and isinstance(chosen, DryRunnable):
        chosen.dry_run()  # a mistake in the model or data fails now, in words
    return chosen, shards


def attach_shards(
    workload: Workload,
    dataset: DatasetManifest,
    locate: Callable[[ShardInfo], Path | None],
    location: str,
) -> ShardedData:
    """Make ``workload`` train on the prepared shards of ``dataset``, read where ``locate``
    finds them (a trainer's shard cache; the demo's prepared directory)."""
    if not isinstance(workload, PreparedDataUser):
        raise LocalError(
            f"the experiment trains on prepared shards, and this workload "
            f"({type(workload).__name__}) cannot be given data: build a TorchWorkload, or "
            "give it what p2ptrain.torch.capabilities.PreparedDataUser names"
        )
    data = ShardedData(dataset, locate, location=location)
    workload.use_data(data)
    return data


def run_node(
    settings: NodeSettings, *, on_event: Callable[[NodeEvent], None] | None = None
) -> NodeStatus:
    with asyncio.Runner(loop_factory=metered_loop) as runner:
        return runner.run(serve(settings, on_event=on_event))
