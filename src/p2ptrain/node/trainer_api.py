"""The Python API of a trainer: your model, optimizer and loaders on the network (DESIGN §7).

.. code-block:: python

    import p2ptrain

    trainer = p2ptrain.Trainer(
        data_dir="./node", experiment=EXPERIMENT_ID, bootstrap=["http://seed:7700"],
        model=model, optimizer=optimizer, train_loader=train_loader, val_loader=val_loader,
    )
    for outcome in trainer.run(windows=100):   # one per certified window
        print(outcome.height, outcome.head_id, outcome.train_loss, outcome.bytes_sent)

The node runs on its own thread (an event loop answering the network) and trains each window
on a worker thread; :meth:`Trainer.run` yields as the network certifies windows and stops the
node cleanly when the loop ends, breaks or raises. The optimizer is the inner optimizer: its
state stays with the trainer across windows and restarts (in the data directory). The
loaders' datasets must be map-style and match the experiment's dataset shards; their
sampling is replaced by the lease the protocol assigns each window.

The node can hold other roles too (``roles=("validator",)``, for three friends who each
train and validate; give it an address to serve on with ``host``). A training step that
raises is recorded for its window and the trainer goes on with the next; after
``max_role_failures`` failures in a row :meth:`Trainer.run` raises
:class:`~p2ptrain.node.failures.RoleFailed` with the last exception as its cause.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.errors import LocalError
from p2ptrain.node.events import HeadAdopted, NodeEvent, Trained
from p2ptrain.node.failures import DEFAULT_MAX_FAILURES
from p2ptrain.node.launch import serve
from p2ptrain.node.persist import median_val_loss
from p2ptrain.node.setup import NodeSettings
from p2ptrain.node.shell import Node
from p2ptrain.torch.workload import LossFn, TorchWorkload

__all__ = ["Trainer", "WindowOutcome"]


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """A window the network certified while this trainer ran."""

    height: int
    head_id: str
    #: Updates the certified head accepted (ours among them, if it was on time).
    accepted: int
    #: Our own last window's loss before and after the inner steps (None before we trained).
    train_loss: tuple[float, float] | None
    #: Bytes this trainer has sent so far (update blobs and control messages).
    bytes_sent: int
    reason: str
    #: The median validation loss evaluators reported for this head, as far as reports had
    #: reached this node when the outcome was yielded (None: none yet; reports follow the
    #: head, since evaluators evaluate it once it is certified).
    val_loss: float | None = None


class Trainer:
    """A trainer node running a PyTorch model. See the module docstring."""

    def __init__(
        self,
        *,
        data_dir: str | Path,
        experiment: str,
        bootstrap: Sequence[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: DataLoader[Any],
        val_loader: DataLoader[Any],
        loss_fn: LossFn | None = None,
        secret: bytes | None = None,
        threads: int = 1,
        roles: Sequence[str] = (),
        host: str | None = None,
        port: int = 0,
        max_role_failures: int = DEFAULT_MAX_FAILURES,
    ) -> None:
        """``roles``: roles this node holds besides trainer (e.g. ``("validator",)``);
        ``host``/``port``: serve on this address (None: outbound only, the default for a
        trainer; a validator or reducer needs one, or a relay)."""
        self._settings: dict[str, Any] = {
            "data_dir": Path(data_dir),
            "roles": ("trainer", *roles),
            "experiment_id": experiment,
            "bootstrap": tuple(bootstrap),
            "host": host,
            "port": port,
            "secret": secret,
            "threads": threads,
            "max_role_failures": max_role_failures,
        }
        NodeSettings(**self._settings)  # check the settings now, not in run()
        self._parts = (model, optimizer, train_loader, val_loader, loss_fn)

    def _workload(self, manifest: ExperimentManifest) -> TorchWorkload:
        model, optimizer, train_loader, val_loader, loss_fn = self._parts
        shards = manifest.dataset.shards
        return TorchWorkload.from_loaders(
            model,
            optimizer,
            train_loader,
            val_loader,
            samples_per_shard=shards[0].samples,
            name=manifest.dataset.name,
            loss_fn=loss_fn,
        )

    def run(self, windows: int | None = None) -> Iterator[WindowOutcome]:
        """Train until ``windows`` windows are certified (None: until the loop stops).
        Raises :class:`~p2ptrain.node.failures.RoleFailed` if a role of the node failed
        too many steps in a row (the node stopped cleanly first)."""
        settings = NodeSettings(**self._settings, windows=windows)
        events: queue.Queue[NodeEvent | BaseException | None] = queue.Queue()
        nodes: list[Node] = []
        loop = asyncio.new_event_loop()

        async def main() -> None:
            try:
                await serve(
                    settings,
                    workload=self._workload,
                    on_event=events.put,
                    on_node=nodes.append,
                )
            except BaseException as exc:  # handed to the caller's thread
                events.put(exc)
            finally:
                events.put(None)

        thread = threading.Thread(
            target=loop.run_until_complete, args=(main(),), name="p2ptrain-node", daemon=True
        )
        thread.start()
        last_loss: tuple[float, float] | None = None
        try:
            while (item := events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Trained):
                    last_loss = (item.loss_before, item.loss_after)
                elif isinstance(item, HeadAdopted) and nodes:
                    yield WindowOutcome(
                        height=item.height,
                        head_id=item.head_id,
                        accepted=item.accepted,
                        train_loss=last_loss,
                        bytes_sent=nodes[0].status().bytes_sent,
                        reason=item.reason,
                        val_loss=median_val_loss(nodes[0].store, item.head_id)[0],
                    )
        finally:
            if nodes and thread.is_alive():
                loop.call_soon_threadsafe(nodes[0].stop)
            thread.join(timeout=60)
            if thread.is_alive():
                raise LocalError("the trainer node did not stop within 60 s")
            loop.close()
