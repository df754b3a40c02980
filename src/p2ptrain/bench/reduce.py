"""``p2ptrain bench reduce``: one window's reduction as a validator runs it, against the
memory-bandwidth floor of the same run.

Two fresh interpreters (``python -m p2ptrain.bench.reduce --child NAME``), so that the
measured one holds nothing but what a validator holds:

* **prepare** builds a model state of ``params`` float32 values (seeded; tensors of at most
  4M values, 1024 wide, the way a transformer's matrices are), the experiment (the codec, the
  rule, ``max_updates`` = the cohort), and ``updates`` pseudo-gradients (a shared direction
  plus per-trainer noise, like honest updates of one window), each encoded with the codec and
  put into a real blob store, with the lease and the blob's hash and size its trainer's
  record names;
* **reduce** is the validator. It reads its RSS after its imports, then builds the base state
  (the genesis weights, regenerated from the seed), times a plain read of the cohort's
  encoded bytes from the store's files into one buffer (the floor: the least a reduction can
  do is read every input byte once; best of three), and then times one reduction as a
  validator runs it: the blobs read from the store, and
  :func:`~p2ptrain.protocol.reduction.reduce_window` (admission, decoding, screening, the
  rule, the aggregate blob, the outer step, the new state encoded and hashed). The peak is
  the process's ``VmHWM`` (:func:`~p2ptrain.observe.memory.peak_rss_mib`).

The window reduced is window 1, on the genesis head: the outer optimizer's state is created
by the step (a validator further on holds it already; the same bytes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from p2ptrain.bench.children import child_env
from p2ptrain.core.manifests import UPDATE_CODECS
from p2ptrain.errors import LocalError
from p2ptrain.observe.memory import peak_rss_mib, rss_mib

__all__ = ["MAX_FLOOR_RATIO", "ReduceBenchConfig", "run_reduce_bench"]

#: The target: a reduction costs at most this many plain reads of its cohort's bytes.
MAX_FLOOR_RATIO: Final = 8.0
#: The target: peak RSS grows by at most this many model fp32 sizes, plus a fixed margin.
MAX_STATE_COPIES: Final = 3.0
MARGIN_MIB: Final = 256.0
_CHILDREN: Final = ("prepare", "reduce")
#: The widest tensor of the synthetic model (values), and its row length.
_TENSOR_VALUES: Final = 4096 * 1024
_ROW: Final = 1024
_MIB: Final = 1 << 20


@dataclass(frozen=True)
class ReduceBenchConfig:
    """One reduction: ``updates`` updates of a ``params``-parameter model."""

    params: int
    updates: int
    rule: str = "trimmed_mean"
    codec: str = "int8"
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.params < 1:
            raise LocalError(f"--params {self.params}: give a positive parameter count")
        if not 1 <= self.updates <= 1000:
            raise LocalError(f"--updates {self.updates}: give 1 to 1000 updates")
        if self.threads < 1:
            raise LocalError(f"--threads {self.threads}: give 1 or more threads")
        if self.codec not in UPDATE_CODECS:
            raise LocalError(
                f"--codec {self.codec!r}: use one of {', '.join(sorted(UPDATE_CODECS))}"
            )
        from p2ptrain.aggregate.rules import rule_names

        if self.rule not in rule_names():
            raise LocalError(f"--rule {self.rule!r}: use one of {', '.join(rule_names())}")


def run_reduce_bench(config: ReduceBenchConfig, *, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Prepare the cohort, reduce it in a fresh process, and report one JSON-ready object."""
    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-reduce-") as workdir:
        prepared = _run_child("prepare", config, Path(workdir), timeout_s)
        figures = _run_child("reduce", config, Path(workdir), timeout_s)
    model_mib = config.params * 4 / _MIB
    growth = figures["peak_rss_mib"] - figures["rss_after_imports_mib"]
    seconds, floor = figures["reduction_seconds"], figures["floor_seconds"]
    budget_mib = MAX_STATE_COPIES * model_mib + MARGIN_MIB
    return {
        "config": asdict(config),
        "model_fp32_mib": round(model_mib, 1),
        "cohort_encoded_mib": round(prepared["encoded_bytes"] / _MIB, 1),
        "rss_after_imports_mib": round(figures["rss_after_imports_mib"], 1),
        "peak_rss_mib": round(figures["peak_rss_mib"], 1),
        "peak_rss_growth_mib": round(growth, 1),
        "growth_over_model": round(growth / model_mib, 2),
        "growth_budget_mib": round(budget_mib, 1),
        "within_memory_budget": growth <= budget_mib,
        "reduction_seconds": round(seconds, 6),
        "ms_per_mparam_per_update": round(
            seconds * 1000 / (config.params / 1e6) / config.updates, 3
        ),
        "floor_seconds": round(floor, 6),
        "ratio_to_floor": round(seconds / floor, 1) if floor > 0 else None,
        "max_ratio_to_floor": MAX_FLOOR_RATIO,
        "within_time_budget": floor > 0 and seconds / floor <= MAX_FLOOR_RATIO,
        "accepted": figures["accepted"],
        "rejected": figures["rejected"],
        "head_id": figures["head_id"],
    }


def _run_child(name: str, config: ReduceBenchConfig, workdir: Path, timeout_s: float) -> Any:
    """One child in a fresh interpreter importing this same p2ptrain (killed and reaped by
    ``subprocess.run`` on a timeout or an interrupt)."""
    command = [sys.executable, "-m", "p2ptrain.bench.reduce", "--child", name]
    command += ["--config", json.dumps(asdict(config)), "--workdir", str(workdir)]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise LocalError(f"bench reduce: the {name} step took over {timeout_s:g} s") from exc
    if done.returncode != 0:
        raise LocalError(
            f"bench reduce: the {name} step failed (exit {done.returncode}; out of memory "
            f"if it was killed: try fewer --params or --updates): {done.stderr.strip()[-2000:]}"
        )
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1]) if lines else {}
    if figures.get("child") != name:
        raise LocalError(f"bench reduce: the {name} step printed no result")
    return figures


# ----------------------------------------------------------------------- in the children


def _shapes(params: int) -> dict[str, tuple[int, ...]]:
    """The synthetic model: matrices of at most 4M values, 1024 wide, then what is left."""
    shapes: dict[str, tuple[int, ...]] = {}
    left, index = params, 0
    while left >= _ROW:
        rows = min(left, _TENSOR_VALUES) // _ROW
        shapes[f"layer{index:04d}.weight"] = (rows, _ROW)
        left -= rows * _ROW
        index += 1
    if left:
        shapes["tail.bias"] = (left,)
    return shapes


def _weights(config: ReduceBenchConfig) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    return {
        name: torch.randn(shape, generator=generator).mul_(0.02)
        for name, shape in _shapes(config.params).items()
    }


def _delta(config: ReduceBenchConfig, trainer: int) -> dict[str, Any]:
    """Trainer ``trainer``'s pseudo-gradient: the shared direction plus its own noise."""
    import torch

    common = torch.Generator().manual_seed(config.seed + 1)
    own = torch.Generator().manual_seed(config.seed + 1000 + trainer)
    delta = {}
    for name, shape in _shapes(config.params).items():
        tensor = torch.randn(shape, generator=common)
        tensor.add_(torch.randn(shape, generator=own), alpha=0.5).mul_(1e-3)
        delta[name] = tensor
    return delta


def _trainer_identity(config: ReduceBenchConfig, trainer: int) -> Any:
    from p2ptrain.sim.cast import identity_of

    return identity_of(config.seed, f"bench-reduce-trainer-{trainer}")


def _manifest(config: ReduceBenchConfig, weights: dict[str, Any]) -> Any:
    from p2ptrain.core.encoding import sha256_hex
    from p2ptrain.core.manifests import (
        AggregationSpec,
        CodecSpec,
        ExperimentManifest,
        WindowSpec,
        WorkloadSpec,
    )
    from p2ptrain.core.tensors import encode_state_dict, schema_hash
    from p2ptrain.sim.cast import identity_of
    from p2ptrain.sim.workloads import SyntheticWorkload

    dataset = SyntheticWorkload(seed=config.seed).dataset()
    validator = identity_of(config.seed, "bench-reduce-validator")
    return ExperimentManifest(
        network_id=sha256_hex(f"bench-reduce-{config.seed}".encode()),
        study="bench",
        name="reduce",
        authority=identity_of(config.seed, "bench-reduce-authority").public_key,
        workload=WorkloadSpec(name="synthetic", schema_hash=schema_hash(weights)),
        dataset=dataset,
        window=WindowSpec(max_updates=config.updates),
        codec=CodecSpec(name=config.codec),
        aggregation=AggregationSpec(rule=config.rule),
        validators=(validator.public_key,),
        quorum=1,
        lease_size=min(64, sum(shard.samples for shard in dataset.shards)),
        genesis_weights=sha256_hex(bytes(encode_state_dict(weights))),
    )


def _prepare(config: ReduceBenchConfig, workdir: Path) -> dict[str, Any]:
    from p2ptrain.aggregate.codecs import make_encoder
    from p2ptrain.core.encoding import encode, sha256_hex
    from p2ptrain.core.tensors import schema_of
    from p2ptrain.store.blobs import BlobStore

    weights = _weights(config)
    manifest = _manifest(config, weights)
    (workdir / "manifest").write_bytes(encode(manifest))
    encoder = make_encoder(manifest.codec, schema_of(weights))
    del weights
    blobs: list[dict[str, Any]] = []
    with BlobStore(workdir / "blobs") as store:
        for trainer in range(config.updates):
            blob = encoder.encode(_delta(config, trainer))
            blob_id = store.put(blob)
            assert blob_id == sha256_hex(blob)
            blobs.append({"blob_id": blob_id, "bytes": len(blob)})
    (workdir / "updates.json").write_text(json.dumps(blobs))
    return {"encoded_bytes": sum(b["bytes"] for b in blobs)}


def _reduce(config: ReduceBenchConfig, workdir: Path) -> dict[str, Any]:
    import torch

    from p2ptrain.aggregate import native
    from p2ptrain.core.encoding import decode
    from p2ptrain.core.envelope import seal
    from p2ptrain.core.manifests import ExperimentManifest
    from p2ptrain.core.records import Update
    from p2ptrain.protocol.chain import genesis_head
    from p2ptrain.protocol.leases import LeaseBook, lease_for
    from p2ptrain.protocol.reduction import BaseState, Submission, reduce_window
    from p2ptrain.store.blobs import BlobStore
    from p2ptrain.store.kernel_build import ensure_kernel
    from p2ptrain.store.spool import FileSpool

    torch.set_num_threads(config.threads)
    ensure_kernel()
    native.available()
    after_imports = rss_mib()

    manifest = decode(ExperimentManifest, (workdir / "manifest").read_bytes(), max_bytes=1 << 24)
    head = genesis_head(manifest)
    base = BaseState(head, head.id, _weights(config))
    window = base.window
    records = []
    for trainer, blob in enumerate(json.loads((workdir / "updates.json").read_text())):
        identity = _trainer_identity(config, trainer)
        lease = lease_for(manifest, window, identity.peer_id, experiment_id=manifest.id)
        update = Update(
            experiment_id=manifest.id,
            window=window,
            base_head=head.id,
            trainer=identity.public_key,
            lease_shards=lease.shards,
            lease_samples=lease.samples,
            delta_blob=blob["blob_id"],
            delta_bytes=blob["bytes"],
            codec=manifest.codec.name,
            loss_before=1.0,
            loss_after=0.9,
        )
        records.append((update, seal(identity, update).record_id))

    with BlobStore(workdir / "blobs") as store:
        paths = [store.path(update.delta_blob) for update, _ in records]
        buffer = bytearray(max(update.delta_bytes for update, _ in records))
        floor = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for path in paths:
                with path.open("rb", buffering=0) as file:
                    file.readinto(buffer)
            floor = min(floor, time.perf_counter() - start)
        del buffer

        start = time.perf_counter()
        cohort = [
            Submission(update, update_id, store.reader(update.delta_blob))
            for update, update_id in records
        ]
        # the head's blobs go to files in the store, as a node's do
        spool = FileSpool(store.spool_directory)
        reduction = reduce_window(
            manifest, base, cohort, LeaseBook(manifest), (head.id,), spool=spool
        )
        seconds = time.perf_counter() - start
    return {
        "rss_after_imports_mib": after_imports,
        "reduction_seconds": seconds,
        "floor_seconds": floor,
        "accepted": len(reduction.accepted),
        "rejected": len(reduction.rejected),
        "head_id": reduction.head_id,
    }


def main(argv: list[str] | None = None) -> int:
    """A child's entry point: one step, printed as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.bench.reduce")
    parser.add_argument("--child", choices=_CHILDREN, required=True)
    parser.add_argument("--config", required=True, help="ReduceBenchConfig as JSON")
    parser.add_argument("--workdir", required=True, help="the directory the steps share")
    args = parser.parse_args(argv)
    config = ReduceBenchConfig(**json.loads(args.config))
    workdir = Path(args.workdir)
    step = _prepare if args.child == "prepare" else _reduce
    figures = step(config, workdir)
    figures.update(child=args.child, peak_rss_mib=peak_rss_mib())
    print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
