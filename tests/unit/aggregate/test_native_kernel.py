"""The C kernel of the weighted pass (``p2ptrain.aggregate.native``, compiled into the
package by setup.py or built on first use by ``p2ptrain.store.kernel_build``) gives the bits
of the torch code it replaces, whichever way it was compiled; a packaged kernel built from
another source is not used; and a machine that cannot build it, or a process that installs
none, falls back to that code."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from p2ptrain.aggregate import native, rules_basic
from p2ptrain.aggregate.cohort import Contribution
from p2ptrain.aggregate.exact import CHUNK
from p2ptrain.aggregate.rules import make_rule, rule_names
from p2ptrain.aggregate.rules_basic import TrimmedSpans, WeightedSpans, Workspace, stream_pass
from p2ptrain.core.manifests import AggregationSpec
from p2ptrain.store import kernel_build
from tests.support.bit_exact_child import SEED, adversarial_vectors

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "stream_pass", lambda *args, **kwargs: False)


def _pass(
    vectors: list[torch.Tensor], indices: list[int], coefficients: list[float]
) -> tuple[bytes, list[str]]:
    workspace = Workspace()
    combiner = WeightedSpans(indices, coefficients, workspace)
    aggregate, squares = stream_pass(vectors, combiner, workspace, [vectors[0], None])
    return aggregate.numpy().tobytes(), [s.hex() for s in squares]


@needs_compiler
def test_the_kernel_builds_where_a_compiler_exists() -> None:
    assert native.available()


@needs_compiler
@pytest.mark.parametrize(
    "length", [CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 17, 17 * CHUNK + 255, 40 * CHUNK + 3]
)
@pytest.mark.parametrize("budget", [rules_basic.PARTIAL_BUDGET, 64])
def test_kernel_and_torch_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, length: int, budget: int
) -> None:
    """Partial last blocks, more blocks than one thread's task, and (with a small budget)
    fewer tail values per block; a subset of the rows combined, out of order."""
    monkeypatch.setattr(rules_basic, "PARTIAL_BUDGET", budget)
    vectors = adversarial_vectors(SEED + length, count=4, length=length)
    indices, coefficients = [3, 0, 2], [0.2, 0.3, 0.5]
    taken: list[bool] = []
    kernel = native.stream_pass

    def recording(*args: object, **kwargs: object) -> bool:
        taken.append(kernel(*args, **kwargs))  # type: ignore[arg-type]
        return taken[-1]

    monkeypatch.setattr(native, "stream_pass", recording)
    natively = _pass(vectors, indices, coefficients)
    assert taken == [True], "the kernel did not take the pass"
    _torch_only(monkeypatch)
    assert natively == _pass(vectors, indices, coefficients), f"length={length} budget={budget}"


@needs_compiler
def test_every_rule_gives_the_same_result_with_and_without_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = torch.Generator().manual_seed(SEED)
    contributions = [
        Contribution(f"{i:064x}", torch.randn(3 * CHUNK + 5, generator=generator), float(i + 1))
        for i in range(7)
    ]

    def run() -> list[object]:
        found: list[object] = []
        for rule in rule_names():
            result = make_rule(AggregationSpec(rule=rule)).aggregate(contributions)
            assert result.aggregate is not None
            found.append(result.aggregate.numpy().tobytes())
            found.append([(d.status, d.distance, d.detail) for d in result.diagnostics])
        return found

    natively = run()
    _torch_only(monkeypatch)
    assert natively == run()


@needs_compiler
@pytest.mark.parametrize(
    ("n", "trim"), [(1, 0), (2, 0), (4, 1), (5, 2), (8, 3), (9, 2), (12, 5), (16, 4), (16, 7)]
)
def test_trimmed_kernel_and_torch_give_the_same_bits_and_counts(
    monkeypatch: pytest.MonkeyPatch, n: int, trim: int
) -> None:
    """Ties, -0.0 against +0.0, subnormals and a far-out update; odd and even counts,
    medians ((n - 1) // 2 trimmed) included; 9 to 16 updates are sorted eight coordinates at
    a time in registers by the kernel (the vectors' last 44 coordinates by the comparators
    the rule gives it)."""
    vectors = adversarial_vectors(SEED + n, count=n, length=2 * CHUNK + 300)

    def run() -> tuple[bytes, list[str], list[int]]:
        workspace = Workspace()
        combiner = TrimmedSpans(n, trim, workspace)
        aggregate, squares = stream_pass(vectors, combiner, workspace, [None])
        return aggregate.numpy().tobytes(), [s.hex() for s in squares], combiner.dropped.tolist()

    natively = run()
    _torch_only(monkeypatch)
    assert natively == run(), f"n={n} trim={trim}"


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """The build's loader installed afresh (installing forgets the loaded library), with an
    empty cache and no packaged kernel; afterwards it is installed again, to load the
    kernel for the rest."""
    monkeypatch.setenv("P2PTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "packaged_kernel", lambda: None)
    native.install_kernel(kernel_build.load_kernel)
    yield
    monkeypatch.undo()
    native.install_kernel(kernel_build.load_kernel)


PACKAGED = native.KERNEL_SOURCE.with_name("_kernel.so")
needs_packaged = pytest.mark.skipif(
    not PACKAGED.exists(), reason="the install compiled no kernel into the package (no cc)"
)


@needs_compiler
@needs_packaged
def test_the_packaged_and_the_built_kernel_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    vectors = adversarial_vectors(SEED, count=5, length=3 * CHUNK + 17)
    terms = ([0, 2, 3, 4], [0.25, -1.5, 0.125, 2.0])
    native.install_kernel(kernel_build.load_kernel)
    assert native.available() and kernel_build.backend() == "native (packaged)"
    packaged = _pass(vectors, *terms)
    with monkeypatch.context() as patched:
        patched.setenv("P2PTRAIN_CACHE", str(tmp_path))
        patched.setattr(kernel_build, "packaged_kernel", lambda: None)
        native.install_kernel(kernel_build.load_kernel)
        assert native.available() and kernel_build.backend() == "native (built)"
        built = _pass(vectors, *terms)
    native.install_kernel(kernel_build.load_kernel)
    assert packaged == built
    _torch_only(monkeypatch)
    assert _pass(vectors, *terms) == packaged


@needs_packaged
def test_a_packaged_kernel_built_from_another_source_is_not_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    changed = tmp_path / "kernel.c"
    changed.write_bytes(native.KERNEL_SOURCE.read_bytes() + b"/* edited */\n")
    shutil.copy(PACKAGED, tmp_path / "_kernel.so")
    monkeypatch.setattr(native, "KERNEL_SOURCE", changed)
    with caplog.at_level(logging.INFO, logger=kernel_build.__name__):
        assert kernel_build.packaged_kernel() is None
    assert "built from another kernel.c" in caplog.text
    monkeypatch.undo()
    assert kernel_build.packaged_kernel() is not None  # the install's own matches


def test_the_backend_is_named_once_a_pass_asked_for_the_kernel() -> None:
    loader = native.installed_loader()
    native.install_kernel(kernel_build.load_kernel)
    try:
        assert kernel_build.backend() is None  # nothing aggregated yet
        native.available()
        named = kernel_build.backend()
        assert named is not None and named.startswith(("native (", "torch ("))
        native.install_kernel(None)
        assert kernel_build.backend() is None
    finally:
        native.install_kernel(loader)


@pytest.mark.usefixtures("fresh_library")
def test_a_failing_compiler_falls_back_to_torch_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")  # exists, always fails
    with caplog.at_level(logging.WARNING, logger=kernel_build.__name__):
        assert not native.available()
    assert kernel_build.backend() == "torch (the kernel did not build)"
    assert "could not build the aggregation kernel" in caplog.text
    assert "P2PTRAIN_NATIVE=0" in caplog.text
    vectors = adversarial_vectors(SEED, count=2, length=CHUNK + 9)
    assert len(_pass(vectors, [0, 1], [0.5, 0.5])[1]) == 4


@pytest.mark.usefixtures("fresh_library")
def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("P2PTRAIN_NATIVE", "0")
    assert not native.available()
    assert not any(tmp_path.iterdir()), "nothing is built when the kernel is off"


def test_without_an_installed_kernel_every_pass_takes_the_torch_path() -> None:
    loader = native.installed_loader()
    native.install_kernel(None)
    try:
        assert not native.available()
        vectors = adversarial_vectors(SEED, count=2, length=CHUNK + 9)
        assert len(_pass(vectors, [0, 1], [0.5, 0.5])[1]) == 4
        kernel_build.ensure_kernel()
        assert native.installed_loader() is kernel_build.load_kernel
    finally:
        native.install_kernel(loader)


def test_ensure_kernel_keeps_an_installed_loader() -> None:
    loader = native.installed_loader()

    def no_library() -> None:
        return None

    native.install_kernel(no_library)
    try:
        kernel_build.ensure_kernel()
        assert native.installed_loader() is no_library
        assert not native.available()
    finally:
        native.install_kernel(loader)
