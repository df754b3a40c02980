"""``p2ptrain experiment template|create|show|coverage``: start, define, sign and inspect
experiments, and see how evenly their leases reach the dataset."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from p2ptrain.cli.commands import add_command
from p2ptrain.cli.usage import show_usage
from p2ptrain.core.envelope import open_envelope, seal
from p2ptrain.core.experiment_config import (
    defined_workload,
    experiment_from_toml,
    parse_experiment_toml,
)
from p2ptrain.core.identity import Identity
from p2ptrain.core.manifests import (
    MAX_SHARDS,
    DatasetManifest,
    ExperimentManifest,
    ShardInfo,
    WorkloadSpec,
)
from p2ptrain.errors import InvalidRecord, LocalError, ProtocolViolation
from p2ptrain.store.atomic import write_atomically
from p2ptrain.store.keyfile import load_identity

#: Where installed packages register workloads (``p2ptrain.torch.registry``, which imports
#: torch, names the same group).
WORKLOAD_ENTRY_POINTS = "p2ptrain.workloads"

#: inner_steps when a definition leaves it out (the manifest's default).
_INNER_STEPS: int = next(
    field.default
    for field in msgspec.structs.fields(ExperimentManifest)
    if field.name == "inner_steps"
)


def add_parsers(commands: Any, data_dir: str) -> None:
    experiment = add_command(commands, "experiment")
    sub = experiment.add_subparsers(dest="experiment_command", metavar="SUBCOMMAND")

    template = sub.add_parser(
        "template",
        help="print a commented starting experiment definition (TOML) for a workload",
        description="Print an experiment definition for --workload: the keys a seed needs, "
        "every other key commented out with its default and meaning, and the keys the seed "
        "fills in. Save it, then `p2ptrain demo --experiment-toml FILE` or `p2ptrain seed "
        "--experiment-toml FILE`. Every key is explained in docs/experiment.md (--doc).",
    )
    template.add_argument(
        "--workload",
        metavar="REF",
        help="char-gpt (the default), hf-causal-lm, an installed workload's name, or your "
        "code: path/to/file.py:factory or package.module:factory (not imported)",
    )
    template.add_argument(
        "--doc",
        action="store_true",
        help="print the reference of every key instead, as Markdown (docs/experiment.md)",
    )
    template.set_defaults(handler=run_template)

    create = sub.add_parser(
        "create",
        help="validate a TOML experiment definition, sign it and print its id",
        description="Validate a TOML experiment definition, sign it with the data "
        "directory's key (which becomes the experiment authority), store it, write the "
        "signed manifest to --out and print the experiment id.",
    )
    create.add_argument("toml", help="experiment definition (see docs/experiment.md)")
    create.add_argument("--dir", default=data_dir, help=f"data directory (default: {data_dir})")
    create.add_argument(
        "--out", help="where to write the signed manifest (default: TOML path + .experiment)"
    )
    create.add_argument(
        "--allow-minority-quorum",
        action="store_true",
        help="accept a quorum of at most half the validators (unsafe: two disjoint quorums "
        "could certify different heads)",
    )
    create.set_defaults(handler=run_create)

    show = sub.add_parser(
        "show",
        help="verify a signed experiment manifest and print it as JSON",
        description="Verify a signed experiment manifest file and print it as JSON.",
    )
    show.add_argument("manifest", help="signed manifest written by `experiment create`")
    show.set_defaults(handler=run_show)

    coverage = sub.add_parser(
        "coverage",
        help="how much of the dataset the leases of T trainers over W windows reach",
        description="Compute the leases of --trainers random trainers in windows 1..--windows "
        "and print the fraction of samples leased at least once (coverage) and the most-leased "
        "sample's count over the mean count (max/mean). The dataset and lease size come from "
        "an experiment definition, or from --shards, --samples-per-shard and --lease-size.",
    )
    coverage.add_argument(
        "--experiment-toml",
        metavar="FILE",
        help="experiment definition; its [dataset] and lease_size, or else what its workload "
        "computes (the workload is built)",
    )
    coverage.add_argument("--shards", type=int, metavar="S", help="a dataset of S shards")
    coverage.add_argument(
        "--samples-per-shard", type=int, metavar="N", help="samples in each shard"
    )
    coverage.add_argument("--lease-size", type=int, metavar="L", help="samples per lease")
    coverage.add_argument("--trainers", type=int, required=True, metavar="T")
    coverage.add_argument("--windows", type=int, required=True, metavar="W")
    coverage.add_argument(
        "--seed", type=int, default=0, help="seed of the trainers' ids (default 0)"
    )
    coverage.add_argument("--json", action="store_true", help="print one JSON object")
    coverage.set_defaults(handler=run_coverage)
    experiment.set_defaults(handler=lambda _args: show_usage(experiment))


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise LocalError(f"cannot read {path}: {exc.strerror}") from exc


def run_template(args: argparse.Namespace) -> int:
    from importlib.metadata import entry_points

    from p2ptrain.core.experiment_doc import reference_markdown
    from p2ptrain.core.experiment_template import DEFAULT_WORKLOAD, experiment_template

    if args.doc:
        if args.workload is not None:
            raise LocalError("--doc: the reference covers every workload; leave out --workload")
        sys.stdout.write(reference_markdown())
        return 0
    installed = {point.name for point in entry_points(group=WORKLOAD_ENTRY_POINTS)}
    sys.stdout.write(experiment_template(args.workload or DEFAULT_WORKLOAD, installed))
    return 0


def run_create(args: argparse.Namespace) -> int:
    from p2ptrain.store.datadir import DataDir  # sqlite, which only this command needs

    try:
        text = _read(args.toml).decode("utf-8")
    except UnicodeDecodeError:
        raise LocalError(f"{args.toml} is not UTF-8 text") from None
    identity = load_identity(args.dir)
    manifest = experiment_from_toml(text, identity.public_key)
    problem = manifest.minority_quorum_problem("--allow-minority-quorum")
    if problem is not None and not args.allow_minority_quorum:
        raise LocalError(f"{args.toml}: {problem}")
    signed = seal(identity, manifest)
    data = signed.envelope.encode()
    out = Path(args.out) if args.out else Path(args.toml).with_suffix(".experiment")
    write_atomically(out, data)
    with DataDir(args.dir) as store:
        store.state.put_record(
            signed.record_id,
            "experiment",
            data,
            experiment_id=signed.record_id,
            signer=identity.peer_id,
        )
    print(f"signed experiment written to {out}", file=sys.stderr)
    print(signed.record_id)
    return 0


def _hex_bytes(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hex_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_hex_bytes(v) for v in value]
    return value


def run_show(args: argparse.Namespace) -> int:
    try:
        signed = open_envelope(_read(args.manifest), ExperimentManifest)
    except ProtocolViolation as exc:
        raise LocalError(f"{args.manifest} is not a valid signed experiment: {exc}") from exc
    body = _hex_bytes(msgspec.to_builtins(signed.record, builtin_types=(bytes,)))
    print(
        json.dumps(
            {"experiment_id": signed.record_id, "signer": signed.signer_id, "manifest": body},
            indent=2,
        )
    )
    return 0


def _coverage_data(args: argparse.Namespace) -> tuple[DatasetManifest, int]:
    """The dataset and lease size that ``experiment coverage`` was given."""
    synthetic = {
        "--shards": args.shards,
        "--samples-per-shard": args.samples_per_shard,
        "--lease-size": args.lease_size,
    }
    given = [option for option, value in synthetic.items() if value is not None]
    if args.experiment_toml is not None:
        if given:
            raise LocalError(
                f"{', '.join(given)}: not with --experiment-toml, which gives the dataset and "
                "lease size; pass one or the other"
            )
        return _defined_data(Path(args.experiment_toml))
    missing = [option for option, value in synthetic.items() if value is None]
    if missing:
        raise LocalError(
            f"{', '.join(missing)}: missing; give --shards, --samples-per-shard and "
            "--lease-size, or --experiment-toml FILE"
        )
    if not 1 <= args.shards <= MAX_SHARDS:
        raise LocalError(f"--shards {args.shards}: use 1 to {MAX_SHARDS}")
    if args.samples_per_shard < 1:
        raise LocalError(f"--samples-per-shard {args.samples_per_shard}: use 1 or more")
    total = args.shards * args.samples_per_shard
    if not 1 <= args.lease_size <= total:
        raise LocalError(
            f"--lease-size {args.lease_size}: use 1 to {total} (the samples of "
            f"{args.shards} shards of {args.samples_per_shard})"
        )
    shards = tuple(
        ShardInfo(
            name=f"shard-{i:05d}",
            blob_id=hashlib.sha256(f"coverage/shard/{i}".encode()).hexdigest(),
            samples=args.samples_per_shard,
        )
        for i in range(args.shards)
    )
    return DatasetManifest(name="coverage", shards=shards), args.lease_size


def _defined_data(path: Path) -> tuple[DatasetManifest, int]:
    """A definition's dataset (its prepared shards, ``[data] prepared``, when it names
    some) and lease size; what its workload computes where it leaves them out (as a seed
    fills them in)."""
    from p2ptrain.node.setup import definition_data, read_definition

    raw = parse_experiment_toml(read_definition(path))
    prepared = definition_data(raw, path)
    dataset_table, lease_size = raw.get("dataset"), raw.get("lease_size")
    if prepared is not None:
        dataset_table = msgspec.to_builtins(prepared.manifest)
    if dataset_table is None or lease_size is None:
        from p2ptrain.torch.registry import make_workload

        code = defined_workload(raw, None, str(path))
        config = raw["workload"].get("config", {})
        print(f"building the workload {code!r} for its dataset...", file=sys.stderr)
        workload = make_workload(code, config if isinstance(config, dict) else {})
        if dataset_table is None:
            dataset_table = msgspec.to_builtins(workload.dataset_manifest())
        if lease_size is None:
            inner_steps = raw.get("inner_steps", _INNER_STEPS)
            if not isinstance(inner_steps, int) or isinstance(inner_steps, bool):
                raise LocalError(f"{path}: inner_steps must be a whole number")
            lease_size = inner_steps * workload.batch_size
    try:
        dataset = msgspec.convert(dataset_table, DatasetManifest)
    except InvalidRecord as exc:
        raise LocalError(f"{path}: {exc.field}: {exc.problem}") from exc
    except msgspec.ValidationError as exc:
        raise LocalError(f"{path}: [dataset]: {exc}") from exc
    if not isinstance(lease_size, int) or isinstance(lease_size, bool):
        raise LocalError(f"{path}: lease_size must be a whole number, got {lease_size!r:.40}")
    if not 1 <= lease_size <= dataset.total_samples:
        raise LocalError(
            f"{path}: lease_size {lease_size} must be 1 to {dataset.total_samples} (the "
            "dataset's samples); fix the definition"
        )
    return dataset, lease_size


def _coverage_manifest(dataset: DatasetManifest, lease_size: int, seed: int) -> ExperimentManifest:
    """A stand-in experiment over ``dataset``: leases depend on the experiment's id, so the
    placeholders (named after ``seed``) only shuffle which leases are drawn."""

    def placeholder(label: str) -> str:
        return hashlib.sha256(f"coverage/{seed}/{label}".encode()).hexdigest()

    authority = Identity.from_seed(hashlib.sha256(f"coverage/{seed}/authority".encode()).digest())
    return ExperimentManifest(
        network_id=placeholder("network"),
        study="coverage",
        name=f"seed-{seed}",
        authority=authority.public_key,
        workload=WorkloadSpec(name="coverage", schema_hash=placeholder("schema")),
        dataset=dataset,
        validators=(authority.public_key,),
        quorum=1,
        lease_size=lease_size,
        genesis_weights=placeholder("genesis"),
    )


def run_coverage(args: argparse.Namespace) -> int:
    from p2ptrain.protocol.coverage import lease_coverage

    if args.trainers < 1:
        raise LocalError(f"--trainers {args.trainers}: use 1 or more")
    if args.windows < 1:
        raise LocalError(f"--windows {args.windows}: use 1 or more")
    dataset, lease_size = _coverage_data(args)
    manifest = _coverage_manifest(dataset, lease_size, args.seed)
    peer_ids = [
        Identity.from_seed(hashlib.sha256(f"coverage/{args.seed}/{i}".encode()).digest()).peer_id
        for i in range(args.trainers)
    ]
    result = lease_coverage(manifest, peer_ids, range(1, args.windows + 1))
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "seed": args.seed}, sort_keys=True))
        return 0
    print(
        f"{result.trainers} trainers x {result.windows} windows (seed {args.seed}): "
        f"{result.leases} leases of {result.lease_size} samples over {result.shards} shards, "
        f"{result.samples} samples"
    )
    print(
        f"coverage {result.coverage:.4f} ({result.never_leased} samples never leased); "
        f"{result.mean_leases_per_sample:.2f} leases per sample on average, the most-leased "
        f"sample in {result.max_leases} (max/mean {result.max_over_mean:.2f})"
    )
    return 0
