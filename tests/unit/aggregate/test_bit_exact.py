"""Canonical arithmetic is bit-exact (DESIGN §1, principle 3): every aggregation rule and
outer optimizer gives the same bytes whatever the input order, the thread count or the
process, and the same bytes as the golden file recorded when the arithmetic was fixed.

The inputs (``tests/support/bit_exact_child.py``) span several chunks and carry large
magnitudes, subnormals, exact ties, -0.0 and a duplicate update; they are built from
integers so that every machine builds the same ones. The golden file is only compared here,
never written; see the child's docstring to regenerate it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from p2ptrain.aggregate import rules_basic
from p2ptrain.aggregate.exact import CHUNK, sqdist64, sqnorm64
from p2ptrain.aggregate.rules import rule_names
from p2ptrain.aggregate.rules_basic import RowSums, WeightedSpans, Workspace, stream_pass
from p2ptrain.aggregate.rules_robust import pairwise_squared_distances
from tests.support.bit_exact_child import SEED, adversarial_vectors, all_hashes, rule_hashes

ROOT = Path(__file__).resolve().parents[3]
CHILD = ROOT / "tests" / "support" / "bit_exact_child.py"
GOLDEN = ROOT / "tests" / "golden" / "aggregate_hashes.json"
REGENERATE = f"{sys.executable} {CHILD.relative_to(ROOT)} --write {GOLDEN.relative_to(ROOT)}"


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    return all_hashes(SEED)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_golden_hashes_match(reference: dict[str, object]) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert reference == golden, (
        "canonical aggregation bytes changed: two validators on different versions would no "
        f"longer agree. If the change is intended (a protocol change), regenerate with: "
        f"{REGENERATE}"
    )


def test_golden_file_covers_every_registered_rule() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert set(rule_names()) <= set(golden["rules"])


@pytest.mark.parametrize("order_seed", [1, 2, 3])
def test_input_order_does_not_change_bits(reference: dict[str, object], order_seed: int) -> None:
    assert rule_hashes(SEED, order_seed) == reference["rules"], f"order_seed={order_seed}"


@pytest.mark.usefixtures("threads")
def test_thread_count_does_not_change_bits(reference: dict[str, object]) -> None:
    for count in (1, 2):
        torch.set_num_threads(count)
        assert all_hashes(SEED) == reference, f"torch.set_num_threads({count})"


@pytest.mark.parametrize(
    "capability",
    [None, "default", "avx2"],
    ids=["same-cpu-path", "no-simd", "avx2"],
)
def test_a_separate_process_computes_the_same_bits(
    reference: dict[str, object], capability: str | None
) -> None:
    """A child process with one thread, and children forced onto other SIMD code paths
    (``ATEN_CPU_CAPABILITY``: scalar code, 256-bit vectors), as another machine would be."""
    env = dict(os.environ)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    completed = subprocess.run(
        [sys.executable, str(CHILD), "--seed", str(SEED), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == reference, f"ATEN_CPU_CAPABILITY={capability}"


@pytest.mark.parametrize(
    "length", [1, 2, 3, 255, 256, 257, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 17]
)
def test_streamed_distances_equal_sqdist64(length: int) -> None:
    """The fused per-pass distances are bit-identical to exact.sqdist64/sqnorm64."""
    vectors = adversarial_vectors(SEED + length, count=3, length=length)
    reference = adversarial_vectors(SEED - length, count=1, length=length)[0]
    workspace = Workspace()
    combiner = WeightedSpans(range(3), [0.25, 0.5, 0.25], workspace)
    aggregate, squares = stream_pass(vectors, combiner, workspace, [reference, None])
    expected = [sqdist64(v, aggregate) for v in [*vectors, reference]] + [sqnorm64(aggregate)]
    assert [s.hex() for s in squares] == [e.hex() for e in expected], f"length={length}"


def test_many_rows_keep_fewer_tail_values_and_the_same_sums(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the stored partial sums would exceed the budget, the tree finishes earlier per
    span: the same sums, less memory."""
    monkeypatch.setattr(rules_basic, "PARTIAL_BUDGET", 64)
    vectors = adversarial_vectors(SEED, count=3, length=2 * CHUNK + 5)
    sums = RowSums(10, vectors[0].numel(), 4, Workspace())
    assert sums.tail < rules_basic.TAIL
    assert_pairwise_exact(vectors)


def assert_pairwise_exact(vectors: list[torch.Tensor]) -> None:
    distances = pairwise_squared_distances(vectors, Workspace())
    for i, a in enumerate(vectors):
        for j, b in enumerate(vectors):
            expected = 0.0 if i == j else sqdist64(a, b)
            assert distances[i][j].hex() == expected.hex(), (i, j)


def test_pairwise_distances_equal_sqdist64() -> None:
    assert_pairwise_exact(adversarial_vectors(SEED, count=4, length=2 * CHUNK + 17))


def test_distances_are_finite_for_the_adversarial_inputs() -> None:
    """A guard for the test itself: the large magnitudes stay finite in float64."""
    vectors = adversarial_vectors(SEED)
    assert all(math.isfinite(sqnorm64(v)) for v in vectors)
    assert all(bool(torch.isfinite(v).all()) for v in vectors)
