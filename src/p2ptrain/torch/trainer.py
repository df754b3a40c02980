"""The Python API of a trainer: your model, optimizer and loaders on the network (DESIGN §7).

.. code-block:: python

    from p2ptrain.torch import Trainer

    trainer = Trainer(
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
    ) -> None:
        self._settings: dict[str, Any] = {
            "data_dir": Path(data_dir),
            "roles": ("trainer",),
            "experiment_id": experiment,
            "bootstrap": tuple(bootstrap),
            "host": None,
            "secret": secret,
            "threads": threads,
        }
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
        """Train until ``windows`` windows are certified (None: until the loop stops)."""
        from p2ptrain.node.launch import serve
        from p2ptrain.node.runtime import Node
        from p2ptrain.node.setup import NodeSettings

        settings = NodeSettings(**self._settings, windows=windows)
        events: queue.Queue[dict[str, Any] | BaseException | None] = queue.Queue()
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
                if item["event"] == "trained":
                    last_loss = (float(item["loss_before"]), float(item["loss_after"]))
                elif item["event"] == "adopted" and nodes:
                    yield WindowOutcome(
                        height=int(item["height"]),
                        head_id=str(item["head_id"]),
                        accepted=int(item["accepted"]),
                        train_loss=last_loss,
                        bytes_sent=int(nodes[0].status()["bytes_sent"]),
                        reason=str(item["reason"]),
                    )
        finally:
            if nodes and thread.is_alive():
                loop.call_soon_threadsafe(nodes[0].stop)
            thread.join(timeout=60)
            if thread.is_alive():
                raise LocalError("the trainer node did not stop within 60 s")
            loop.close()
