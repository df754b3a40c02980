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
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import save

from p2ptrain.core.envelope import open_envelope
from p2ptrain.core.manifests import ExperimentManifest
from p2ptrain.core.tensors import decode_state_dict
from p2ptrain.errors import LocalError, ProtocolViolation
from p2ptrain.node.persist import NodeStore, median_val_loss
from p2ptrain.protocol.chain import HeadChain
from p2ptrain.store.atomic import write_atomically
from p2ptrain.store.datadir import DataDir
from p2ptrain.torch.workload import TorchWorkload, Workload

__all__ = [
    "canonical_weights",
    "evaluate_stored_head",
    "export_checkpoint",
    "export_hf",
    "export_workload",
    "exports_hf",
]


def canonical_weights(
    data_dir: Path, head_id: str | None = None
) -> tuple[ExperimentManifest, str, int, str, dict[str, torch.Tensor]]:
    """(manifest, experiment id, height, head id, weights) of the verified tip, or of the
    head ``head_id`` of the verified stored chain (a LocalError if it holds no such head)."""
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
        except (OSError, ProtocolViolation) as exc:
            raise LocalError(f"the weights of head {tip.head_id[:12]} are unusable: {exc}") from exc
        return manifest, experiment_id, tip.head.height, tip.head_id, weights


def export_checkpoint(data_dir: Path, out: Path, *, workload: str | None = None) -> dict[str, Any]:
    """The tip as safetensors plus its config. When this machine can build the workload
    (built in, installed, or ``workload`` given), the file holds the model's whole state
    dict (tied weights as copies, persistent buffers), so that
    ``model.load_state_dict(load_file(out), strict=True)`` loads it; else the parameters."""
    manifest, experiment_id, height, head_id, weights = canonical_weights(data_dir)
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
        "validation": _validation(data_dir, head_id),
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


def _tip_signers(data_dir: Path, experiment_id: str, head_id: str) -> list[str]:
    """The public keys (hex) of the validators whose certificate the tip carries."""
    with DataDir(data_dir) as datadir:
        for _head, certificate in reversed(NodeStore(datadir).links(experiment_id)):
            if certificate.head_id == head_id:
                return [s.validator.hex() for s in certificate.signatures]
    return []


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


def exports_hf(data_dir: Path, given: str | None = None) -> bool:
    """Whether the experiment in ``data_dir`` trains a Hugging Face model this machine can
    build (so ``export_hf`` can write it)."""
    manifest, *_ = canonical_weights(data_dir)
    workload = export_workload(manifest, given)
    model = getattr(workload, "model", None)
    return model is not None and hasattr(model, "save_pretrained")


def export_hf(data_dir: Path, out: Path, *, workload: str | None = None) -> dict[str, Any]:
    """The certified tip as a ``save_pretrained`` directory (config.json, model.safetensors,
    generation config, the vocabulary, a model card): ``from_pretrained(out)`` loads it."""
    from p2ptrain.torch.hf_export import write_hf_export

    manifest, experiment_id, height, head_id, weights = canonical_weights(data_dir)
    built = export_workload(manifest, workload)
    if not isinstance(built, TorchWorkload):
        raise LocalError(
            f"experiment {manifest.name!r} trains {manifest.workload.name!r}, which this "
            "machine cannot build: pass --workload with the experiment's code to export it "
            "in the hf format (or export the plain safetensors checkpoint)"
        )
    card: dict[str, Any] = {
        "experiment": f"{manifest.study}/{manifest.name} (revision {manifest.revision})",
        "experiment_id": experiment_id,
        "head_id": head_id,
        "height": height,
        "certified_by": ", ".join(
            key[:16] for key in _tip_signers(data_dir, experiment_id, head_id)
        ),
        "workload": manifest.workload.reference or manifest.workload.name,
        "inner_steps": manifest.inner_steps,
    }
    validation = _validation(data_dir, head_id)
    card["validation_loss"] = (
        "no evaluator reported yet"
        if validation["median_loss"] is None
        else f"{validation['median_loss']:.4f} (median of {validation['reports']} reports)"
    )
    paths = write_hf_export(built, weights, out, card)
    return {
        "directory": str(out),
        "files": paths,
        "experiment_id": experiment_id,
        "height": height,
        "head_id": head_id,
    }


def _validation(data_dir: Path, head_id: str) -> dict[str, Any]:
    """The median validation loss evaluators reported for the head, and how many did."""
    with DataDir(data_dir) as datadir:
        loss, reports = median_val_loss(NodeStore(datadir), head_id)
    return {"median_loss": loss, "reports": reports}


def evaluate_stored_head(
    data_dir: Path, head_id: str | None = None, *, threads: int = 1, workload: str | None = None
) -> dict[str, Any]:
    """Evaluate the head ``head_id`` (default: the tip) of the verified stored chain with the
    experiment's workload, beside the stored metrics reports of that head."""
    from p2ptrain.node.evaluator import evaluate_head
    from p2ptrain.node.workload_check import experiment_workload

    manifest, experiment_id, height, head, weights = canonical_weights(data_dir, head_id)
    torch.set_num_threads(threads)
    built = experiment_workload(manifest, workload)
    loss, perplexity, samples = evaluate_head(built, weights)
    with DataDir(data_dir) as datadir:
        stored = NodeStore(datadir).reports_for(head)
    reports = [
        {
            "evaluator": report.evaluator.hex(),
            "peer_id": report.evaluator_id,
            "loss": report.loss,
            "difference": report.loss - loss,
            "samples": report.samples,
        }
        for report in sorted(stored, key=lambda r: r.evaluator)
    ]
    return {
        "experiment_id": experiment_id,
        "height": height,
        "head_id": head,
        "loss": loss,
        "perplexity": perplexity,
        "samples": samples,
        "reports": reports,
    }
