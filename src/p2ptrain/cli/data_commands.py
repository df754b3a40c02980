"""``p2ptrain data prepare|show``: make a dataset into shard files, and look at one."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from p2ptrain.cli.commands import add_command
from p2ptrain.cli.status_text import mib
from p2ptrain.cli.usage import show_usage
from p2ptrain.data.prepare import (
    DEFAULT_SHARD_BYTES,
    PreparedDataset,
    PrepareProgress,
    prepare_dataset,
    read_prepared,
)
from p2ptrain.errors import LocalError


def add_parsers(commands: Any, data_dir: str) -> None:
    data = add_command(commands, "data")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    prepare = sub.add_parser(
        "prepare",
        help="cut a dataset into content-addressed shard files and a dataset manifest",
        description="Read SOURCE, cut its rows into shard files (safetensors) and write them "
        "with dataset.json, which holds the dataset manifest, to --out. --out appears "
        "complete or not at all. See docs/data.md.",
    )
    prepare.add_argument(
        "source",
        help="a file or directory of .txt, .jsonl, .parquet, .npy or .npz files, or a "
        "directory written by datasets' save_to_disk",
    )
    prepare.add_argument("--out", required=True, help="the directory to create")
    prepare.add_argument("--name", help="the dataset's name (default: from SOURCE's name)")
    prepare.add_argument(
        "--samples-per-shard", type=int, help="rows per shard (default: cut by --shard-mb)"
    )
    prepare.add_argument(
        "--shard-mb",
        type=float,
        default=DEFAULT_SHARD_BYTES / (1 << 20),
        help="about how large a shard file gets, in MiB (default: %(default)g; at most 1024)",
    )
    prepare.add_argument(
        "--block-size", type=int, help="tokens per row, for text (required for text)"
    )
    prepare.add_argument(
        "--tokenizer",
        help="for text: bytes (the default), chars, or a local Hugging Face tokenizer directory",
    )
    prepare.add_argument(
        "--text-field", help="the field of .jsonl/.parquet/Hugging Face rows to tokenize"
    )
    prepare.add_argument("--split", help="the split of a Hugging Face DatasetDict (train)")
    prepare.add_argument("--column", help="the column name of .npy rows (input_ids)")
    prepare.add_argument(
        "--val-fraction",
        type=float,
        metavar="F",
        help="hold out this fraction of the rows (evenly spread) as the validation split: "
        "shards no lease names, on which built-in workloads report the validation loss",
    )
    prepare.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --out (a prepared dataset) once the new one is complete",
    )
    prepare.add_argument("--json", action="store_true", help="print JSON")
    prepare.set_defaults(handler=run_prepare)

    show = sub.add_parser(
        "show",
        help="check a prepared dataset and print what it holds",
        description="Check that every shard file of a prepared dataset is there with its "
        "size (--verify: and its hash), and print what the dataset holds.",
    )
    show.add_argument("dir", help="a directory written by `p2ptrain data prepare`")
    show.add_argument("--verify", action="store_true", help="hash every shard file")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(handler=run_show)
    data.set_defaults(handler=lambda _args: show_usage(data))


def _experiment_lines(dataset: PreparedDataset) -> str:
    return f"[data]\nprepared = {json.dumps(str(dataset.path))}"


def _show_progress(progress: PrepareProgress) -> None:
    print(
        f"\r{progress.shards} shards, {progress.samples} samples, {mib(progress.bytes)}",
        end="",
        file=sys.stderr,
        flush=True,
    )


def run_prepare(args: argparse.Namespace) -> int:
    if not 0 < args.shard_mb <= 1024:
        raise LocalError(f"--shard-mb {args.shard_mb:g}: use more than 0 and at most 1024")
    started = time.monotonic()
    dataset = prepare_dataset(
        args.source,
        args.out,
        name=args.name,
        samples_per_shard=args.samples_per_shard,
        shard_bytes=max(1, int(args.shard_mb * (1 << 20))),
        block_size=args.block_size,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        split=args.split,
        column=args.column,
        overwrite=args.overwrite,
        val_fraction=args.val_fraction,
        on_progress=_show_progress if sys.stderr.isatty() and not args.json else None,
    )
    seconds = time.monotonic() - started
    if sys.stderr.isatty() and not args.json:
        print(file=sys.stderr)
    if args.json:
        result = {
            **dataset.describe(),
            "seconds": round(seconds, 3),
            "columns": dataset.descriptor["columns"],
            "experiment": _experiment_lines(dataset),
        }
        print(json.dumps(result))
        return 0
    _report(dataset, "prepared ", f" in {seconds:.1f} s")
    return 0


def _report(dataset: PreparedDataset, before: str, after: str, *, verified: bool = False) -> None:
    """The summary line, the details and the lines for an experiment definition."""
    summary = dataset.describe()
    validation = dataset.manifest.validation
    held = (
        f"; validation split: {len(validation)} shards, {summary['validation_samples']} samples"
        if validation
        else "; no validation split (--val-fraction F holds one out)"
    )
    print(
        f"{before}{summary['shards']} shards, {summary['samples']} samples, "
        f"{mib(dataset.manifest.total_bytes)}{held}{after}"
    )
    print(*_details(dataset), sep="\n")
    if verified:
        print("  verified every shard file against its SHA-256")
    print("\nput this in the experiment definition:")
    print(_experiment_lines(dataset))


def _details(dataset: PreparedDataset) -> list[str]:
    descriptor = dataset.descriptor
    lines = [f"  dataset  {dataset.manifest.name} at {dataset.path}"]
    columns: Any = descriptor.get("columns") or []
    for column in columns:
        shape = ", ".join("*" if size is None else str(size) for size in column["shape"])
        lines.append(f"  column   {column['key']}: {column['dtype']} [{shape}]")
    tokenizer: Any = descriptor.get("tokenizer")
    if tokenizer:
        lines.append(
            f"  text     {descriptor.get('tokens')} tokens by {tokenizer.get('kind')} "
            f"(vocabulary {tokenizer.get('vocab_size')}) in blocks of "
            f"{descriptor.get('block_size')}; {descriptor.get('dropped_tokens')} left over "
            "were dropped"
        )
    return lines


def run_show(args: argparse.Namespace) -> int:
    dataset = read_prepared(args.dir, verify=args.verify)
    if args.json:
        print(
            json.dumps(
                {
                    **dataset.describe(),
                    "verified": args.verify,
                    "descriptor": dataset.descriptor,
                    "experiment": _experiment_lines(dataset),
                }
            )
        )
        return 0
    _report(dataset, "", "", verified=args.verify)
    return 0
