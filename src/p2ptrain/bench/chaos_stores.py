"""Reading back a stopped node's data directory for the chaos bench's verdicts.

A store is sound when its SQLite database passes ``PRAGMA quick_check``, it names the
experiment it follows and holds that experiment's signed manifest, its certified heads
verify as one chain from genesis (every link's certificate and parent checked, as a
restarting node checks them), the certified-heads index ends on the chain's tip, and the
tip's weights, if held, hash to the id the head names (the blob store checks that on read).
Anything else makes the :class:`~.chaos_report.Replica` carry the reason in ``problem``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from p2ptrain.bench.chaos_report import Replica
from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.errors import P2PTrainError
from p2ptrain.node.persist import NodeStore
from p2ptrain.protocol.chain import HeadChain
from p2ptrain.store.blobs import blob_id
from p2ptrain.store.datadir import STATE_DB, DataDir

__all__ = ["read_replica"]


def read_replica(name: str, data_dir: Path) -> Replica:
    """What ``data_dir`` holds (the node must be stopped)."""
    try:
        heads, weights_hash = _read(data_dir)
    except (P2PTrainError, OSError, sqlite3.Error, ValueError) as exc:
        return Replica(name, {}, None, problem=f"{type(exc).__name__}: {exc}")
    return Replica(name, heads, weights_hash)


def _quick_check(database: Path) -> None:
    if not database.is_file():
        raise FileNotFoundError(f"{database} does not exist")
    with contextlib.closing(sqlite3.connect(database)) as db:
        rows = db.execute("PRAGMA quick_check").fetchall()
    if rows != [("ok",)]:
        raise ValueError(f"{database} fails PRAGMA quick_check: {rows[:3]}")


def _read(data_dir: Path) -> tuple[dict[int, str], str | None]:
    _quick_check(data_dir / STATE_DB)
    with DataDir(data_dir) as datadir:
        store = NodeStore(datadir)
        experiment_id = store.experiment_id()
        if experiment_id is None:
            raise ValueError("the store follows no experiment")
        raw = store.record(experiment_id)
        if raw is None:
            raise ValueError(f"the manifest of experiment {experiment_id[:12]} is missing")
        manifest = open_envelope(raw, ExperimentManifest).record
        chain = HeadChain(manifest)
        links = store.links(experiment_id)
        if links:
            verdict = chain.catch_up(links, weights_ok=lambda _head: True)
            if not verdict:
                raise ValueError(f"the stored chain does not verify: {verdict.reason}")
        tip = chain.tip
        indexed = datadir.state.latest_certified_head(experiment_id)
        if links and (indexed is None or indexed.head_id != tip.head_id):
            raise ValueError(
                f"the certified-heads index ends on {indexed}, not on the chain's tip "
                f"{tip.head_id[:12]} at height {tip.head.height}"
            )
        weights_hash = None
        if datadir.blobs.has(tip.head.weights_blob):
            weights_hash = blob_id(datadir.blobs.get(tip.head.weights_blob))
        heads = {}
        for height in range(1, chain.height + 1):
            link = chain.at(height)
            if link is not None:
                heads[height] = link.head_id
        return heads, weights_hash
