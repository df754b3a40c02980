"""SHA-256 of what every aggregation rule and outer optimizer computes from seeded,
adversarial inputs: the canonical bytes that two validators must agree on.

``test_bit_exact.py`` compares these hashes across input orders, thread counts, a separate
process (this file run as a script) and the golden file. Run as a script it prints the
hashes as JSON; to regenerate the golden file after an *intended* change of the canonical
arithmetic (a protocol change: old heads no longer re-verify), run from the repository root:

    .venv/bin/python tests/support/bit_exact_child.py --write tests/golden/aggregate_hashes.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from p2ptrain.aggregate.cohort import AggregationResult, Contribution, Failure
from p2ptrain.aggregate.exact import CHUNK
from p2ptrain.aggregate.outer import OuterNesterov, OuterSGD
from p2ptrain.aggregate.rules import make_rule, rule_names
from p2ptrain.core.manifests import AggregationSpec, ConfigValue
from p2ptrain.store.kernel_build import ensure_kernel

SEED = 20_240_611
LENGTH = 3 * CHUNK + 17
UPDATES = 7

#: Rules beyond the registry defaults: other trims, Krum settings, a fixed tau, an even
#: cohort for the median (midpoints), Weiszfeld stopped early.
VARIANTS: dict[str, tuple[str, dict[str, ConfigValue], int]] = {
    "trimmed_mean.beta=0.3": ("trimmed_mean", {"beta": 0.3}, UPDATES),
    "trimmed_mean.beta=0": ("trimmed_mean", {"beta": 0.0}, UPDATES),
    "median.even": ("median", {}, UPDATES - 1),
    "krum.f=1.m=2": ("krum", {"f": 1, "m": 2}, UPDATES),
    "centered_clip.tau=3": ("centered_clip", {"tau": 3.0, "iterations": 2}, UPDATES),
    "geometric_median.iterations=2": ("geometric_median", {"iterations": 2}, UPDATES),
}


class ByteStream:
    """Seeded random integers from SHAKE-256 (FIPS 202): the same numbers on every machine,
    Python, numpy and torch version, which no library generator promises. (``torch.randn``
    even differs between CPU capabilities: its vectorised logarithms and cosines do.)"""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def integers(self, count: int) -> torch.Tensor:
        """``count`` integers in ``[0, 2**32)`` (int64)."""
        self.calls += 1
        data = hashlib.shake_256(f"{self.seed}/{self.calls}".encode()).digest(4 * count)
        return torch.from_numpy(np.frombuffer(data, dtype="<u4").astype(np.int64))

    def floats(self, count: int, top: int) -> torch.Tensor:
        """Float32 values ``m * 2**e``, ``|m| < 2**23``, ``e`` from ``top - 30`` to
        ``top - 23``: integers and exact power-of-two scalings only."""
        bits = self.integers(count)
        mantissa = (bits >> 8) - 2**23
        scales = torch.tensor([2.0**k for k in range(top - 30, top - 22)], dtype=torch.float32)
        return mantissa.to(torch.float32) * scales[bits & 7]

    def permutation(self, count: int) -> torch.Tensor:
        """A permutation of ``range(count)`` (a stable sort of random keys)."""
        return torch.sort(self.integers(count), stable=True).indices


def adversarial_vectors(
    seed: int, count: int = UPDATES, length: int = LENGTH
) -> list[torch.Tensor]:
    """Seeded float32 updates near a common direction, with large magnitudes (one update
    far out, as an attacker would be), tiny and subnormal values, exact ties, -0.0 and
    +0.0, and one exact duplicate update."""
    stream = ByteStream(seed)
    common = stream.floats(length, top=0)
    vectors = [common + stream.floats(length, top=-2) for _ in range(count)]
    spots = stream.permutation(length)
    big, tiny, zeros, signed = spots[:64], spots[64:128], spots[128:256], spots[256:320]
    all_tied, some_tied = spots[320:640], spots[640:960]
    for index, vector in enumerate(vectors):
        vector[big[index::count]] = (-1.0) ** index * 2.0 ** (10 + 2 * index)
        vector[tiny] = [1e-38, 1e-44, -1e-45, 3e-39][index % 4]  # normal and subnormal
        vector[zeros] = 0.0 if index % 3 else -0.0
        vector[signed[index::count]] = -0.0
        if index:
            vector[all_tied] = vectors[0][all_tied]
            if index % 2 == 0:
                vector[some_tied] = vectors[0][some_tied]
        else:
            vector[all_tied] = vector[all_tied].round()
    if count >= 3:
        vectors[2][big] = 2.0**100  # one update far out, at about 1e30
        vectors[-1] = vectors[1].clone()  # a duplicate: Krum sees a distance of exactly 0
    return vectors


def _ids(count: int) -> list[str]:
    return [hashlib.sha256(f"update-{index}".encode()).hexdigest() for index in range(count)]


def _digest(result: AggregationResult) -> dict[str, str]:
    assert result.aggregate is not None, result.reason
    decisions = [
        (d.update_id, d.status, None if d.distance is None else d.distance.hex())
        for d in result.diagnostics
    ]
    return {
        "aggregate": hashlib.sha256(result.aggregate.numpy().tobytes()).hexdigest(),
        "decisions": hashlib.sha256(json.dumps(decisions).encode()).hexdigest(),
    }


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0" + tensors[name].numpy().tobytes())
    return digest.hexdigest()


def rule_hashes(seed: int = SEED, order_seed: int | None = None) -> dict[str, dict[str, str]]:
    """Hashes per rule (defaults, then :data:`VARIANTS`); ``order_seed`` shuffles the
    contributions (and failures) before they are handed over."""
    vectors = adversarial_vectors(seed)
    ids = _ids(UPDATES + 2)
    failures = [Failure(ids[UPDATES], "undecodable"), Failure(ids[UPDATES + 1], "late")]
    runs = {name: (name, {}, UPDATES) for name in rule_names()} | VARIANTS
    hashes = {}
    for label, (rule, config, count) in runs.items():
        cohort = [Contribution(ids[i], vectors[i], weight=1.0 + i % 3) for i in range(count)]
        faults = list(failures)
        if order_seed is not None:
            random.Random(order_seed).shuffle(cohort)
            random.Random(order_seed + 1).shuffle(faults)
        result = make_rule(AggregationSpec(rule=rule, config=config)).aggregate(cohort, faults)
        hashes[label] = _digest(result)
    return hashes


def outer_hashes(seed: int = SEED) -> dict[str, str]:
    """Hashes of two Nesterov steps (weights and momentum) and of SGD steps."""
    stream = ByteStream(seed + 1)
    vectors = adversarial_vectors(seed + 2, count=2, length=LENGTH)
    params = {
        "layer.weight": stream.floats(LENGTH - 1000, top=1),
        "layer.bias": stream.floats(1000, top=1).reshape(10, 100),
    }
    gradients = [
        {"layer.weight": vector[: LENGTH - 1000], "layer.bias": vector[-1000:].reshape(10, 100)}
        for vector in vectors
    ]
    nesterov = OuterNesterov()
    first = nesterov.step(params, gradients[0])
    second = nesterov.step(first.params, gradients[1], first.state)
    return {
        "nesterov.params": _tensors_digest(second.params),
        "nesterov.state": _tensors_digest(second.state),
        "sgd.lr=1": _tensors_digest(OuterSGD(1.0).step(params, gradients[0]).params),
        "sgd.lr=0.7": _tensors_digest(OuterSGD(0.7).step(params, gradients[0]).params),
    }


def all_hashes(seed: int = SEED, order_seed: int | None = None) -> dict[str, object]:
    return {"rules": rule_hashes(seed, order_seed), "outer": outer_hashes(seed)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads before computing")
    parser.add_argument("--write", type=Path, help="write the hashes to this golden file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_kernel()  # as a node does: the C kernel where it builds
    text = json.dumps(all_hashes(args.seed), indent=2, sort_keys=True) + "\n"
    if args.write:
        args.write.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
