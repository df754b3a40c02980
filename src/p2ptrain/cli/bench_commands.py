"""``p2ptrain bench ...``: benchmarks that report ratios against a same-run baseline."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parsers(commands: Any) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    store = sub.add_parser(
        "store",
        help="blob store and safetensors codec throughput against plain file I/O",
        description="Put/get a blob and encode/decode a state dict, each as a throughput "
        "ratio to plain file write (+fsync) / read of the same bytes in the same run.",
    )
    store.add_argument("--size-mb", type=int, default=100, help="payload size (default 100)")
    store.add_argument("--repeats", type=int, default=5, help="best of N (default 5)")
    store.add_argument("--workdir", help="directory for temporary files (default: system temp)")
    store.add_argument("--json", action="store_true", help="print one JSON object")
    store.set_defaults(handler=run_store)
    bench.set_defaults(handler=lambda _args: _usage(bench))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run_store(args: argparse.Namespace) -> int:
    from p2ptrain.bench.store import run_store_bench

    result = run_store_bench(
        size_bytes=args.size_mb * 1024 * 1024, repeats=args.repeats, workdir=args.workdir
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        for key in sorted(result):
            print(f"{key:40s} {result[key]}")
    return 0
