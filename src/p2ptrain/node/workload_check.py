"""Is the local workload the experiment's? Build it from the manifest, compare, say what differs.

A node that trains (or evaluates) builds the experiment's workload from the manifest: a
built-in or installed workload by its name, or the operator's own code by the reference the
operator passed (``--workload``; a manifest never makes a node run code by itself naming it).
The result must be the experiment's model and data: the same parameters (names, shapes,
dtypes) as the genesis weights, the same shards, and the batch size the leases were cut for.
Each mismatch is refused with the first difference named, and what to do about it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from p2ptrain.core.manifests import DatasetManifest, ExperimentManifest
from p2ptrain.core.tensors import schema_hash
from p2ptrain.errors import LocalError
from p2ptrain.torch.registry import known_workloads, make_workload
from p2ptrain.torch.workload import Workload

__all__ = [
    "build_workload",
    "check_workload",
    "dataset_difference",
    "experiment_workload",
    "schema_difference",
    "workload_code",
]


def workload_code(manifest: ExperimentManifest, given: str | None) -> str:
    """What to build the experiment's workload from: ``given`` (the operator's
    ``--workload``), else the manifest's workload name when it is built in or installed
    here. A workload the manifest names by reference is run only when the operator gives
    it: it is code, and the manifest came from someone else."""
    spec = manifest.workload
    if given:
        return given
    if not spec.reference and spec.name in known_workloads():
        return spec.name
    hint = spec.reference or "path/to/file.py:factory"
    raise LocalError(
        f"experiment {manifest.name!r} trains the workload {spec.name!r}"
        + (f" from code ({spec.reference})" if spec.reference else ", not installed here")
        + f": pass --workload {hint} (the same code the seed used; it runs on this machine, "
        "so only code you trust), or install the package that provides it"
    )


def build_workload(manifest: ExperimentManifest, given: str | None = None) -> Workload:
    """The experiment's workload, built from ``given`` or the manifest's name (see
    :func:`workload_code`) with the manifest's config; not yet checked."""
    return make_workload(
        workload_code(manifest, given), manifest.workload.config, dataset=manifest.dataset
    )


def experiment_workload(manifest: ExperimentManifest, given: str | None = None) -> Workload:
    """:func:`build_workload`, checked against the manifest."""
    return check_workload(manifest, build_workload(manifest, given))


def schema_difference(
    local: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> str:
    """The first difference between two state dicts' parameters, in words."""
    for name in sorted(expected.keys() | local.keys()):
        if name not in local:
            hint = ""
            if f"module.{name}" in local:
                hint = (
                    " (the local names start with 'module.': pass the unwrapped model, "
                    "model.module, not the DDP wrapper)"
                )
            return f"parameter {name!r} is missing from the local model{hint}"
        if name not in expected:
            hint = ""
            if name.startswith("module.") and name.removeprefix("module.") in expected:
                hint = " (the 'module.' prefix means a DDP-wrapped model: pass model.module)"
            return f"the local model has a parameter {name!r} the experiment's has not{hint}"
        mine, theirs = local[name], expected[name]
        if mine.shape != theirs.shape:
            return (
                f"parameter {name!r} has shape {tuple(mine.shape)} locally, "
                f"{tuple(theirs.shape)} in the experiment"
            )
        if mine.dtype != theirs.dtype:
            return f"parameter {name!r} is {mine.dtype} locally, {theirs.dtype} in the experiment"
    return "the parameter schemas differ"


def dataset_difference(local: DatasetManifest, expected: DatasetManifest) -> str:
    """The first difference between two dataset manifests, in words."""
    if local.name != expected.name:
        return f"the local dataset is named {local.name!r}, the experiment's {expected.name!r}"
    for index, (mine, theirs) in enumerate(zip(local.shards, expected.shards, strict=False)):
        if mine.samples != theirs.samples:
            return (
                f"shard {index} ({theirs.name}) holds {mine.samples} samples locally, "
                f"{theirs.samples} in the experiment"
            )
        if mine.blob_id != theirs.blob_id:
            first = index * (local.shards[0].samples if local.shards else 0)
            return (
                f"shard {index} ({theirs.name}, samples from {first}) has other contents "
                f"locally (hash {mine.blob_id[:12]}, the experiment's {theirs.blob_id[:12]})"
            )
    if len(local.shards) != len(expected.shards):
        return (
            f"the local dataset has {len(local.shards)} shards, the experiment's "
            f"{len(expected.shards)}"
        )
    return "the datasets differ"


def check_workload(
    manifest: ExperimentManifest,
    workload: Workload,
    genesis: Mapping[str, torch.Tensor] | None = None,
) -> Workload:
    """``workload`` if its model and data are the experiment's: the same parameter schema
    (the first differing parameter named when ``genesis``, the experiment's genesis weights,
    is given), the batch size the leases were cut for, and the same shards (bytes hashed;
    a ``sharded`` experiment's shards are fetched by their hashes, so are not compared);
    else a LocalError saying what differs."""
    spec = manifest.workload
    weights = workload.initial_weights()
    local_schema = schema_hash(weights)
    if local_schema != spec.schema_hash:
        what = (
            schema_difference(weights, genesis)
            if genesis is not None
            else f"parameter schema {local_schema[:12]}, the experiment's {spec.schema_hash[:12]}"
        )
        raise LocalError(
            f"the local model is not the model of experiment {manifest.name!r} ({spec.name}): "
            f"{what}. Build the same model (names, shapes, dtypes) as the experiment's"
        )
    if spec.batch_size and workload.batch_size != spec.batch_size:
        raise LocalError(
            f"the local batch size is {workload.batch_size}; experiment {manifest.name!r} "
            f"trains batches of {spec.batch_size}: build the train loader with "
            f"batch_size={spec.batch_size}"
        )
    if manifest.dataset.kind == "sharded":
        return workload  # the experiment's own shards, fetched by hash (attach_shards)
    local_data = workload.dataset_manifest()
    if local_data != manifest.dataset:
        raise LocalError(
            f"the local training data is not the dataset of experiment {manifest.name!r}: "
            f"{dataset_difference(local_data, manifest.dataset)}. Use the same dataset, in the "
            "same order, with the same samples per shard"
        )
    return workload
