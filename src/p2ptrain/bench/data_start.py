"""``p2ptrain bench data``: how long a trainer holding no data takes to its first inner step.

One run on loopback: ``--size-mb`` of text (seeded random characters of a 65-letter
alphabet) is prepared into shards of ``block_size + 1`` character ids per row
(:func:`~p2ptrain.data.prepare.prepare_dataset`, ``--tokenizer chars``); a seed signs a
char-GPT experiment on them (``[data] prepared = ...``) and imports the shards. Then the
same trainer starts twice on the same data directory:

* **cold**: a fresh data directory: it joins, fetches the genesis weights and the shards its
  first lease names, and starts training;
* **warm** (the baseline): the same directory again, the shards on its disk already.

Each time is from the trainer process's start to its ``training`` event (the lease's data
is ready and the inner steps begin); the figure is ``cold / warm``. A trainer that had to
hold, or hash, the whole dataset first would take as long as reading ``--size-mb`` more.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w

from p2ptrain.data.prepare import prepare_dataset
from p2ptrain.errors import LocalError
from p2ptrain.node.local_network import LocalNetwork
from p2ptrain.observe.events import ShardsFetched, TrainingStarted

__all__ = ["run_data_bench"]

_CONFIG = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32, "batch_size": 8}
_VOCAB = 65
_ROWS_PER_WRITE = 1 << 20


def _write_text(path: Path, size_bytes: int, seed: int) -> int:
    """A text file of about ``size_bytes`` seeded random characters of a :data:`_VOCAB`
    letter alphabet; returns its rows of ``block_size + 1`` characters."""
    width = int(_CONFIG["block_size"]) + 1
    alphabet = np.frombuffer(bytes(range(48, 48 + _VOCAB)), dtype=np.uint8)
    rng = np.random.default_rng(seed)
    with path.open("wb") as out:
        for start in range(0, size_bytes, _ROWS_PER_WRITE * width):
            count = min(size_bytes - start, _ROWS_PER_WRITE * width)
            out.write(alphabet[rng.integers(0, _VOCAB, size=count)].tobytes())
    return max(1, size_bytes // width)


def _experiment(network: LocalNetwork, prepared: Path) -> Path:
    tables: dict[str, Any] = {
        "study": "bench-data",
        "name": "tokens",
        "inner_steps": 10,
        "validators": [network.identity("validator")],
        "quorum": 1,
        "workload": {"name": "char-gpt", "config": _CONFIG},
        "window": {"deadline_s": 600.0, "proposal_s": 10.0, "min_updates": 1, "max_updates": 1},
        "data": {"prepared": str(prepared)},
    }
    return network.write_experiment(tomli_w.dumps(tables))


def _time_to_training(network: LocalNetwork, timeout_s: float) -> dict[str, Any]:
    """Start the trainer, wait for its ``training`` event; its timing and the shards it
    fetched. The trainer is stopped before returning."""
    started = time.monotonic()
    network.start("trainer", "trainer")
    fetched: list[ShardsFetched] = []
    found: TrainingStarted | None = None
    try:
        for name, event in network.next_events(timeout_s):
            if name != "trainer":
                continue
            if isinstance(event, ShardsFetched):
                fetched.append(event)
            elif isinstance(event, TrainingStarted):
                found = event
                break
    finally:
        network.stop(["trainer"])
    if found is None:
        log = network.nodes["trainer"].log
        raise LocalError(f"the trainer did not start training within {timeout_s:.0f} s; see {log}")
    return {
        "seconds": round(time.monotonic() - started, 3),
        "data_seconds": found.data_seconds,
        "shards_fetched": sum(len(e.shards) for e in fetched),
        "bytes_fetched": sum(e.bytes for e in fetched),
    }


def run_data_bench(
    *, size_mb: int = 1024, shard_mb: int = 16, seed: int = 0, workdir: str | None = None
) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    if size_mb < 1 or shard_mb < 1:
        raise LocalError("--size-mb and --shard-mb must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-data-", dir=workdir))
    try:
        source = root / "source"
        source.mkdir()
        began = time.monotonic()
        rows = _write_text(source / "letters.txt", size_mb << 20, seed)
        wrote_s = time.monotonic() - began
        began = time.monotonic()
        prepared = prepare_dataset(
            source / "letters.txt",
            root / "prepared",
            name="tokens",
            shard_bytes=shard_mb << 20,
            block_size=int(_CONFIG["block_size"]) + 1,
            tokenizer="chars",
        )
        prepare_s = time.monotonic() - began
        shutil.rmtree(source)
        network = LocalNetwork(root / "net")
        with network:
            path = _experiment(network, prepared.path)
            began = time.monotonic()
            network.start("seed", "seed", args=["--experiment-toml", str(path)])
            network.wait_ready(["seed"], timeout_s=600)
            seed_s = time.monotonic() - began
            cold = _time_to_training(network, timeout_s=300)
            warm = _time_to_training(network, timeout_s=300)
        manifest = prepared.manifest
        return {
            "dataset_bytes": manifest.total_bytes,
            "rows": rows,
            "shards": len(manifest.shards),
            "shard_bytes": manifest.shards[0].bytes,
            "write_seconds": round(wrote_s, 2),
            "prepare_seconds": round(prepare_s, 2),
            "seed_ready_seconds": round(seed_s, 2),
            "cold": cold,
            "warm": warm,
            "ratio": round(cold["seconds"] / warm["seconds"], 3),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
