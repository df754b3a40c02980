"""The Python API of a trainer: your model, optimizer and loaders on the network (DESIGN §7).

.. code-block:: python

    import p2ptrain

    trainer = p2ptrain.Trainer(
        data_dir="./node", experiment=EXPERIMENT_ID, bootstrap=["http://seed:7700"],
        model=model, optimizer=optimizer, train_loader=train_loader, val_loader=val_loader,
    )
    for outcome in trainer.run(windows=100):   # one per certified window
        print(outcome.height, outcome.update, outcome.loss_after, outcome.val_loss)

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
:class:`~p2ptrain.driver.failures.RoleFailed` with the last exception as its cause.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.driver.failures import DEFAULT_MAX_FAILURES
from p2ptrain.errors import LocalError
from p2ptrain.net.wire_meter import metered_loop
from p2ptrain.node.launch import serve
from p2ptrain.node.persist import median_val_loss
from p2ptrain.node.setup import NodeSettings
from p2ptrain.node.shell import Node
from p2ptrain.node.workload_check import build_workload
from p2ptrain.observe.events import HeadAdopted, NodeEvent, Ready, Trained
from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS
from p2ptrain.torch.batch_loss import BatchLoss
from p2ptrain.torch.workload import LossFn, TorchWorkload, Workload

__all__ = ["Trainer", "WindowOutcome"]


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """A window the network certified while this trainer ran."""

    #: The certified head's height (= the window it closed).
    height: int
    head_id: str
    #: Updates the certified head accepted (ours among them, if it was on time).
    accepted: int
    #: What became of this trainer's own update for the window: "accepted",
    #: "rejected: <why>" (the head's quarantine book says why), "left out: <why>" (it came
    #: late, or the window was full), or "" when it sent none (joined mid-window).
    update: str
    #: This trainer's last trained window's loss on its first minibatch before any inner
    #: step, and the mean loss of its last inner steps (None before it trained a window).
    loss_before: float | None
    loss_after: float | None
    #: Bytes this trainer has sent so far (update blobs and control messages).
    bytes_sent: int
    #: Why the node adopted the head (e.g. "certified at height 4: 2 of 3 validators signed").
    reason: str
    #: The median validation loss evaluators reported for this head, as far as reports had
    #: reached this node when the outcome was yielded (None: none yet; reports follow the
    #: head, since evaluators evaluate it once it is certified).
    val_loss: float | None = None


def _queued(events: _Events, nodes: list[Node]) -> Callable[[NodeEvent], None]:
    """What the node calls with each event, on its own thread: the event goes into
    ``events``; an adopted head with the figures read from the node now, while it runs (the
    caller's thread reads the queue later, maybe after the node stopped and closed its
    store)."""

    def on_event(event: NodeEvent) -> None:
        if isinstance(event, HeadAdopted) and nodes:
            node = nodes[0]
            val_loss = median_val_loss(node.store, event.head_id)[0]
            events.put(_Adopted(event, node.status().bytes_sent, val_loss))
        else:
            events.put(event)

    return on_event


@dataclass(frozen=True)
class _Adopted:
    """A head the node adopted, with the figures read from the node when it did."""

    event: HeadAdopted
    bytes_sent: int
    val_loss: float | None


_Events = queue.Queue[NodeEvent | _Adopted | BaseException | None]


class Trainer:
    """A trainer node running a PyTorch model. See the module docstring."""

    def __init__(
        self,
        *,
        data_dir: str | Path,
        experiment: str,
        bootstrap: Sequence[str],
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        train_loader: DataLoader[Any] | None = None,
        val_loader: DataLoader[Any] | None = None,
        loss_fn: LossFn | None = None,
        batch_loss: BatchLoss | None = None,
        workload: Workload | str | None = None,
        device: str = "cpu",
        secret: bytes | None = None,
        threads: int = 1,
        roles: Sequence[str] = (),
        host: str | None = None,
        port: int = 0,
        max_role_failures: int = DEFAULT_MAX_FAILURES,
        keep_heads: int = DEFAULT_KEEP_HEADS,
    ) -> None:
        """Give either ``model``, ``optimizer`` and ``train_loader`` (``val_loader``: what
        the model is evaluated on when this node evaluates; default: the train set;
        ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches, or
        ``batch_loss(model, batch)`` for any batch, e.g. a dict), or ``workload``: a
        :class:`~p2ptrain.torch.workload.Workload` or the reference the seed used
        (``"path/file.py:factory"``). ``device``: where to train (``cpu``, ``cuda``,
        ``cuda:N``, ``mps``). ``roles``: roles this node holds besides trainer (e.g.
        ``("validator",)``); ``host``/``port``: serve on this address (None: outbound only,
        the default for a trainer; a validator or reducer needs one, or a relay).
        ``keep_heads``: the last certified heads whose weights and optimizer state the data
        directory keeps (older ones are deleted, like older windows' updates).

        One forward and backward pass on one batch runs here, before anything joins, so a
        mistake in the model, the loss or the data fails at once, in words."""
        reference = workload if isinstance(workload, str) else None
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
            "keep_heads": keep_heads,
            "workload": reference,
            "device": device,
        }
        NodeSettings(**self._settings)  # check the settings now, not in run()
        self._given: Workload | None = None if isinstance(workload, str) else workload
        self._parts = (model, optimizer, train_loader, val_loader, loss_fn, batch_loss)
        if workload is None:
            if model is None or optimizer is None or train_loader is None:
                given = {"model": model, "optimizer": optimizer, "train_loader": train_loader}
                missing = [name for name, value in given.items() if value is None]
                raise LocalError(
                    f"Trainer needs model, optimizer and train_loader (or workload=...); "
                    f"missing: {', '.join(missing)}"
                )
            # the dry run: the loaders' own sizes stand in for the experiment's shards
            self._from_loaders(samples_per_shard=1, name="dry-run").dry_run()
        elif model is not None or train_loader is not None:
            raise LocalError("give workload=... or model/optimizer/loaders, not both")
        elif self._given is not None:
            dry_run = getattr(self._given, "dry_run", None)
            if callable(dry_run):
                dry_run()

    def _from_loaders(self, *, samples_per_shard: int, name: str) -> TorchWorkload:
        model, optimizer, train_loader, val_loader, loss_fn, batch_loss = self._parts
        assert model is not None and optimizer is not None and train_loader is not None
        return TorchWorkload.from_loaders(
            model,
            optimizer,
            train_loader,
            val_loader or train_loader,
            samples_per_shard=samples_per_shard,
            name=name,
            loss_fn=loss_fn,
            batch_loss=batch_loss,
            device=self._settings["device"],
        )

    def _workload(self, manifest: ExperimentManifest) -> Workload:
        if self._given is not None:
            return self._given
        if self._settings["workload"] is not None:
            return build_workload(manifest, self._settings["workload"])
        return self._from_loaders(
            samples_per_shard=manifest.dataset.shards[0].samples, name=manifest.dataset.name
        )

    def run(
        self, windows: int | None = None, *, until_height: int | None = None
    ) -> Iterator[WindowOutcome]:
        """Train ``windows`` more certified windows (counted once the node has caught up
        with the network), or until the chain reaches ``until_height``; with neither, until
        the loop stops. Raises :class:`~p2ptrain.driver.failures.RoleFailed` if a role of the
        node failed too many steps in a row (the node stopped cleanly first), and
        :class:`~p2ptrain.errors.LocalError` when the node stopped without a window (e.g.
        it was already at ``until_height``), saying why."""
        for name, value in (("windows", windows), ("until_height", until_height)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise LocalError(f"Trainer.run: {name} must be at least 1, got {value!r}")
        if windows is not None and until_height is not None:
            raise LocalError("Trainer.run: give windows (more windows) or until_height, not both")
        settings = NodeSettings(**self._settings, windows=windows, until_height=until_height)
        events: _Events = queue.Queue()
        nodes: list[Node] = []
        loop = metered_loop()
        on_event = _queued(events, nodes)

        async def main() -> None:
            try:
                await serve(
                    settings,
                    workload=self._workload,
                    on_event=on_event,
                    on_node=nodes.append,
                    # done here already, unless the workload is code only the node builds
                    dry_run=self._settings["workload"] is not None,
                )
            except BaseException as exc:  # handed to the caller's thread
                events.put(exc)
            finally:
                events.put(None)

        thread = threading.Thread(
            target=loop.run_until_complete, args=(main(),), name="p2ptrain-node", daemon=True
        )
        thread.start()
        last: Trained | None = None
        outcomes = 0
        ready = False
        try:
            while (item := events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Ready):  # heads adopted before it were restored
                    ready = True
                elif isinstance(item, Trained):
                    last = item
                elif isinstance(item, _Adopted) and ready:
                    head = item.event
                    yield WindowOutcome(
                        height=head.height,
                        head_id=head.head_id,
                        accepted=head.accepted,
                        update=head.update,
                        loss_before=None if last is None else last.loss_before,
                        loss_after=None if last is None else last.loss_after,
                        bytes_sent=item.bytes_sent,
                        reason=head.reason,
                        val_loss=item.val_loss,
                    )
                    outcomes += 1
            if outcomes == 0 and nodes and nodes[0].stop_reason:
                raise LocalError(f"the trainer trained nothing: {nodes[0].stop_reason}")
        finally:
            if nodes and thread.is_alive():
                loop.call_soon_threadsafe(nodes[0].stop)
            thread.join(timeout=60)
            if thread.is_alive():
                raise LocalError("the trainer node did not stop within 60 s")
            loop.close()
