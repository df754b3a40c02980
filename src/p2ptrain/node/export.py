"""Exporting the canonical model: the last certified head a data directory holds.

The chain is verified again from genesis before its tip is written out, so an export is
exactly what the validators certified. The weights go to a safetensors file whose metadata
names the experiment, height, head id and workload; the workload's name and config, the
experiment's training settings, the same ids and the median validation loss evaluators
reported for the head go to a JSON file beside it.

:func:`evaluate_stored_head` (``p2ptrain evaluate``) evaluates one verified head locally
and sets the loss beside the metrics reports stored for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import save

from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.records import MetricsReport
from p2ptrain.core.tensors import decode_state_dict
from p2ptrain.errors import BlobNotFound, LocalError, ProtocolViolation
from p2ptrain.node.persist import NodeStore
from p2ptrain.protocol.chain import HeadChain
from p2ptrain.protocol.metrics import median
from p2ptrain.store.atomic import write_atomically
from p2ptrain.store.datadir import DataDir
from p2ptrain.torch.capabilities import PreparedDataUser
from p2ptrain.torch.workload import TorchWorkload, Workload

__all__ = [
    "VerifiedHead",
    "canonical_weights",
    "evaluate_stored_head",
    "export_checkpoint",
    "export_hf",
    "export_workload",
    "verified_head",
]


@dataclass(frozen=True)
class VerifiedHead:
    """A head of a data directory's stored chain, verified from genesis, with what an
    export or an evaluation reports about it."""

    manifest: ExperimentManifest
    experiment_id: str
    height: int
    head_id: str
    weights: dict[str, torch.Tensor]
    #: Public keys (hex) of the validators whose certificate the head carries.
    signers: tuple[str, ...]
    #: The metrics reports stored for the head.
    reports: tuple[MetricsReport, ...]

    def validation(self) -> dict[str, Any]:
        """The median validation loss evaluators reported, and how many did."""
        losses = [report.loss for report in self.reports]
        return {"median_loss": median(losses), "reports": len(losses)}


def verified_head(data_dir: Path, head_id: str | None = None) -> VerifiedHead:
    """The verified tip of ``data_dir``'s stored chain, or its head ``head_id`` (a
    LocalError if it holds no such head)."""
    if not (data_dir / "node.db").exists():
        raise LocalError(f"{data_dir} is not a node's data directory (no node.db)")
    with DataDir(data_dir) as datadir:
        store = NodeStore(datadir)
        experiment_id = store.experiment_id()
        if experiment_id is None:
            raise LocalError(f"{data_dir} follows no experiment yet; run a node on it first")
        raw = store.record(experiment_id)
        if raw is None:
            raise LocalError(f"{data_dir}: the experiment manifest is missing")
        manifest = open_envelope(raw, ExperimentManifest).record
        chain = HeadChain(manifest)
        links = store.links(experiment_id)
        if links:
            verdict = chain.catch_up(links, weights_ok=lambda head: True)
            if not verdict:
                raise LocalError(f"the stored chain does not verify: {verdict.reason}")
        tip = chain.tip
        if head_id is not None:
            found = next(
                (link for h in range(chain.height + 1) if (link := chain.at(h)) is not None
                 and link.head_id == head_id),
                None,
            )  # fmt: skip
            if found is None:
                raise LocalError(
                    f"{data_dir} holds no certified head {head_id[:64]!r} (its chain has "
                    f"heights 0 to {chain.height}); give the id of a head it stored, or no "
                    "--head for the tip"
                )
            tip = found
        try:
            blob = datadir.blobs.get(tip.head.weights_blob)
            weights = decode_state_dict(blob, expected_schema=manifest.workload.schema_hash)
        except BlobNotFound:
            raise LocalError(
                f"the weights of head {tip.head_id[:12]} (height {tip.head.height}) are no "
                f"longer in {data_dir}: a node keeps the blobs of its last certified heads "
                "(--keep-heads) unless it runs with --archive; give a recent head's id"
            ) from None
        except (OSError, ProtocolViolation) as exc:
            raise LocalError(f"the weights of head {tip.head_id[:12]} are unusable: {exc}") from exc
        certificate = tip.certificate
        return VerifiedHead(
            manifest=manifest,
            experiment_id=experiment_id,
            height=tip.head.height,
            head_id=tip.head_id,
            weights=weights,
            signers=tuple(
                s.validator.hex() for s in (certificate.signatures if certificate else ())
            ),
            reports=tuple(store.reports_for(tip.head_id)),
        )


def canonical_weights(
    data_dir: Path, head_id: str | None = None
) -> tuple[ExperimentManifest, str, int, str, dict[str, torch.Tensor]]:
    """(manifest, experiment id, height, head id, weights) of :func:`verified_head`."""
    head = verified_head(data_dir, head_id)
    return head.manifest, head.experiment_id, head.height, head.head_id, head.weights


def export_checkpoint(data_dir: Path, out: Path, *, workload: str | None = None) -> dict[str, Any]:
    """The tip as safetensors plus its config. When this machine can build the workload
    (built in, installed, or ``workload`` given), the file holds the model's whole state
    dict (tied weights as copies, persistent buffers), so that
    ``model.load_state_dict(load_file(out), strict=True)`` loads it; else the parameters."""
    head = verified_head(data_dir)
    manifest, experiment_id, height, head_id = (
        head.manifest, head.experiment_id, head.height, head.head_id
    )  # fmt: skip
    weights = head.weights
    built = export_workload(manifest, workload)
    if isinstance(built, TorchWorkload):
        weights = built.full_state_dict(weights)
    described = {"name": manifest.workload.name, "config": dict(manifest.workload.config)}
    metadata = {
        "format": "p2ptrain-checkpoint/1",
        "experiment_id": experiment_id,
        "height": str(height),
        "head_id": head_id,
        "workload": json.dumps(described, sort_keys=True),
    }
    config = {
        "experiment_id": experiment_id,
        "height": height,
        "head_id": head_id,
        "workload": described,
        "study": manifest.study,
        "name": manifest.name,
        "revision": manifest.revision,
        "inner_steps": manifest.inner_steps,
        "inner_optimizer": msgspec.to_builtins(manifest.inner_optimizer),
        "outer_optimizer": msgspec.to_builtins(manifest.outer_optimizer),
        "codec": msgspec.to_builtins(manifest.codec),
        "aggregation": msgspec.to_builtins(manifest.aggregation),
        "validation": head.validation(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    config_path = out.with_suffix(".json")
    tensors = {name: t.contiguous() for name, t in weights.items()}
    write_atomically(out, save(tensors, metadata=metadata))
    write_atomically(config_path, (json.dumps(config, indent=1, sort_keys=True) + "\n").encode())
    return {
        "checkpoint": str(out),
        "config": str(config_path),
        "experiment_id": experiment_id,
        "height": height,
        "head_id": head_id,
    }


def export_workload(manifest: ExperimentManifest, given: str | None) -> Workload | None:
    """The experiment's workload when this machine can build it (built in, installed, or
    the operator's ``given`` reference), else None (an export then holds the parameters
    only)."""
    from p2ptrain.node.workload_check import build_workload

    try:
        return build_workload(manifest, given)
    except LocalError:
        if given:
            raise
        return None


def export_hf(data_dir: Path, out: Path, *, workload: str | None = None) -> dict[str, Any]:
    """The certified tip as a ``save_pretrained`` directory (config.json, model.safetensors,
    generation config, the vocabulary, a model card): ``from_pretrained(out)`` loads it."""
    from p2ptrain.torch.hf_export import write_hf_export

    head = verified_head(data_dir)
    manifest = head.manifest
    built = export_workload(manifest, workload)
    if not isinstance(built, TorchWorkload):
        raise LocalError(
            f"experiment {manifest.name!r} trains {manifest.workload.name!r}, which this "
            "machine cannot build: pass --workload with the experiment's code to export it "
            "in the hf format (or export the plain safetensors checkpoint)"
        )
    card: dict[str, Any] = {
        "experiment": f"{manifest.study}/{manifest.name} (revision {manifest.revision})",
        "experiment_id": head.experiment_id,
        "head_id": head.head_id,
        "height": head.height,
        "certified_by": ", ".join(key[:16] for key in head.signers),
        "workload": manifest.workload.reference or manifest.workload.name,
        "inner_steps": manifest.inner_steps,
    }
    validation = head.validation()
    card["validation_loss"] = (
        "no evaluator reported yet"
        if validation["median_loss"] is None
        else f"{validation['median_loss']:.4f} (median of {validation['reports']} reports)"
    )
    paths = write_hf_export(built, head.weights, out, card)
    return {
        "directory": str(out),
        "files": paths,
        "experiment_id": head.experiment_id,
        "height": head.height,
        "head_id": head.head_id,
    }


def evaluate_stored_head(
    data_dir: Path, head_id: str | None = None, *, threads: int = 1, workload: str | None = None
) -> dict[str, Any]:
    """Evaluate the head ``head_id`` (default: the tip) of the verified stored chain with the
    experiment's workload, beside the stored metrics reports of that head."""
    from p2ptrain.node.data_import import attach_validation
    from p2ptrain.node.evaluator import evaluate_head
    from p2ptrain.node.workload_check import experiment_workload

    head = verified_head(data_dir, head_id)
    torch.set_num_threads(threads)
    built = experiment_workload(head.manifest, workload)
    dataset = head.manifest.dataset
    with DataDir(data_dir) as datadir:
        missing = attach_validation(built, dataset, datadir.blobs)
        if missing:
            raise LocalError(f"{data_dir}: no validation loss: {missing}")
        absent = [s.name for s in dataset.validation if not datadir.blobs.has(s.blob_id)]
        if isinstance(built, PreparedDataUser) and built.val_from_data and absent:
            raise LocalError(
                f"{data_dir} does not hold the validation shards {', '.join(absent[:3])}"
                f"{' ...' if len(absent) > 3 else ''} of the prepared dataset: run p2ptrain "
                "evaluate on the data directory of a node that evaluates (--evaluate) or "
                "serves the data (the seed, or a node run with --data DIR)"
            )
        loss, perplexity, samples = evaluate_head(built, head.weights)
    reports = [
        {
            "evaluator": report.evaluator.hex(),
            "peer_id": report.evaluator_id,
            "loss": report.loss,
            "difference": report.loss - loss,
            "samples": report.samples,
        }
        for report in sorted(head.reports, key=lambda r: r.evaluator)
    ]
    return {
        "experiment_id": head.experiment_id,
        "height": head.height,
        "head_id": head.head_id,
        "loss": loss,
        "perplexity": perplexity,
        "samples": samples,
        "reports": reports,
    }
